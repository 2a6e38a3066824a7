"""The multi-turn agent loop on the paged engine's data-parallel replicas (issue 56; a subprocess with 4 fake CPU
devices): on meshes data 2 x tensor 2 and data 4 x tensor 1 the trajectories (tokens, masks, turn counts,
log-probs within 1e-5, float32, sampled with a fixed seed) equal those of the engine on one device; every replica
holds trajectories (each stays on its replica from turn to turn), a pool small enough to evict kept pages changes
nothing, only the appended tokens are prefilled after the first turn, each replica shares the full pages of the
prompts' common head among the prompts it holds, and a second call compiles nothing."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxrl_post.rollout.paged.replicas import assign_groups
from tests.cheap_compile import CHEAP_COMPILE_FLAGS
from tests.rollout.test_agent_loop_paged import shared_by_hand

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from flax import nnx
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rollout import SamplingParams
    from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
    from jaxrl_post.rollout.paged import programs
    from jaxrl_post.rollout.paged.engine import PagedGenerator
    from jaxrl_post.runtime.sharding import make_mesh, shard_params
    from tests.rollout.test_agent_loop_kv import CalculatorEnv
    from tests.rollout.test_agent_loop_model import EOT, TOK, _model

    b, p = 6, 160
    nt = {"expr": [f"{i + 2}*{7 * i + 3}" for i in range(b)], "k": list(range(b))}
    prompts = DataProto({"input_ids": np.zeros((b, p), np.int32)}, nt)
    sp = SamplingParams(max_new_tokens=48, temperature=1.0, eos_token_ids=(EOT,), pad_token_id=EOT)
    eng = dict(max_num_seqs=2, max_num_batched_tokens=64, page_size=8, steps_per_dispatch=8)

    def roll(gen):
        loop = AgentLoop(gen, TOK, lambda row: CalculatorEnv(), MultiTurnLimits(max_assistant_turns=4))
        out = loop.generate(prompts, sp, seed=5)
        res = {k: np.asarray(v).tolist() for k, v in out.batch.items()}
        res["num_turns"] = np.asarray(out.non_tensor_batch["num_turns"]).tolist()
        return res, dict(loop.last_stats)

    res = {"one": roll(PagedGenerator(_model(), **eng))}
    for name, (data, tp) in {"d2t2": (2, 2), "d4t1": (4, 1)}.items():
        mesh = make_mesh(data, 1, tp, jax.devices())
        model = _model()
        nnx.update(model, shard_params(nnx.state(model), mesh))
        e = PagedGenerator(model, **eng, mesh=mesh)
        out = roll(e)
        traces = dict(programs.TRACE_COUNTS)
        again = roll(e)
        traces_again = dict(programs.TRACE_COUNTS)
        # 11 pages per replica: a trajectory of up to 31 + 48 tokens needs 10, a replica holds 2 or 3 of them
        tight = roll(PagedGenerator(model, **eng, mesh=mesh, num_pages=12))
        res[name] = {"out": out, "again": again, "tight": tight, "traces": traces, "traces_again": traces_again}
    print("RESULT" + json.dumps(res))
    """
)


def _prefilled_by_hand(run) -> int:
    """Distinct prompts (the calculator's prompts are all different) + the observation tokens a model turn follows
    (an observation that used up the budget ends its trajectory unprefilled)."""
    am = np.asarray(run["attention_mask"])[:, :160]
    loss = np.asarray(run["loss_mask"], bool)
    holes = np.asarray(run["response_attention_mask"], bool) & ~loss
    before_last = np.arange(loss.shape[1])[None] < (loss.shape[1] - np.argmax(loss[:, ::-1], axis=1))[:, None]
    return int(am.sum() + (holes & before_last).sum())


def _shared_by_hand(run, replicas: int) -> int:
    """Prompt tokens that pages shared by content spare (`shared_by_hand`), each replica's cache over the prompts
    the session placed on it (`assign_groups` of the prompts' lengths, in row order)."""
    ids, am = np.asarray(run["input_ids"])[:, :160], np.asarray(run["attention_mask"])[:, :160].astype(bool)
    prompts = [tuple(i[m].tolist()) for i, m in zip(ids, am)]
    where = assign_groups([len(p) for p in prompts], replicas)
    return sum(shared_by_hand([p for p, w in zip(prompts, where) if w == r]) for r in range(replicas))


@pytest.mark.slow  # seven multi-turn rollouts on 4 fake devices in a subprocess (~60-120 s on 2 cores)
def test_agent_loop_on_paged_replicas_equals_one_device():
    flags = "--xla_force_host_platform_device_count=4 " + CHEAP_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.split("RESULT", 1)[1])
    one, one_stats = r["one"]
    assert len(set(one["num_turns"])) > 1 and max(one["num_turns"]) >= 5, one["num_turns"]
    hits = _shared_by_hand(one, 1)
    assert hits > 0 and one_stats["paged/prefix_cache_hits"] == hits, (one_stats, hits)
    assert one_stats["prefill_tokens"] == _prefilled_by_hand(one) - hits
    for name, data in (("d2t2", 2), ("d4t1", 4)):
        run = r[name]
        for got, _ in (run["out"], run["again"], run["tight"]):
            for k in ("responses", "loss_mask", "response_attention_mask", "attention_mask", "num_turns"):
                assert got[k] == one[k], (name, k)
            np.testing.assert_allclose(got["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5, rtol=0)
        stats = run["out"][1]
        hits = _shared_by_hand(one, data)  # each replica prefills the prompts' common head once
        assert stats["paged/prefix_cache_hits"] == hits, (stats, hits)
        assert stats["prefill_tokens"] == _prefilled_by_hand(one) - hits and stats["paged/evictions"] == 0, stats
        assert stats["paged/replica_trajectories"] == [6 // data + (i < 6 % data) for i in range(data)], stats
        assert run["tight"][1]["paged/evictions"] > 0, run["tight"][1]  # kept pages evicted, recomputed
        assert run["traces"] == run["traces_again"]  # the second call compiled nothing
