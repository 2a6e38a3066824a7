"""GSM8K rule reward: verl's `gsm8k.compute_score` semantics with a numeric comparison.

verl (`verl/utils/reward_score/gsm8k.py`) extracts the answer either after "#### " (strict) or as the
last number of the response (flexible) and compares strings. Here the extraction rules are the same,
but the extracted number and the ground truth are compared as exact rationals, so "1,000" == "1000",
"$18.00" == "18", "-4" == "-4.0" and a sentence-final period ("... #### 42.") does not matter. The whole
response is searched (verl clips to the last 300 characters; we do not).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["compute_score", "extract_solution", "parse_number"]

# A number: optional sign, optional "$", digits with proper thousands separators or plain digits,
# optional decimals; or a bare decimal ".5". A trailing period is never part of the number.
_NUM_BODY = r"(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(rf"(-)?\$?({_NUM_BODY})")
# Strict: "####", optional spaces, optional "-"/"$" in either order, then the number.
_STRICT_RE = re.compile(rf"####\s*(-)?\s*\$?\s*(-)?({_NUM_BODY})")


def parse_number(text: str) -> Fraction | None:
    """Parse one number string ("1,000", "-$18.00", "42.", " 7 ") into an exact Fraction.

    Returns None when `text` is not a single number.
    """
    s = text.strip().rstrip(".").strip()
    m = re.fullmatch(rf"(-)?\s*\$?\s*(-)?({_NUM_BODY})", s)
    if m is None:
        return None
    value = Fraction(m.group(3).replace(",", ""))
    negative = bool(m.group(1)) != bool(m.group(2))
    return -value if negative else value


def extract_solution(solution_str: str, method: str = "strict") -> Fraction | None:
    """Extract the model's final answer as a Fraction.

    Args:
      solution_str: the decoded response.
      method: "strict" -> the number right after the last "####"; "flexible" -> the last number
        anywhere in the response.
    Returns:
      the number, or None when nothing matches.
    Raises:
      ValueError: unknown method.
    """
    if method == "strict":
        matches = list(_STRICT_RE.finditer(solution_str))
        if not matches:
            return None
        m = matches[-1]
        value = Fraction(m.group(3).replace(",", ""))
        return -value if bool(m.group(1)) != bool(m.group(2)) else value
    if method == "flexible":
        matches = list(_NUMBER_RE.finditer(solution_str))
        if not matches:
            return None
        m = matches[-1]
        value = Fraction(m.group(2).replace(",", ""))
        return -value if m.group(1) else value
    raise ValueError(f"gsm8k: unknown method {method!r}; expected 'strict' or 'flexible'")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Score a GSM8K response (verl's `gsm8k.compute_score` semantics, numeric comparison).

    Returns `score` if the extracted answer equals the ground truth numerically, `format_score` if an
    answer was extracted but is wrong, and 0.0 if no answer could be extracted.
    The ground truth is the number after "####" in GSM8K's answer field (e.g. "18" or "1,600").
    """
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = parse_number(str(ground_truth))
    if truth is None:
        # Non-numeric ground truth: fall back to the raw string after "####"-style normalisation.
        gt = str(ground_truth).strip().replace(",", "").replace("$", "")
        return score if _fraction_str(answer) == gt else format_score
    return score if answer == truth else format_score


def _fraction_str(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else str(float(x))
