"""MATH-style reward: last \\boxed{...} answer, equivalence decided by `math-verify`.

Extraction follows verl's MATH reward (`verl/utils/reward_score/math.py`: the last `\\boxed{...}` /
`\\fbox{...}` of the response, braces matched); equivalence is `math_verify.verify(gold, pred)`
(symbolic / numeric, e.g. "\\frac12" == "0.5", "(1,2)" == "(1, 2)") instead of verl's string
normalisation. A response without a boxed answer scores 0.
"""

from __future__ import annotations

import threading

__all__ = ["compute_score", "last_boxed_only_string", "remove_boxed"]


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) substring of `text`, braces matched.

    Returns None when there is none or its braces are unbalanced.
    """
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):  # "\boxed 5" form, up to the next "$" or end
        rest = text[idx + len("\\boxed ") :]
        return "\\boxed " + rest.split("$")[0].strip()
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """Content of a `\\boxed{...}` / `\\fbox{...}` / `\\boxed x` string (as returned above)."""
    for prefix in ("\\boxed ",):
        if boxed.startswith(prefix):
            return boxed[len(prefix) :]
    for prefix in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix) and boxed.endswith("}"):
            return boxed[len(prefix) : -1]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """Score a MATH-style response.

    Args:
      solution_str: decoded response; its last `\\boxed{...}` is the answer.
      ground_truth: the reference answer as LaTeX without `$` (e.g. "\\frac{1}{2}"); a boxed string is
        also accepted.
    Returns:
      `score` if math-verify finds the answers equivalent, `format_score` if a boxed answer was found
      but is not equivalent, 0.0 when the response has no boxed answer.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    pred_text = remove_boxed(boxed)
    gt = str(ground_truth)
    gt_boxed = last_boxed_only_string(gt)
    if gt_boxed is not None:
        gt = remove_boxed(gt_boxed)
    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    gold = parse(f"\\boxed{{{gt}}}", extraction_config=cfg, parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{pred_text}}}", extraction_config=cfg, parsing_timeout=timeout)
    if not gold or not pred:
        return format_score
    return score if verify(gold, pred, timeout_seconds=timeout) else format_score
