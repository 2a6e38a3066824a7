"""Deterministic toy reward for the `tiny` configs (random models emit arbitrary text).

Scores a response by the fraction of its characters that are ASCII digits or spaces, plus 0.5 when its
length is even. It varies across samples of one prompt (so GRPO/PPO get non-zero advantages), needs no
answer checking, and a policy can raise it by favouring digit/space tokens.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  del data_source, ground_truth, extra_info
  if not solution_str:
    return 0.0
  frac = sum(ch.isdigit() or ch == ' ' for ch in solution_str) / len(solution_str)
  return float(frac + (0.5 if len(solution_str) % 2 == 0 else 0.0))
