"""Deterministic toy rewards for the `tiny` configs (random models emit arbitrary text).

`compute_score` (GRPO/PPO tiny) scores a response by the fraction of its characters that are ASCII digits
or spaces (0 for an empty response). It varies across samples of one prompt (so GRPO/PPO get non-zero
advantages), needs no answer checking, a policy can raise it by favouring digit/space tokens, and a critic
can predict it from the prefix it has seen (so `critic/vf_explained_var` can rise).

`contains_digit` (DAPO tiny) is binary (see its docstring).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    del data_source, ground_truth, extra_info
    if not solution_str:
        return 0.0
    return float(sum(ch.isdigit() or ch == " " for ch in solution_str) / len(solution_str))


def contains_digit(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response contains an ASCII digit, else 0.0: a binary, accuracy-like toy reward, so the
    responses of a prompt are sometimes all right or all wrong (what DAPO's dynamic sampling filters out)."""
    del data_source, ground_truth, extra_info
    return float(any(ch.isdigit() for ch in solution_str))
