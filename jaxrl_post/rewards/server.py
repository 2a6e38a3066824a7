"""An HTTP reward server for the remote reward schema (`remote.py`): stdlib `ThreadingHTTPServer`.

POST `/get_reward` (or `/`) with the request of `remote.py` -> `{"rewards": [...], "extra": [...],
"errors": [...]}`: each item is scored by `fn(data_source, response, label, extra_info)` (our reward function
signature; or a batch scorer's `score_batch`, e.g. the generative judge); a function that raises gives that
item `rewards[i] = null` and `errors[i]` = the exception text (the client counts it as a failed call, not
retried). `extra[i]` holds the non-score keys of a dict result.
GET `/health` -> `{"status": "ok"}`. A request that is not JSON or misses/misaligns the lists is answered
HTTP 400 with `{"error": ...}`. `scripts/serve_reward.py` is the command line around `make_reward_server`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["RewardRequestHandler", "make_reward_server", "score_request"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024
_BATCH_LOCK = threading.Lock()


class BadRequest(ValueError):
    """The request body does not follow the schema."""


def _score_value(value: Any) -> tuple[float | None, dict | None, str | None]:
    if isinstance(value, dict):
        if "score" not in value:
            return None, None, f"KeyError: dict reward without 'score' key: keys {sorted(value)}"
        extra = {k: v for k, v in value.items() if k != "score"}
        score, _, err = _score_value(value["score"])
        return score, extra or None, err
    try:
        score = float(value)
    except (TypeError, ValueError):
        return None, None, f"TypeError: reward must be a number or a dict with a numeric 'score', got {value!r}"
    if not math.isfinite(score):
        return None, None, f"ValueError: reward {score!r} is not finite"
    return score, None, None


def score_request(fn: Callable[..., Any], body: Any) -> dict[str, list]:
    """Score one request body (a dict of the schema) with `fn`; the response body. `fn` is a reward function
    (called per item) or a batch scorer with `score_batch(args, prompts)` (e.g. `GenerativeJudge`: called
    once per request with the request's `prompts`, one request at a time).

    Raises: BadRequest: `responses` (or `query`) is missing, or the lists differ in length."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request must be a JSON object, got {type(body).__name__}")
    responses = body.get("responses", body.get("query"))
    if not isinstance(responses, list):
        raise BadRequest("the request needs a 'responses' (or 'query') list")
    n = len(responses)
    cols = {}
    for key in ("labels", "data_sources", "extra_infos"):
        col = body.get(key)
        if col is None:
            col = [None] * n
        if not isinstance(col, list) or len(col) != n:
            raise BadRequest(f"'{key}' must be a list of {n} entries (one per response)")
        cols[key] = col
    rewards, extras, errors = [], [], []
    args = [(cols["data_sources"][i], responses[i], cols["labels"][i], cols["extra_infos"][i]) for i in range(n)]
    if callable(getattr(fn, "score_batch", None)):  # a batch scorer (GenerativeJudge): one call, with the prompts
        prompts = body.get("prompts")
        if prompts is not None and (not isinstance(prompts, list) or len(prompts) != n):
            raise BadRequest(f"'prompts' must be a list of {n} entries (one per response)")
        with _BATCH_LOCK:  # one model: one batch at a time
            results = fn.score_batch(args, prompts)
        for res in results:
            if res.status == "ok":
                score, extra, err = _score_value(res.value)
            else:
                score, extra, err = None, None, res.message or res.status
            rewards.append(score)
            extras.append(extra)
            errors.append(err)
        args = []
    for a in args:
        try:
            score, extra, err = _score_value(fn(*a))
        except Exception as e:
            score, extra, err = None, None, f"{type(e).__name__}: {e}"
        rewards.append(score)
        extras.append(extra)
        errors.append(err)
    out: dict[str, list] = {"rewards": rewards}
    if any(e is not None for e in extras):
        out["extra"] = extras
    if any(e is not None for e in errors):
        out["errors"] = errors
    return out


class RewardRequestHandler(BaseHTTPRequestHandler):
    """Serves `server.reward_fn` (set by `make_reward_server`) over the schema."""

    protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connections
    disable_nagle_algorithm = True  # TCP_NODELAY: headers and body are two writes (else ~40 ms per response)

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": f"no such path {self.path!r}; POST /get_reward, GET /health"})

    def do_POST(self):
        if self.path.rstrip("/") not in ("", "/get_reward"):
            self._send(404, {"error": f"no such path {self.path!r}; POST /get_reward"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send(413, {"error": f"request of {length} bytes is over {MAX_BODY_BYTES}"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"null")
            out = score_request(self.server.reward_fn, body)
        except (ValueError, BadRequest) as e:  # json.JSONDecodeError is a ValueError
            self._send(400, {"error": f"{type(e).__name__}: {e}"})
            return
        self._send(200, out)

    def log_message(self, format, *args):
        log.debug("%s - %s", self.address_string(), format % args)


def make_reward_server(
    fn: Callable[..., Any],
    host: str = "127.0.0.1",
    port: int = 0,
    handler: type[BaseHTTPRequestHandler] = RewardRequestHandler,
) -> ThreadingHTTPServer:
    """A started-on-demand server (call `serve_forever()`, or `serve_in_thread`) bound to host:port
    (port 0: an ephemeral port; read it from `server.server_address`). Loopback by default."""
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.reward_fn = fn
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    """Run `server.serve_forever()` on a daemon thread (stop with `server.shutdown(); server.server_close()`)."""
    t = threading.Thread(target=server.serve_forever, daemon=True, name="jaxrl_post-reward-server")
    t.start()
    return t
