"""RewardManager: decoded responses -> rule scores -> token-level scores (verl's NaiveRewardManager).

For each row: decode the response tokens that exist (`response_attention_mask`), call
`compute_score(data_source, solution_str, ground_truth, extra_info)`, and put the score on the row's
last trained token (`loss_mask`: the model's last token; the last existing token when there is no
`loss_mask`). Calls run in a process pool with a per-call timeout (`pool.py`), or in
process on a helper thread with the same timeout when `num_workers=0` (`inprocess.py`). A call that
raises, times out, kills its worker or returns something that is not a finite number / a dict with a finite
'score' (NaN, inf) scores 0.0 and is counted. When more than `max_error_fraction` of a batch's calls fail, the
batch raises `RewardFunctionError` (the first failure, its traceback, the function and the data source):
a reward function that fails on most inputs is a bug, not a zero reward.

Overlong reward shaping (DAPO, `reward_model.overlong_buffer.*`; verl's `DAPORewardManager`): when
`overlong_buffer_len` is set, `core_algos.compute_overlong_penalty` of each response's length is added
to its score (failed calls included: the length is known), and the extra infos gain `acc` (the reward
function's own score, unless it reports an `acc` itself) and, with `overlong_log`, `overlong_reward`
(the penalty) and `overlong` (penalty < 0), the names verl records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_post.rewards.inprocess import ThreadCaller, call_safely, warn_unprotected
from jaxrl_post.rewards.outputs import RewardFunctionError, RewardOutput, fn_label, to_float
from jaxrl_post.rewards.pool import CallResult, RewardWorkerPool

__all__ = ["RewardFunctionError", "RewardManager", "RewardOutput", "rm_score"]

log = logging.getLogger(__name__)


def rm_score(data_source, solution_str, ground_truth, extra_info=None):
    """The reward model's score as the reward: `extra_info['rm_score']` (the reward function used when
    `reward_model.enable` and no `custom_reward_function` is set; verl's reward manager then returns
    `rm_scores` as they are). Raises KeyError when the row has no RM score."""
    del data_source, solution_str, ground_truth
    if not extra_info or "rm_score" not in extra_info:
        raise KeyError("rm_score: no 'rm_score' in extra_info (is reward_model.enable on?)")
    return float(extra_info["rm_score"])


def _preload(compute_score) -> tuple[str, ...]:
    """Modules a reward worker imports before its first call: reasoning-gym for the built-in scorer (its import
    takes seconds, tens on a loaded machine: inside a call it would time out, and so would each replacement)."""
    from jaxrl_post.rewards import default_compute_score  # here: jaxrl_post.rewards imports this module

    return ("reasoning_gym",) if compute_score is default_compute_score else ()


class RewardManager:
    """Scores a rollout batch with a rule reward function.

    Args:
      compute_score: fn(data_source, solution_str, ground_truth, extra_info) -> float | dict with
        'score' (other keys become extra infos). Default: `default_compute_score`.
      tokenizer: HF-style tokenizer with `batch_decode` / `decode`.
      num_workers: processes in the reward pool; 0 = call in process (on a helper thread, see inprocess.py).
      timeout_s: per-call limit in seconds; None = no limit (num_workers=0 only: calls run on this thread).
      mp_context: 'forkserver' (default on POSIX) or 'spawn'.
      skip_special_tokens: passed to decode (verl decodes with True).
      num_examine: log this many decoded responses of the first call (debugging aid, like verl).
      max_error_fraction: `compute` raises RewardFunctionError when more than this fraction of a batch's
        calls fail (raise, time out, crash, bad return value); 1.0 = never raise.
      overlong_buffer_len: DAPO overlong shaping (see the module docstring) over the last this many tokens
        before `max_response_length`; None = off.
      overlong_penalty_factor: the penalty at `max_response_length` tokens (>= 0).
      max_response_length: `data.max_response_length` (needed with `overlong_buffer_len`).
      overlong_log: add the `overlong_reward` / `overlong` extra infos.
      rm_scorer: optional reward-model role, `fn(data) -> rm_scores [B] float32`
        (`rewards.rm_scorer.RewardModelScorer`), called once per batch unless the batch already carries
        `rm_scores` (verl's key: a reward model scored it upstream). Each row's score reaches the reward
        function as `extra_info['rm_score']` (so a custom function can combine it with a rule score; `rm_score`
        returns it as the reward) and the metrics gain `reward_model/score_{mean,max,min}`.
    Raises (at construction): TypeError if `compute_score` is not picklable and num_workers > 0;
      ValueError if `max_error_fraction` is not in [0, 1], `timeout_s` is not > 0, or
      `overlong_buffer_len` is not in (0, max_response_length] (or the factor < 0).
    """

    def __init__(
        self,
        compute_score: Callable[..., Any] | None = None,
        tokenizer: Any = None,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        mp_context: str | None = None,
        skip_special_tokens: bool = True,
        num_examine: int = 0,
        max_error_fraction: float = 0.5,
        overlong_buffer_len: int | None = None,
        overlong_penalty_factor: float = 0.0,
        max_response_length: int | None = None,
        overlong_log: bool = False,
        rm_scorer: Callable[[Any], np.ndarray] | None = None,
    ):
        if compute_score is None:
            # here, not at the top: jaxrl_post.rewards (its __init__) imports this module
            from jaxrl_post.rewards import default_compute_score

            compute_score = default_compute_score
        if tokenizer is None:
            raise ValueError("RewardManager needs a tokenizer to decode responses")
        self.compute_score = compute_score
        self.tokenizer = tokenizer
        self.num_workers = int(num_workers)
        self.timeout_s = timeout_s
        self.skip_special_tokens = skip_special_tokens
        self.num_examine = num_examine
        self._examined = 0
        if not 0.0 <= float(max_error_fraction) <= 1.0:
            raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (or None in process), got {timeout_s}")
        self.max_error_fraction = float(max_error_fraction)
        if overlong_buffer_len is not None:
            # here, not at the top: jaxrl_post.rewards imports without jax (reward worker processes)
            from jaxrl_post.algos.reward_shaping import (
                compute_overlong_penalty,
            )

            if max_response_length is None:
                raise ValueError("overlong_buffer_len needs max_response_length")
            compute_overlong_penalty(np.zeros((1,), np.int32), max_response_length, overlong_buffer_len, 0.0)
            if overlong_penalty_factor < 0:
                raise ValueError(f"overlong_penalty_factor must be >= 0, got {overlong_penalty_factor}")
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = float(overlong_penalty_factor)
        self.max_response_length = max_response_length
        self.overlong_log = bool(overlong_log)
        self._batched = callable(getattr(compute_score, "score_batch", None))
        self.rm_scorer = rm_scorer
        self._pool = (
            RewardWorkerPool(compute_score, self.num_workers, timeout_s, mp_context, preload=_preload(compute_score))
            if self.num_workers > 0 and not self._batched
            else None
        )
        self._thread = (
            ThreadCaller(compute_score, timeout_s) if self._pool is None and timeout_s and not self._batched else None
        )
        if self._pool is None and not self._batched:
            warn_unprotected(compute_score)
        self.total_errors = self.total_timeouts = 0

    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def response_mask(data) -> np.ndarray:
        """[B, R] bool: the response tokens that exist (`response_attention_mask`, else verl's `response_mask`,
        else the response part of `attention_mask`). Raises KeyError / ValueError when none is there or the
        shapes differ."""
        responses = np.asarray(data.batch["responses"])
        for key in ("response_attention_mask", "response_mask"):
            if key in data.batch:
                mask = np.asarray(data.batch[key]).astype(bool)
                break
        else:
            if "attention_mask" not in data.batch:
                raise KeyError(
                    "batch needs 'response_attention_mask' (or 'response_mask' / 'attention_mask') to know the "
                    "response tokens"
                )
            key, mask = "attention_mask", np.asarray(data.batch["attention_mask"])[:, -responses.shape[1] :] != 0
        if mask.shape != responses.shape:
            raise ValueError(f"{key} shape {mask.shape} != responses shape {responses.shape}")
        return mask

    def decode_responses(self, data) -> tuple[list[str], np.ndarray]:
        """Decoded response tokens per row (all that exist, tool/observation tokens included) and the [B] int
        index of each row's last trained token (`loss_mask`; the last existing one without it; -1 when a row
        has none): the token the outcome score is placed on."""
        responses = np.asarray(data.batch["responses"])
        mask = self.response_mask(data)
        token_lists = [responses[i][mask[i]].tolist() for i in range(responses.shape[0])]
        texts = self.tokenizer.batch_decode(token_lists, skip_special_tokens=self.skip_special_tokens)
        R = responses.shape[1]
        if "loss_mask" in data.batch:
            mask = np.asarray(data.batch["loss_mask"]).astype(bool) & mask
        last = np.where(mask.any(axis=1), R - 1 - np.argmax(mask[:, ::-1], axis=1), -1)
        return list(texts), last

    def decode_prompts(self, data) -> list[str] | None:
        """Decoded prompt per row (its real tokens: `attention_mask[:, :P]`), or None when the batch has no
        'prompts' [B, P] or 'attention_mask' [B, P+R] (a batch scorer then sends "")."""
        if "prompts" not in data.batch or "attention_mask" not in data.batch:
            return None
        prompts = np.asarray(data.batch["prompts"])
        mask = np.asarray(data.batch["attention_mask"])[:, : prompts.shape[1]].astype(bool)
        seqs = [prompts[i][mask[i]].tolist() for i in range(prompts.shape[0])]
        return list(self.tokenizer.batch_decode(seqs, skip_special_tokens=self.skip_special_tokens))

    @staticmethod
    def ground_truths(data) -> list[Any]:
        """Each row's ground truth: non_tensor 'ground_truth', else verl's 'reward_model'['ground_truth'].
        Raises KeyError when the batch has neither."""
        nt = data.non_tensor_batch
        if "ground_truth" in nt:
            return list(nt["ground_truth"])
        if "reward_model" in nt:
            return [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in nt["reward_model"]]
        raise KeyError("non_tensor_batch needs 'ground_truth' or 'reward_model' (with 'ground_truth')")

    def compute(self, data) -> RewardOutput:
        """Score `data` (a DataProto with batch 'responses' [B, R], 'response_attention_mask' [B, R] (or
        verl's 'response_mask'), optional 'loss_mask' [B, R], and
        non_tensor 'data_source', 'ground_truth' (or 'reward_model'), optional 'extra_info').

        Raises:
          RewardFunctionError: more than `max_error_fraction` of the calls failed.
          KeyError / ValueError: the batch lacks a needed key or its masks do not match.
        """
        texts, last = self.decode_responses(data)
        B = len(texts)
        R = np.asarray(data.batch["responses"]).shape[1]
        nt = data.non_tensor_batch
        if "data_source" not in nt:
            raise KeyError("non_tensor_batch needs 'data_source'")
        sources = list(nt["data_source"])
        gts = self.ground_truths(data)
        infos = list(nt["extra_info"]) if "extra_info" in nt else [None] * B
        rm_scores, rm_metrics = self._rm_scores(data, B)
        if rm_scores is not None:  # a copy per row: the batch's own extra_info dicts are left as they are
            infos = [dict(info or {}, rm_score=float(s)) for info, s in zip(infos, rm_scores)]
        args = [(sources[i], texts[i], gts[i], infos[i]) for i in range(B)]

        batch_metrics: dict[str, float] = {}
        if self._batched:
            results = list(self.compute_score.score_batch(args, self.decode_prompts(data)))
            if len(results) != B:
                raise RuntimeError(f"{fn_label(self.compute_score)} returned {len(results)} results for {B} rows")
            batch_metrics = dict(getattr(self.compute_score, "last_metrics", {}) or {})
        elif self._pool is not None:
            results = self._pool.map(args)
        elif self._thread is not None:
            results = [self._thread.call(a) for a in args]
        else:
            results = [call_safely(self.compute_score, a) for a in args]

        scores = np.zeros((B,), np.float32)
        extra: dict[str, list[Any]] = {}
        n_err = n_timeout = 0
        errors: list[str] = []
        first_fail: tuple[int, CallResult] | None = None
        for i, res in enumerate(results):
            if res.status == "ok":
                try:
                    value = res.value
                    if isinstance(value, dict):
                        if "score" not in value:
                            raise KeyError(f"dict reward without 'score' key: keys {sorted(value)}")
                        s = to_float(value["score"])
                        for k, v in value.items():
                            if k != "score":
                                extra.setdefault(k, [None] * B)[i] = v
                    else:
                        s = to_float(value)
                    if not np.isfinite(s):  # NaN/inf would reach the advantages: a failed call (as the remote client)
                        raise ValueError(f"reward {s!r} is not a finite number")
                    scores[i] = s
                    continue
                except Exception as e:
                    res = CallResult("error", message=f"{type(e).__name__}: {e}", exception=e)
            first_fail = first_fail or (i, res)
            n_err += 1  # every failed call, timeouts included (issue: "raises or exceeds its timeout")
            if res.status == "timeout":
                n_timeout += 1
            if len(errors) < 8:
                errors.append(f"row {i} (data_source={sources[i]!r}): {res.message}")
        if first_fail is not None and n_err > self.max_error_fraction * B:
            self._raise_failed(first_fail, sources, n_err, n_timeout, B)
        if errors:
            log.warning(
                "reward: %d failed calls (%d timeouts) in a batch of %d; first: %s", n_err, n_timeout, B, errors[0]
            )
        self.total_errors += n_err
        self.total_timeouts += n_timeout

        function_scores = scores.copy()
        if self.overlong_buffer_len is not None:
            # here, not at the top: jaxrl_post.rewards imports without jax (reward worker processes)
            from jaxrl_post.algos.reward_shaping import compute_overlong_penalty

            lengths = self.response_mask(data).sum(-1)
            penalty = np.asarray(
                compute_overlong_penalty(
                    lengths, self.max_response_length, self.overlong_buffer_len, self.overlong_penalty_factor
                )
            )
            scores = (scores + penalty).astype(np.float32)
            if "acc" not in extra:
                extra["acc"] = function_scores.tolist()
            if self.overlong_log:
                extra["overlong_reward"] = penalty.tolist()
                extra["overlong"] = (penalty < 0).tolist()

        token_level = np.zeros((B, R), np.float32)
        rows = np.arange(B)
        token_level[rows, np.maximum(last, 0)] = scores  # rows without valid tokens: column 0 (masked anyway)

        extra_infos: dict[str, np.ndarray] = {}
        metrics: dict[str, float] = {
            "reward/num_errors": float(n_err),
            "reward/num_timeouts": float(n_timeout),
            **batch_metrics,
            **rm_metrics,
        }
        for k, vals in extra.items():
            try:
                arr = np.array([np.nan if v is None else to_float(v) for v in vals], np.float32)
                if np.isfinite(arr).any():
                    metrics[f"reward/extra/{k}/mean"] = float(np.nanmean(arr))
            except TypeError:
                arr = np.empty((B,), object)
                arr[:] = vals
            extra_infos[k] = arr

        if self._examined < self.num_examine:
            for i in range(min(B, self.num_examine - self._examined)):
                log.info("[reward example] source=%s gt=%r score=%.3f\n%s", sources[i], gts[i], scores[i], texts[i])
            self._examined = self.num_examine
        return RewardOutput(token_level, scores, metrics, extra_infos, errors, function_scores)

    def _rm_scores(self, data, B: int) -> tuple[np.ndarray | None, dict[str, float]]:
        """`(rm_scores [B] float32 or None, reward_model/* metrics)`: the batch's `rm_scores`, else the
        `rm_scorer`'s. Raises ValueError when their shape is not [B] or a score is not finite."""
        if "rm_scores" in data.batch:
            scores, metrics = np.asarray(data.batch["rm_scores"], np.float32), {}
        elif self.rm_scorer is not None:
            scores = np.asarray(self.rm_scorer(data), np.float32)
            metrics = dict(getattr(self.rm_scorer, "last_metrics", {}) or {})
        else:
            return None, {}
        if scores.shape != (B,):
            raise ValueError(f"rm_scores: expected shape ({B},), got {scores.shape}")
        if not np.isfinite(scores).all():
            raise ValueError(
                f"rm_scores: {int((~np.isfinite(scores)).sum())} of {B} reward-model scores are not finite"
            )
        metrics.update(
            {
                "reward_model/score_mean": float(scores.mean()),
                "reward_model/score_max": float(scores.max()),
                "reward_model/score_min": float(scores.min()),
            }
        )
        return scores, metrics

    def _raise_failed(self, first: tuple[int, CallResult], sources: list, n_err: int, n_timeout: int, B: int):
        i, res = first
        key = getattr(self.compute_score, "max_error_fraction_key", "reward_model.max_error_fraction")
        where = "batch scorer" if self._batched else "in worker processes" if self._pool is not None else "in process"
        msg = (
            f"reward function {fn_label(self.compute_score)} failed on {n_err} of {B} responses "
            f"({n_err / B:.0%}, {n_timeout} timeouts; limit {key}="
            f"{self.max_error_fraction:g}). First failure, row {i} (data_source={sources[i]!r}), {where}: "
            f"{res.message}"
        )
        if res.traceback and res.exception is None:  # raised in a worker process: show its traceback here
            msg += "\n\nTraceback of that call (reward worker):\n" + res.traceback.rstrip()
        raise RewardFunctionError(msg) from res.exception

    def __call__(self, data) -> tuple[np.ndarray, dict[str, float]]:
        """-> (token_level_scores [B, R] float32, metrics incl. 'reward/num_errors', 'reward/num_timeouts')."""
        out = self.compute(data)
        return out.token_level_scores, out.metrics

    def close(self) -> None:
        if self._batched and callable(getattr(self.compute_score, "close", None)):
            self.compute_score.close()
        if self._pool is not None:
            self._pool.close()
        if self._thread is not None:
            self._thread.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter shutdown modules may be gone; close() ran or the workers are ending
            log.debug("%s.close() at garbage collection failed", type(self).__name__, exc_info=True)
