"""A client for a remote reward service over HTTP (OpenRLHF's `remote_rm_url`, verl's reward server).

The trainer decodes a batch and sends it to `reward_model.remote.url` in requests of at most `batch_size`
trajectories, at most `max_concurrency` in flight, each with a `timeout_s` connect/read timeout (`requests`).

Request (POST, JSON; OpenRLHF's names first, then ours; all lists have one entry per trajectory)::

    {"query": [prompt + response, ...],      # OpenRLHF: the full text
     "prompts": [prompt, ...],               # OpenRLHF: the decoded prompt ("" when the batch has none)
     "labels": [ground_truth, ...],          # OpenRLHF: the ground truth (any JSON value)
     "responses": [response, ...],           # the decoded response (our reward functions' solution_str)
     "data_sources": [data_source, ...],
     "extra_infos": [extra_info or null, ...]}

Response (HTTP 200, JSON)::

    {"rewards": [float, ...],                # required, one finite number per trajectory (OpenRLHF's key)
     "extra": [dict or null, ...],           # optional: a reward function's extra keys (become extra infos)
     "errors": [str or null, ...]}           # optional: the reward function failed on that item

Failure semantics (never a silently wrong score). Per request, these are retried with exponential backoff
(`backoff_s * 2**k`, at most `backoff_max_s`) up to `max_retries` times: connection errors, timeouts, HTTP
408/429/5xx, a body that is not JSON, no `rewards` list, the wrong number of rewards; and per item, a reward
that is not a finite number (only those items are sent again). Not retried: other HTTP 4xx (the request is
wrong: retrying cannot help) and items the server reports in `errors` (the reward function itself failed,
like a local function that raises). An item still failing after that is a failed call of the reward
manager: counted in `reward/num_errors`, and past `max_error_fraction` (default 0 for the remote source:
any failure) the step raises `RewardFunctionError` naming the URL and the first failure. Below the
fraction such items score 0.0 and are counted, exactly like a local reward function's failures.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import requests

from jaxrl_post.rewards.pool import CallResult

__all__ = ["RemoteRewardClient", "RemoteRewardError", "build_request", "retry_delay"]

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """A single-item call (`RemoteRewardClient.__call__`) failed after its retries."""


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def build_request(args: Sequence[tuple], prompts: Sequence[str] | None = None) -> dict[str, list]:
    """The request body for `args` = [(data_source, response, ground_truth, extra_info), ...] (the reward
    manager's call tuples) and the decoded prompts (None -> ""). See the module docstring for the schema."""
    prompts = list(prompts) if prompts is not None else [""] * len(args)
    if len(prompts) != len(args):
        raise ValueError(f"{len(prompts)} prompts for {len(args)} responses")
    return {
        "query": [p + a[1] for p, a in zip(prompts, args, strict=True)],
        "prompts": prompts,
        "labels": [a[2] for a in args],
        "responses": [a[1] for a in args],
        "data_sources": [a[0] for a in args],
        "extra_infos": [a[3] if len(a) > 3 else None for a in args],
    }


def retry_delay(attempt: int, backoff_s: float, backoff_max_s: float) -> float:
    """Seconds to sleep before retry `attempt` (0, 1, ...): `min(backoff_s * 2**attempt, backoff_max_s)`."""
    return min(float(backoff_s) * 2**attempt, float(backoff_max_s))


def _finite_number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class _Fatal(Exception):
    """A request failure that retrying cannot fix (HTTP 4xx other than 408/429)."""


class _Timeout(RuntimeError):
    """The request timed out (retried; reported as a 'timeout' when it is the last failure)."""


class RemoteRewardClient:
    """Scores decoded trajectories with an HTTP reward service; plugs into `RewardManager` as its
    `compute_score` (the manager calls `score_batch` for the whole batch instead of one call per row).

    Args:
      url: the endpoint (e.g. 'http://127.0.0.1:8000/get_reward'); http or https.
      batch_size: trajectories per request (>= 1).
      max_concurrency: requests in flight at once (>= 1).
      timeout_s: connect and read timeout of one request, seconds (> 0).
      max_retries: extra attempts per request after the first (>= 0).
      backoff_s: sleep before retry k (k = 0, 1, ...) is `min(backoff_s * 2**k, backoff_max_s)`.
      backoff_max_s: the longest sleep between attempts.
      headers: extra HTTP headers (e.g. an Authorization header).
    Raises:
      ValueError: a bad argument (the message names it).
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 32,
        max_concurrency: int = 4,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        headers: dict[str, str] | None = None,
    ):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward_model.remote.url must be an http:// or https:// URL, got {url!r}")
        for name, v, lo in (("batch_size", batch_size, 1), ("max_concurrency", max_concurrency, 1)):
            if isinstance(v, bool) or int(v) != v or v < lo:
                raise ValueError(f"reward_model.remote.{name} must be an int >= {lo}, got {v!r}")
        if isinstance(max_retries, bool) or int(max_retries) != max_retries or max_retries < 0:
            raise ValueError(f"reward_model.remote.max_retries must be an int >= 0, got {max_retries!r}")
        if not timeout_s > 0:
            raise ValueError(f"reward_model.remote.timeout_s must be > 0, got {timeout_s!r}")
        if backoff_s < 0 or backoff_max_s < 0:
            raise ValueError(
                f"reward_model.remote.backoff_s/backoff_max_s must be >= 0, got {backoff_s}/{backoff_max_s}"
            )
        self.url = url
        self.batch_size = int(batch_size)
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.reward_label = f"remote reward service {url} (reward_model.remote.url)"
        self.max_error_fraction_key = "reward_model.remote.max_error_fraction"
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ transport
    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            with self._lock:
                self._sessions.append(s)
        return s

    def _post(self, body: dict) -> dict:
        """One attempt. Returns the parsed JSON object; raises _Fatal (do not retry) or RuntimeError (retry)."""
        try:
            data = json.dumps(body, default=_jsonable)
        except (TypeError, ValueError) as e:
            raise _Fatal(f"the request cannot be sent as JSON (an extra_info or ground truth value?): {e}") from e
        try:
            r = self._session().post(self.url, data=data, headers=self.headers, timeout=self.timeout_s)
        except requests.Timeout as e:
            raise _Timeout(f"timed out after {self.timeout_s:g} s ({type(e).__name__})") from e
        except requests.ConnectionError as e:
            raise RuntimeError(f"cannot connect ({type(e).__name__}: {e})") from e
        except requests.RequestException as e:
            raise RuntimeError(f"request failed ({type(e).__name__}: {e})") from e
        if r.status_code != 200:
            msg = f"HTTP {r.status_code}: {r.text[:200]!r}"
            if r.status_code in RETRYABLE_STATUS:
                raise RuntimeError(msg)
            raise _Fatal(msg)
        try:
            out = json.loads(r.content)  # Python's parser: a NaN / Infinity literal is read, then refused per item
        except ValueError as e:
            raise RuntimeError(f"response is not JSON: {r.text[:200]!r}") from e
        if not isinstance(out, dict) or not isinstance(out.get("rewards"), list):
            raise RuntimeError(f"response has no 'rewards' list: {str(out)[:200]}")
        n = len(body["responses"])
        for key in ("rewards", "extra", "errors"):
            if key in out and (not isinstance(out[key], list) or len(out[key]) != n):
                got = len(out[key]) if isinstance(out[key], list) else type(out[key]).__name__
                raise RuntimeError(f"response '{key}' has {got} entries for {n} trajectories")
        return out

    def _score_chunk(self, args: Sequence[tuple], prompts: Sequence[str] | None) -> tuple[list[CallResult], dict]:
        """Score one request's items with retries. Never raises."""
        n = len(args)
        results: list[CallResult | None] = [None] * n
        last_error = [""] * n
        timed_out = [False] * n
        pending = list(range(n))
        stats = {"requests": 0, "retries": 0, "failed_requests": 0, "latency": 0.0}
        for attempt in range(self.max_retries + 1):
            if attempt:
                stats["retries"] += 1
                time.sleep(retry_delay(attempt - 1, self.backoff_s, self.backoff_max_s))
            body = build_request([args[i] for i in pending], [prompts[i] for i in pending] if prompts else None)
            stats["requests"] += 1
            t0 = time.monotonic()
            try:
                out = self._post(body)
            except _Fatal as e:
                stats["failed_requests"] += 1
                for i in pending:
                    results[i] = CallResult("error", message=f"remote reward {self.url}: {e} (not retried)")
                pending = []
                break
            except RuntimeError as e:
                stats["failed_requests"] += 1
                for i in pending:
                    last_error[i], timed_out[i] = str(e), isinstance(e, _Timeout)
                continue
            finally:
                stats["latency"] = max(stats["latency"], time.monotonic() - t0)
            still = []
            extras, errors = out.get("extra"), out.get("errors")
            for j, i in enumerate(pending):
                if errors is not None and errors[j] is not None:
                    msg = f"remote reward {self.url}: the server's reward function failed: {errors[j]}"
                    results[i] = CallResult("error", message=msg)
                    continue
                score = _finite_number(out["rewards"][j])
                if score is None:
                    last_error[i], timed_out[i] = f"reward {out['rewards'][j]!r} is not a finite number", False
                    still.append(i)
                    continue
                extra = extras[j] if extras is not None else None
                value = {**extra, "score": score} if isinstance(extra, dict) and extra else score
                results[i] = CallResult("ok", value=value)
            pending = still
            if not pending:
                break
        tries = self.max_retries + 1
        for i in pending:
            msg = f"remote reward {self.url}: {last_error[i]} ({tries} attempts)"
            results[i] = CallResult("timeout" if timed_out[i] else "error", message=msg)
        return results, stats  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------ public API
    def score_batch(self, args: Sequence[tuple], prompts: Sequence[str] | None = None) -> list[CallResult]:
        """Score [(data_source, response, ground_truth, extra_info), ...] -> one CallResult per item, in
        order ('ok' with a float, or a dict with 'score' when the server sent extras; 'error' with the URL
        and what went wrong). Never raises for a failing request. Sets `last_metrics`:
        'reward/remote/num_requests', 'reward/remote/num_retries', 'reward/remote/num_failed_requests',
        'reward/remote/num_failed_items', 'reward/remote/max_latency_s'."""
        n = len(args)
        chunks = [range(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]

        def run(ch: range):
            return self._score_chunk([args[i] for i in ch], [prompts[i] for i in ch] if prompts else None)

        if len(chunks) > 1 and self.max_concurrency > 1:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="jaxrl_post-remote")
            outs = list(self._executor.map(run, chunks))
        else:
            outs = [run(ch) for ch in chunks]
        results = [r for res, _ in outs for r in res]
        self.last_metrics = {
            "reward/remote/num_requests": float(sum(s["requests"] for _, s in outs)),
            "reward/remote/num_retries": float(sum(s["retries"] for _, s in outs)),
            "reward/remote/num_failed_requests": float(sum(s["failed_requests"] for _, s in outs)),
            "reward/remote/num_failed_items": float(sum(r.status != "ok" for r in results)),
            "reward/remote/max_latency_s": float(max((s["latency"] for _, s in outs), default=0.0)),
        }
        return results

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        """One trajectory (a request of one) -> float, or dict with 'score'.

        Raises: RemoteRewardError: it failed after the retries (the message names the URL and the cause)."""
        (res,) = self.score_batch([(data_source, solution_str, ground_truth, extra_info)])
        if res.status != "ok":
            raise RemoteRewardError(res.message)
        return res.value

    def close(self) -> None:
        """Stop the request threads and close the HTTP sessions (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            for s in self._sessions:
                s.close()
            self._sessions = []
        self._local = threading.local()

    def __repr__(self):
        return f"RemoteRewardClient({self.url!r})"
