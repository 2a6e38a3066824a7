"""Validation metrics from per-sample scores, named as verl's `process_validation_metrics`.

Input: one entry per generated response (a prompt sampled n times gives n entries sharing a `uid`):
`data_source [N]`, `uid [N]`, numeric per-sample variables (`reward [N]`, optionally `acc [N]`, ...)
and optionally extracted answers `pred [N]` (for majority voting).

Per prompt and variable (verl names; k runs over 2, 4, 8, ... < n, and n):

    mean@{n}                 mean over the prompt's n responses
    std@{n}                  population std over them                       (n > 1)
    best@{k}/mean, /std      max of k responses drawn with replacement      (n > 1)
    worst@{k}/mean, /std     min of k responses drawn with replacement      (n > 1)
    maj@{k}/mean, /std       value of the majority-voted answer among k     (n > 1, answers given)
    pass@{k}                 P(at least one of k draws *without* replacement is correct) (n > 1, core var)

then averaged over the prompts of each data source and named `{group}/{data_source}/{var}/{metric}` with
group `val-core` for the core variable (`acc` when present, else `reward`) and its metrics starting
with mean / maj / best / pass at the largest n of that variable (e.g. `mean@n`, `best@n/mean`,
`best@n/std`, as verl's `_validate`); `val-aux` otherwise.

Differences from verl, on purpose: best@k / worst@k are computed exactly (the expectation and std over
all n^k equally likely draws, which verl's 1000-resample bootstrap estimates); maj@k is exact when
n^k <= `exact_limit` and a seeded, vectorised bootstrap (same estimator as verl) otherwise; pass@k is
the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1).

All functions are plain numpy on the host.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_post import rewards

CORE_PREFIXES = ("mean", "maj", "best", "pass")


def sample_sizes(n: int) -> list[int]:
    """verl's k values for a prompt with n responses: 2, 4, 8, ... (< n), then n. Empty for n <= 1."""
    if n <= 1:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: `1 - C(n-c, k) / C(n, k)` (Chen et al. 2021).

    Computed as `1 - prod_{i=n-c+1}^{n} (1 - k / i)` (numerically stable). Raises ValueError unless
    0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def best_of_k(values: Sequence[float], k: int) -> tuple[float, float]:
    """(mean, std) of max(v[i_1], ..., v[i_k]) with i_j drawn uniformly with replacement, exactly.

    With the values sorted ascending, the largest drawn sorted index is i with probability
    `(i/n)^k - ((i-1)/n)^k` (i = 1..n), so E[max] and E[max^2] are weighted sums. `values: [n]`.
    """
    v = np.sort(np.asarray(values, np.float64))
    n = v.size
    if n == 0 or k < 1:
        raise ValueError(f"best_of_k needs n >= 1 values and k >= 1, got n={n} k={k}")
    i = np.arange(1, n + 1, dtype=np.float64)
    w = (i / n) ** k - ((i - 1) / n) ** k
    mean = float(np.sum(w * v))
    var = float(np.sum(w * v * v)) - mean * mean
    return mean, math.sqrt(max(var, 0.0))


def worst_of_k(values: Sequence[float], k: int) -> tuple[float, float]:
    """(mean, std) of min over k draws with replacement (see `best_of_k`)."""
    mean, std = best_of_k(-np.asarray(values, np.float64), k)
    return -mean, std


def _vote(draws: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Index (into the sample) of the voted response of each draw row `draws [D, k]`.

    The answer with the most votes wins; ties go to the answer drawn first (verl: `Counter.most_common`
    keeps insertion order); the voted response is the first drawn one with that answer.
    """
    cls = classes[draws]  # [D, k]
    n_cls = int(classes.max()) + 1
    d, k = draws.shape
    counts = np.zeros((d, n_cls), np.int64)
    np.add.at(counts, (np.repeat(np.arange(d), k), cls.reshape(-1)), 1)
    first = np.full((d, n_cls), k, np.int64)
    pos = np.broadcast_to(np.arange(k), (d, k))
    np.minimum.at(first, (np.repeat(np.arange(d), k), cls.reshape(-1)), pos.reshape(-1))
    is_max = counts == counts.max(axis=1, keepdims=True)
    winner = np.argmin(np.where(is_max, first, k + 1), axis=1)  # earliest-drawn among the tied
    return draws[np.arange(d), first[np.arange(d), winner]]


def maj_of_k(
    values: Sequence[float],
    preds: Sequence[Any],
    k: int,
    *,
    exact_limit: int = 4096,
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> tuple[float, float]:
    """(mean, std) of the value of the majority-voted response among k drawn with replacement.

    Args:
      values: `[n]` the responses' scores. preds: `[n]` their extracted answers (hashable; None is an
        answer like any other, as in verl).
      exact_limit: enumerate all n^k equally likely ordered draws when n^k <= exact_limit (exact);
        otherwise `n_bootstrap` random draws from `np.random.default_rng(seed)` (verl's estimator).
    """
    v = np.asarray(values, np.float64)
    n = v.size
    if n == 0 or k < 1 or len(preds) != n:
        raise ValueError(f"maj_of_k needs n >= 1 values with n preds and k >= 1, got n={n}, {len(preds)} preds, k={k}")
    _, classes = np.unique(np.asarray([repr(p) for p in preds], dtype=object), return_inverse=True)
    classes = classes.reshape(-1)
    if n**k <= exact_limit:
        draws = np.asarray(list(itertools.product(range(n), repeat=k)), np.int64).reshape(-1, k)
    else:
        draws = np.random.default_rng(seed).integers(0, n, size=(n_bootstrap, k))
    vals = v[_vote(draws, classes)]
    return float(vals.mean()), float(vals.std())


def prompt_metrics(
    values: Sequence[float],
    preds: Sequence[Any] | None = None,
    *,
    correct: Sequence[bool] | None = None,
    exact_limit: int = 4096,
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> dict[str, float]:
    """Metrics of one prompt's n responses for one variable (names without prefixes; see module doc)."""
    v = np.asarray(values, np.float64)
    n = v.size
    out = {f"mean@{n}": float(v.mean())}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(v.std())
    for k in sample_sizes(n):
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = best_of_k(v, k)
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = worst_of_k(v, k)
        if preds is not None:
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = maj_of_k(
                v, preds, k, exact_limit=exact_limit, n_bootstrap=n_bootstrap, seed=seed
            )
        if correct is not None:
            out[f"pass@{k}"] = pass_at_k(n, int(np.sum(np.asarray(correct, bool))), k)
    return out


def process_validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Any],
    infos: Mapping[str, Sequence[float]],
    preds: Sequence[Any] | None = None,
    *,
    pass_threshold: float = 1.0,
    exact_limit: int = 4096,
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> dict[str, float]:
    """verl-named validation metrics, averaged over prompts per data source.

    Args:
      data_sources: `[N]` data source of each response.
      uids: `[N]` prompt id of each response (the n responses of a prompt share it).
      infos: variable name -> `[N]` numeric values, e.g. `{'reward': scores, 'acc': ...}`; NaN entries
        (a row without that key) are left out of that variable.
      preds: optional `[N]` extracted answers; adds maj@k. When every answer is None it is ignored.
      pass_threshold: a response is correct for pass@k when `acc > 0.5` (if `acc` is given) or
        `reward >= pass_threshold`.

    Returns:
      `{'val-core/{ds}/{var}/mean@{n}': ..., 'val-aux/{ds}/{var}/best@{k}/std': ..., ...}`.

    Raises:
      ValueError: arrays of different lengths.
    """
    ds = np.asarray(data_sources, dtype=object).reshape(-1)
    uid = np.asarray([str(u) for u in uids], dtype=object)
    n_total = ds.size
    infos = {k: np.asarray(v, np.float64).reshape(-1) for k, v in infos.items()}
    for name, arr in [("uids", uid)] + list(infos.items()):
        if arr.size != n_total:
            raise ValueError(f"{name} has {arr.size} entries, data_sources has {n_total}")
    if preds is not None:
        preds = list(preds)
        if len(preds) != n_total:
            raise ValueError(f"preds has {len(preds)} entries, data_sources has {n_total}")
        if all(p is None for p in preds):
            preds = None
    core_var = "acc" if "acc" in infos else "reward"
    if core_var in infos:
        correct_all = infos["acc"] > 0.5 if core_var == "acc" else infos["reward"] >= pass_threshold
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i in range(n_total):
        groups[(str(ds[i]), uid[i])].append(i)

    # data source -> var -> metric -> per-prompt values
    acc: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (src, _), idx in groups.items():
        idx = np.asarray(idx)
        for var, arr in infos.items():
            sel = idx[np.isfinite(arr[idx])]
            if sel.size == 0:
                continue
            m = prompt_metrics(
                arr[sel],
                None if preds is None else [preds[i] for i in sel],
                correct=correct_all[sel] if var == core_var else None,
                exact_limit=exact_limit,
                n_bootstrap=n_bootstrap,
                seed=seed,
            )
            for name, val in m.items():
                acc[src][var][name].append(val)

    out: dict[str, float] = {}
    for src, per_var in acc.items():
        for var, per_metric in per_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in per_metric)  # as verl
            for name, vals in per_metric.items():
                core = var == core_var and name.startswith(CORE_PREFIXES) and f"@{n_max}" in name
                out[f"{'val-core' if core else 'val-aux'}/{src}/{var}/{name}"] = float(np.mean(vals))
    return out


def extract_answer(data_source: str, solution_str: str, extra_info: Mapping[str, Any] | None = None) -> str | None:
    """The comparable final answer of a response (for maj@k), or None when the source has no extractor.

    gsm8k sources: the number after the last '####' (as an exact fraction string, so '1,000' == '1000.0');
    MATH sources: the last \\boxed{...} content; reasoning-gym: the task's answer format
    (`extra_info['answer_format']`, default `<answer>` tags), whitespace-stripped.
    """

    if data_source in rewards.GSM8K_SOURCES:
        x = rewards.gsm8k.extract_solution(solution_str, method="strict")
        return None if x is None else str(x)
    if data_source in rewards.MATH_SOURCES:
        boxed = rewards.math_reward.last_boxed_only_string(solution_str)
        return None if boxed is None else rewards.math_reward.remove_boxed(boxed).strip()
    if rewards._is_reasoning_gym(data_source):  # pylint: disable=protected-access
        fmt = (extra_info or {}).get("answer_format") or "answer_tag"
        try:
            a = rewards.reasoning_gym_reward.extract_model_answer(solution_str, fmt)
        except ValueError:
            return None
        return None if a is None else a.strip()
    return None
