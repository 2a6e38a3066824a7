"""The remote reward service (docs/reward_service.md): scores equal the in-process reward function's, the real
server script works on loopback, and every failure mode (down, slow, malformed JSON, wrong count, non-numeric
or NaN scores, HTTP 500/400, the server's own function failing) is retried or stops the step loudly --
never a silently wrong score. A fault-injecting handler on 127.0.0.1 (ephemeral port) plays the faults."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxrl_post.rewards import RewardFunctionError, RewardManager, load_custom_reward_fn
from jaxrl_post.rewards.remote import RemoteRewardClient, RemoteRewardError, build_request
from jaxrl_post.rewards.server import RewardRequestHandler, make_reward_server, score_request, serve_in_thread

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_REWARD = os.path.join(REPO, "configs", "tiny_reward.py")

TEXTS = ["12 a", "abc", "", "9 9 9", "x1y2", "  ", "hello world 7", "0", "a", "77b"]


def _digit_space_fraction(t):  # configs/tiny_reward.compute_score, by hand
    return sum(c.isdigit() or c == " " for c in t) / len(t) if t else 0.0


class CharTokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(t) for t in s) for s in seqs]


def _batch(texts, prompts=None, data_source="toy"):
    from jaxrl_post.batch.protocol import DataProto

    prompts = prompts or ["Q?"] * len(texts)
    B, R, P = len(texts), max(1, *(len(t) for t in texts)), max(len(p) for p in prompts)
    resp, rmask = np.zeros((B, R), np.int32), np.zeros((B, R), np.int32)
    pr, pmask = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
    for i, (t, p) in enumerate(zip(texts, prompts, strict=True)):
        resp[i, : len(t)], rmask[i, : len(t)] = [ord(c) for c in t], 1
        pr[i, P - len(p) :], pmask[i, P - len(p) :] = [ord(c) for c in p], 1  # left-padded
    return DataProto.from_dict(
        tensors={
            "responses": resp,
            "response_attention_mask": rmask,
            "prompts": pr,
            "attention_mask": np.concatenate([pmask, rmask], 1),
        },
        non_tensors={
            "data_source": np.array([data_source] * B, dtype=object),
            "ground_truth": np.array([str(i) for i in range(B)], dtype=object),
            "extra_info": np.array([{"index": i} for i in range(B)], dtype=object),
        },
    )


# ------------------------------------------------------------------------------------- fault injection
class FaultServer:
    """A reward server whose n-th request plays `script[n]` (the last entry repeats): 'ok', 'slow' (sleep
    `slow_s` then answer), '500', '400', 'badjson', 'count' (one reward too few), 'nan' / 'str' (item 0's
    reward is NaN / a string), 'close' (drop the connection). Records each request body."""

    def __init__(self, script, fn=None, slow_s=1.0):
        self.script, self.slow_s, self.bodies = list(script), slow_s, []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        fn = fn or load_custom_reward_fn(TINY_REWARD)
        outer = self

        class Handler(RewardRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    n = len(outer.bodies)
                    outer.bodies.append(body)
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    self._play(outer.script[min(n, len(outer.script) - 1)], body)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

            def _play(self, action, body):
                out = score_request(self.server.reward_fn, body)
                if action == "slow":
                    time.sleep(outer.slow_s)
                elif action in ("500", "400"):
                    return self._send(int(action), {"error": "injected"})
                elif action == "badjson":
                    data = b'{"rewards": [1.0,'
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                elif action == "count":
                    out["rewards"] = out["rewards"][:-1]
                elif action == "nan":
                    out["rewards"][0] = float("nan")
                elif action == "str":
                    out["rewards"][0] = "high"
                elif action == "close":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return None
                return self._send(200, out)

        self.server = make_reward_server(fn, "127.0.0.1", 0, handler=Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"
        serve_in_thread(self.server)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fault_server():
    servers = []

    def make(script, **kw):
        servers.append(FaultServer(script, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _manager(url, max_error_fraction=0.0, **kw):
    kw = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01, **kw}
    return RewardManager(RemoteRewardClient(url, **kw), CharTokenizer(), max_error_fraction=max_error_fraction)


# --------------------------------------------------------------------------------------------- parity
DICT_REWARD = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        frac = sum(c.isdigit() or c == " " for c in solution_str) / max(1, len(solution_str))
        return {"score": frac + int(ground_truth), "acc": float(solution_str.startswith(str(extra_info["index"]))),
                "pred": solution_str[:2]}
    """
)


def _serve_script(spec):
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "serve_reward.py"),
            "--reward_fn",
            spec,
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    line = proc.stdout.readline()
    if not line.startswith("serving "):
        proc.kill()
        raise AssertionError(f"serve_reward.py did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split(" on ")[-1].strip()


def test_script_server_scores_equal_in_process(tmp_path):
    """scripts/serve_reward.py in a subprocess on loopback, requests of 3 with 2 in flight: the scores,
    token-level scores and extra infos equal the in-process manager's, and the hand-computed values."""
    path = tmp_path / "dict_reward.py"
    path.write_text(DICT_REWARD)
    proc, url = _serve_script(f"{path}:compute_score")
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/get_reward")
        data = _batch(TEXTS)
        local = RewardManager(load_custom_reward_fn(str(path)), CharTokenizer(), num_workers=0).compute(data)
        mgr = _manager(url, batch_size=3, max_concurrency=2)
        remote = mgr.compute(data)
        expected = [_digit_space_fraction(t) + i for i, t in enumerate(TEXTS)]
        np.testing.assert_allclose(remote.scores, expected, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(remote.scores, local.scores)
        np.testing.assert_array_equal(remote.token_level_scores, local.token_level_scores)
        np.testing.assert_array_equal(remote.extra_infos["acc"], local.extra_infos["acc"])
        assert list(remote.extra_infos["pred"]) == list(local.extra_infos["pred"]) == [t[:2] for t in TEXTS]
        assert remote.metrics["reward/remote/num_requests"] == 4  # ceil(10 / 3)
        assert remote.metrics["reward/num_errors"] == 0 and remote.metrics["reward/remote/num_retries"] == 0
        mgr.close()
    finally:
        proc.kill()
        proc.wait()


def test_request_schema_and_order(fault_server):
    """The request carries OpenRLHF's query/prompts/labels and our responses/data_sources/extra_infos; chunks
    of `batch_size` keep the batch order."""
    srv = fault_server(["ok"])
    out = _manager(srv.url, batch_size=4).compute(_batch(TEXTS, prompts=[f"P{i}:" for i in range(10)]))
    np.testing.assert_allclose(out.scores, [_digit_space_fraction(t) for t in TEXTS], atol=1e-6)
    bodies = sorted(srv.bodies, key=lambda b: b["labels"][0])
    assert [len(b["responses"]) for b in bodies] == [4, 4, 2]
    b = bodies[0]
    assert b["prompts"] == ["P0:", "P1:", "P2:", "P3:"] and b["responses"] == TEXTS[:4]
    assert b["query"] == [p + t for p, t in zip(b["prompts"], TEXTS[:4], strict=True)]
    assert b["labels"] == ["0", "1", "2", "3"] and b["data_sources"] == ["toy"] * 4
    assert b["extra_infos"] == [{"index": i} for i in range(4)]
    assert build_request([("s", "r", np.int64(3), {"a": np.float32(1)})])["labels"] == [np.int64(3)]


def test_concurrency_limit(fault_server):
    srv = fault_server(["slow"], slow_s=0.3)
    client = RemoteRewardClient(srv.url, batch_size=1, max_concurrency=3, timeout_s=10)
    res = client.score_batch([("toy", t, "0", None) for t in TEXTS[:9]])
    assert [r.value for r in res] == pytest.approx([_digit_space_fraction(t) for t in TEXTS[:9]])
    assert srv.max_in_flight == 3  # never more than max_concurrency, and they did run at once
    client.close()


# ------------------------------------------------------------------------------------------ failures
def test_server_down_is_loud():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/get_reward"
    mgr = _manager(url)
    with pytest.raises(RewardFunctionError) as e:
        mgr.compute(_batch(TEXTS[:3]))
    msg = str(e.value)
    assert f"remote reward service {url} (reward_model.remote.url) failed on 3 of 3 responses" in msg
    assert "limit reward_model.remote.max_error_fraction=0" in msg
    assert "cannot connect" in msg and "(3 attempts)" in msg
    with pytest.raises(RemoteRewardError, match="cannot connect"):
        RemoteRewardClient(url, max_retries=0)("toy", "1", "1")


@pytest.mark.parametrize("fault", ["500", "badjson", "count", "close"])
def test_transient_fault_then_retry_succeeds(fault_server, fault):
    srv = fault_server([fault, "ok"])
    out = _manager(srv.url).compute(_batch(TEXTS[:3]))
    np.testing.assert_allclose(out.scores, [_digit_space_fraction(t) for t in TEXTS[:3]], atol=1e-6)
    assert out.metrics["reward/num_errors"] == 0
    assert out.metrics["reward/remote/num_retries"] == 1 and out.metrics["reward/remote/num_failed_requests"] == 1
    assert len(srv.bodies) == 2


@pytest.mark.parametrize(
    "fault, why",
    [
        ("500", "HTTP 500"),
        ("badjson", "response is not JSON"),
        ("count", "response 'rewards' has 2 entries for 3 trajectories"),
        ("nan", "reward nan is not a finite number"),
        ("str", "reward 'high' is not a finite number"),
    ],
)
def test_persistent_fault_is_loud(fault_server, fault, why):
    srv = fault_server([fault])
    with pytest.raises(RewardFunctionError) as e:
        _manager(srv.url).compute(_batch(TEXTS[:3]))
    msg = str(e.value)
    assert srv.url in msg and why in msg and "(3 attempts)" in msg, msg
    assert len(srv.bodies) == 3  # first try + max_retries=2


def test_slow_server_times_out_then_retry_succeeds_and_always_slow_is_loud(fault_server):
    srv = fault_server(["slow", "ok"], slow_s=1.5)
    out = _manager(srv.url, timeout_s=0.3).compute(_batch(TEXTS[:2]))
    np.testing.assert_allclose(out.scores, [_digit_space_fraction(t) for t in TEXTS[:2]], atol=1e-6)
    assert out.metrics["reward/remote/num_retries"] == 1 and out.metrics["reward/num_timeouts"] == 0

    srv = fault_server(["slow"], slow_s=1.5)
    with pytest.raises(RewardFunctionError) as e:
        _manager(srv.url, timeout_s=0.3, max_retries=1).compute(_batch(TEXTS[:2]))
    assert "2 timeouts" in str(e.value) and "timed out after 0.3 s" in str(e.value) and "(2 attempts)" in str(e.value)


def test_bad_item_is_resent_alone_and_counted_below_the_limit(fault_server):
    """A NaN reward for one item: only that item is sent again. Always NaN: with max_error_fraction=0.5 it
    scores 0 and is counted (reward/num_errors); the others keep their true scores."""
    srv = fault_server(["nan", "ok"])
    out = _manager(srv.url).compute(_batch(TEXTS[:4]))
    np.testing.assert_allclose(out.scores, [_digit_space_fraction(t) for t in TEXTS[:4]], atol=1e-6)
    assert [len(b["responses"]) for b in srv.bodies] == [4, 1] and srv.bodies[1]["responses"] == [TEXTS[0]]

    srv = fault_server(["nan"])
    out = _manager(srv.url, max_error_fraction=0.5).compute(_batch(TEXTS[:4]))
    np.testing.assert_allclose(out.scores, [0.0] + [_digit_space_fraction(t) for t in TEXTS[1:4]], atol=1e-6)
    assert out.metrics["reward/num_errors"] == 1 and out.metrics["reward/remote/num_failed_items"] == 1
    assert "reward nan is not a finite number (3 attempts)" in out.errors[0]


def test_unserializable_extra_info_fails_loudly_without_a_request(fault_server):
    srv = fault_server(["ok"])
    client = RemoteRewardClient(srv.url)
    (res,) = client.score_batch([("toy", "1", "1", {"obj": object()})])
    assert res.status == "error" and "cannot be sent as JSON" in res.message and "not retried" in res.message
    assert srv.bodies == []


def test_http_400_is_not_retried(fault_server):
    srv = fault_server(["400"])
    with pytest.raises(RewardFunctionError, match=r"HTTP 400: .*injected.* \(not retried\)"):
        _manager(srv.url).compute(_batch(TEXTS[:2]))
    assert len(srv.bodies) == 1


def test_server_reward_function_error_is_reported_not_retried(fault_server, tmp_path):
    path = tmp_path / "raising.py"
    path.write_text("def compute_score(ds, s, gt, extra_info=None):\n    return float(s)\n")
    srv = fault_server(["ok"], fn=load_custom_reward_fn(str(path)))
    out = _manager(srv.url, max_error_fraction=0.5).compute(_batch(["1.5", "2", "x"]))
    np.testing.assert_array_equal(out.scores, [1.5, 2.0, 0.0])
    assert len(srv.bodies) == 1 and out.metrics["reward/num_errors"] == 1
    assert "the server's reward function failed: ValueError: could not convert string to float: 'x'" in out.errors[0]


def test_server_refuses_bad_requests():
    import requests

    from jaxrl_post.rewards.server import BadRequest

    server = make_reward_server(load_custom_reward_fn(TINY_REWARD))
    serve_in_thread(server)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert requests.get(base + "/health", timeout=5).json() == {"status": "ok"}
        r = requests.post(base + "/get_reward", data="not json", timeout=5)
        assert r.status_code == 400 and "JSONDecodeError" in r.json()["error"]
        r = requests.post(base + "/get_reward", json={"responses": ["a", "b"], "labels": ["1"]}, timeout=5)
        assert r.status_code == 400 and "'labels' must be a list of 2 entries" in r.json()["error"]
        assert requests.post(base + "/other", json={}, timeout=5).status_code == 404
        r = requests.post(base + "/get_reward", json={"responses": ["1 a", "b"]}, timeout=5)
        assert r.json() == {"rewards": [pytest.approx(2 / 3), 0.0]}
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(BadRequest, match="'responses'"):
        score_request(lambda *a: 1.0, {"prompts": []})


def test_client_and_config_refuse_bad_settings():
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.config_check import validate_config

    with pytest.raises(ValueError, match="http:// or https://"):
        RemoteRewardClient("127.0.0.1:8000")
    with pytest.raises(ValueError, match="reward_model.remote.batch_size"):
        RemoteRewardClient("http://127.0.0.1:1/", batch_size=0)
    c = grpo.get_config("tiny")
    c.reward_model.remote.url = "http://127.0.0.1:1/get_reward"
    with pytest.raises(ConfigError, match="reward_model.remote.url.*custom_reward_function.path"):
        validate_config(c)
    c.custom_reward_function.path = None
    validate_config(c)
    from jaxrl_post.rl.reward_builders import build_reward_manager

    c.reward_model.num_workers = 2  # ignored: the client is not a per-row function, no worker pool
    mgr = build_reward_manager(c, CharTokenizer())
    assert isinstance(mgr.compute_score, RemoteRewardClient) and mgr._pool is None and mgr._thread is None
    assert mgr.max_error_fraction == 0.0 and mgr.compute_score.url == c.reward_model.remote.url
    c.reward_model.remote.max_retries = -1
    with pytest.raises(ConfigError, match="reward_model.remote.max_retries"):
        validate_config(c)


# --------------------------------------------------------------------------------------- a tiny RL run
_NONDETERMINISTIC = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/remote/")


@pytest.mark.slow  # two tiny GRPO runs of 2 steps (~2 min each on the shared 2-core machine)
def test_tiny_grpo_run_equal_in_process_and_remote(tmp_path):
    """Same seed, same config: the run scoring through the served tiny reward (loopback) logs the same
    metrics, step by step, as the run calling it in process (timings aside)."""
    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer

    def run(name, url=None):
        c = grpo.get_config("tiny")
        c.trainer.default_local_dir = str(tmp_path / name)
        c.trainer.val_before_train = False
        c.data.val_files = None
        if url:
            c.custom_reward_function.path = None
            c.reward_model.remote.url = url
            c.reward_model.remote.batch_size = 3  # 16 responses -> 6 requests, 2 in flight
            c.reward_model.remote.max_concurrency = 2
        trainer = RLTrainer(c, console_write=lambda _: None)
        try:
            return trainer.fit()["history"]
        finally:
            trainer.close()

    server = make_reward_server(load_custom_reward_fn(TINY_REWARD))
    serve_in_thread(server)
    try:
        remote = run("remote", f"http://127.0.0.1:{server.server_address[1]}/get_reward")
    finally:
        server.shutdown()
        server.server_close()
    local = run("local")
    assert len(local) == len(remote) == 2
    for m_local, m_remote in zip(local, remote, strict=True):
        assert m_remote["reward/remote/num_requests"] == 6 and m_remote["reward/num_errors"] == 0
        keep = {k: v for k, v in m_local.items() if not k.startswith(_NONDETERMINISTIC)}
        assert len(keep) > 30 and {k: m_remote[k] for k in keep} == keep
    assert local[0]["critic/score/max"] > local[0]["critic/score/min"]  # the scores vary: a real comparison


def test_serve_reward_script_refuses_bad_flags(capsys, tmp_path):
    from tests.script_loader import load_script

    serve = load_script("serve_reward")
    assert serve.main(["--reward_fn", str(tmp_path / "nope.py")]) == 2
    assert "--reward_fn=" in capsys.readouterr().err
    assert serve.main(["--reward_fn", f"{TINY_REWARD}:no_such_fn"]) == 2
    assert "'no_such_fn' not found" in capsys.readouterr().err
    assert serve.main(["--reward_fn", TINY_REWARD, "--judge_path", "x"]) == 2
    assert "not both" in capsys.readouterr().err
    assert serve.main(["--judge_path", str(tmp_path / "no_model")]) == 2
    assert "--judge_path=" in capsys.readouterr().err


def test_unreachable_service_is_one_config_error_at_start(tmp_path):
    """A remote URL nobody listens on: the preflight probe names the key, host and port (after its retries),
    before any model load; a listening server passes; a bad port is a ConfigError too."""
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.preflight import check_remote_reward

    c = grpo.get_config("tiny")
    check_remote_reward(c)  # no remote URL: nothing to check
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c.reward_model.remote.url = f"http://127.0.0.1:{port}/get_reward"
    c.reward_model.remote.max_retries, c.reward_model.remote.backoff_s = 2, 0.01
    with pytest.raises(ConfigError) as e:
        check_remote_reward(c)
    msg = str(e.value)
    assert msg.startswith(f"config.reward_model.remote.url='http://127.0.0.1:{port}/get_reward'")
    assert f"cannot connect to 127.0.0.1:{port}" in msg and "3 attempts" in msg
    c.reward_model.remote.url = "http://127.0.0.1:notaport/get_reward"
    with pytest.raises(ConfigError, match="not a valid URL"):
        check_remote_reward(c)
    server = make_reward_server(load_custom_reward_fn(TINY_REWARD))
    serve_in_thread(server)
    try:
        c.reward_model.remote.url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
        check_remote_reward(c)  # listening: passes
    finally:
        server.shutdown()
        server.server_close()


def test_trainer_with_unreachable_service_stops_before_the_model_load(tmp_path, monkeypatch):
    """RLTrainer(...) with a dead remote URL: the ConfigError comes from the data/reward pre-flight, before
    the model loader is ever called."""
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl import builders
    from jaxrl_post.rl.trainer import RLTrainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.custom_reward_function.path = None
    c.reward_model.remote.url = f"http://127.0.0.1:{port}/get_reward"
    c.reward_model.remote.max_retries = 0

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the remote URL was checked")

    monkeypatch.setattr(builders, "build_actor_and_tokenizer", no_load)
    with pytest.raises(ConfigError, match=f"cannot connect to 127.0.0.1:{port}"):
        RLTrainer(c, console_write=lambda _: None)
    assert not (tmp_path / "run").exists()  # a failed start leaves no directory behind
