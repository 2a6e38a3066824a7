"""Deterministic toy reward for the `tiny` configs (random models emit arbitrary text).

Scores a response by the fraction of its characters that are ASCII digits or spaces (0 for an empty
response). It varies across samples of one prompt (so GRPO/PPO get non-zero advantages), needs no answer
checking, a policy can raise it by favouring digit/space tokens, and a critic can predict it from the
prefix it has seen (so `critic/vf_explained_var` can rise).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    del data_source, ground_truth, extra_info
    if not solution_str:
        return 0.0
    return float(sum(ch.isdigit() or ch == " " for ch in solution_str) / len(solution_str))
