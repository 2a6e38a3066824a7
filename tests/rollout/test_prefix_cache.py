"""Sharing full prompt pages by content in the paged engine (`rollout/paged/prefix_cache.py`, vLLM's automatic
prefix caching): prompts with a common 2-page prefix and different tails, `n` 2, more sequences than slots, give
the same tokens and log-probs (float32, fixed keys, bit for bit) with and without sharing, also with a pool so tight
that sequences are preempted and cold cached pages evicted; the prefill token count and the hit count equal a hand
count (the last token of a context is always prefilled: a prompt equal to another hits all but its last page); no
page leaks; new weights -- between calls, or mid-call -- never read pages computed by the old ones; 2 data-parallel
replicas each keep their own cache. Host-only: random admit / fork / append / retire / drop orders never leak, and
every sequence reads back its own tokens through pages shared by content (a shadow token store)."""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rollout import SamplingParams
from jaxrl_post.rollout.paged import admission, engine
from jaxrl_post.rollout.paged.allocator import OutOfPagesError
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.prefix_cache import CachingPageAllocator, page_keys
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=1,
)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, eos_token_ids=(4, 5, 6), seed=2)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, steps_per_dispatch=4)
TAILS = (1, 4, 2, 5, 3)  # prompts: a 10-token prefix (2 full pages of 4, the third page split) + these tails


def _prompts():
    """6 prompts of [11, 14, 12, 15, 13, 12] tokens: a common 10-token prefix; the last equals the third."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(7, 96, 10)
    tails = [rng.integers(7, 96, k) for k in TAILS]
    prompts = [np.concatenate([prefix, t]) for t in tails] + [np.concatenate([prefix, tails[2]])]
    p = max(len(x) for x in prompts)
    ids, mask = np.zeros((len(prompts), p), np.int32), np.zeros((len(prompts), p), np.int32)
    for i, x in enumerate(prompts):
        ids[i, p - len(x) :], mask[i, p - len(x) :] = x, 1
    return prompts, DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


@pytest.fixture(scope="module")
def setup():
    model = init_model(ModelConfig(**TINY), seed=3)
    prompts, dp = _prompts()
    plain = PagedGenerator(model, **ENGINE, enable_prefix_caching=False)
    return model, prompts, dp, plain.generate(dp, SAMPLED, n=2), plain.last_stats


@pytest.fixture
def allocators(monkeypatch):
    """The allocators of every `generate` call in the test, read after the call (its `stop`)."""
    seen = []

    class Recording(admission.ReplicaSchedulers):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.extend(sc.alloc for sc in self.scheds)

    monkeypatch.setattr(engine, "ReplicaSchedulers", Recording)
    return seen


def _assert_same(a, b):
    for k in ("responses", "response_attention_mask", "input_ids", "attention_mask", "truncated"):
        np.testing.assert_array_equal(a.batch[k], b.batch[k], err_msg=k)
    np.testing.assert_array_equal(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])


def _assert_no_leak(allocs):
    assert allocs
    for a in allocs:
        a.check()
        assert a.num_used == 0 and a.num_free == a.num_pages - 1 and getattr(a, "num_cached", 0) == 0


@pytest.mark.slow  # three engines' compiles (~15-25 s on 2 loaded cores)
def test_shared_prefix_pages_give_the_same_rollout_and_prefill_only_the_tails(setup, allocators):
    model, prompts, dp, want, plain_stats = setup
    lens = [len(x) for x in prompts]
    assert plain_stats["prefill_tokens"] == sum(lens) and plain_stats["prefix_cache_hits"] == 0  # one per prompt
    eng = PagedGenerator(model, **ENGINE)  # on by default (vLLM, verl)
    _assert_same(eng.generate(dp, SAMPLED, n=2), want)
    st = eng.last_stats
    # every prompt after the first reuses the 2 prefix pages (8 tokens); the sixth equals the third (12 tokens, 3
    # full pages) but hits 2 pages only: its last token is prefilled for the next-token logits
    assert st["prefix_cache_hits"] == 8 * (len(prompts) - 1) == 40
    assert st["prefill_tokens"] == sum(lens) - 40 == 37 and st["prefix_cache_queries"] == sum(lens)
    assert st["preemptions"] == 0 and st["prefill_dispatches"] < plain_stats["prefill_dispatches"]
    _assert_no_leak(allocators)
    # 8 of 28 pages: preemption (a recomputed context reuses its own prompt's cold pages) and cold pages evicted
    tight = PagedGenerator(model, **ENGINE, num_pages=9)
    _assert_same(tight.generate(dp, SAMPLED, n=2), want)
    st = tight.last_stats
    assert st["preemptions"] > 0 and st["prefix_cache_evictions"] > 0 and st["prefix_cache_hits"] > 40
    assert st["prefill_tokens"] == st["prefix_cache_queries"] - st["prefix_cache_hits"]
    _assert_no_leak(allocators)


@pytest.mark.slow  # two models' rollouts (~15 s)
def test_new_weights_never_read_pages_of_the_old_ones(setup, allocators):
    model, _, dp, want, _ = setup
    eng = PagedGenerator(model, **ENGINE)
    _assert_same(eng.generate(dp, SAMPLED, n=2), want)
    other = init_model(ModelConfig(**TINY), seed=4)
    eng.update_weights(other)  # between calls (a weight sync, or a partial rollout resumed under new weights)
    fresh = PagedGenerator(other, **ENGINE, enable_prefix_caching=False)
    _assert_same(eng.generate(dp, SAMPLED, n=2), fresh.generate(dp, SAMPLED, n=2))
    assert eng.last_stats["prefix_cache_hits"] == 40  # the call's own sharing, nothing from the first call
    eng.update_weights(model)
    # new weights mid-call (here the same ones, so the tokens stay): every page registered before is forgotten,
    # so the prompts admitted after the swap prefill the prefix again once
    swaps = []

    def swap(dispatches):
        if dispatches == 1:
            eng.update_weights()
            swaps.append(eng.weights_version)
        return False

    _assert_same(eng.generate(dp, SAMPLED, n=2, should_stop=swap), want)
    assert swaps and eng.last_stats["prefix_cache_hits"] == 40 - 8
    _assert_no_leak(allocators)


def test_routing_replay_turns_sharing_by_content_off():
    moe = ModelConfig(**{**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    eng = PagedGenerator(init_model(moe, seed=0), **ENGINE, return_routed_experts=True)
    assert eng.enable_prefix_caching and not eng.prefix_caching
    assert PagedGenerator(init_model(ModelConfig(**TINY), seed=0), **ENGINE).prefix_caching


class _Shadow:
    """Token store `[num_pages, page_size]` written through the page tables (what the device pool would hold)."""

    def __init__(self, a: CachingPageAllocator):
        self.a, self.store, self.want = a, np.full((a.num_pages, a.page_size), -1), {}

    def write(self, sid, start, tokens):
        pages, ps = self.a.pages(sid), self.a.page_size
        for i, t in enumerate(tokens, start):
            assert self.a.refcount[pages[i // ps]] == 1, "a shared page written"
            self.store[pages[i // ps], i % ps] = t

    def check(self):
        for sid, want in self.want.items():
            got = self.store[self.a.pages(sid)].reshape(-1)[: len(want)]
            assert list(got) == want, sid


def _random_run(seed: int, steps: int = 300) -> None:
    rng = random.Random(seed)
    a = CachingPageAllocator(num_pages=rng.randint(6, 40), page_size=rng.choice([1, 2, 4]))
    sh, next_id = _Shadow(a), 0
    stems = [[rng.randrange(50) for _ in range(rng.randint(0, 4 * a.page_size))] for _ in range(3)]
    for _ in range(steps):
        op, live = rng.random(), list(sh.want)
        try:
            if op < 0.35 or not live:  # admit a prompt: a common stem + a random tail
                tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(1, 2 * a.page_size))]
                done = a.allocate_context(next_id, np.asarray(tokens))
                assert done % a.page_size == 0 and done < len(tokens)
                sh.want[next_id] = tokens
                sh.write(next_id, done, tokens[done:])  # the prefill writes from the first uncached token
                next_id += 1
            elif op < 0.5:  # a sample forks a live sequence
                parent = rng.choice(live)
                copy = a.fork(parent, next_id)
                if copy is not None:
                    sh.store[copy[1]] = sh.store[copy[0]]
                sh.want[next_id] = list(sh.want[parent])
                next_id += 1
            elif op < 0.75:  # decode tokens
                sid, n = rng.choice(live), rng.randint(1, 2 * a.page_size)
                start = a.length(sid)
                a.append(sid, n)
                new = [rng.randrange(50) for _ in range(n)]
                sh.want[sid] += new
                sh.write(sid, start, new)
            elif op < 0.97:
                sid = rng.choice(live)
                a.free(sid)
                del sh.want[sid]
            else:  # new weights
                a.drop()
        except OutOfPagesError:
            pass
        a.check()
        sh.check()
    for sid in list(sh.want):
        a.free(sid)
    a.drop()
    a.check()
    assert a.num_used == 0 and a.num_free == a.num_pages - 1 and a.hits > 0


@pytest.mark.parametrize("seed", range(20))
def test_random_orders_never_leak_and_read_back_their_tokens(seed):
    _random_run(seed)


def test_keys_chain_the_prefix():
    a, b = np.arange(8), np.concatenate([np.arange(4), np.arange(8, 12)])
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    assert page_keys(np.concatenate([[9], a[1:]]), 4)[1] != ka[1]  # page 1's tokens equal, its prefix not
    assert page_keys(np.arange(7), 4) == ka[:1]


SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from flax import nnx
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.rollout.paged.engine import PagedGenerator
    from jaxrl_post.runtime.sharding import make_mesh, shard_params
    from tests.rollout.test_prefix_cache import ENGINE, SAMPLED, TINY, _prompts

    _, dp = _prompts()
    mesh = make_mesh(2, 1, 1, jax.devices())
    model = init_model(ModelConfig(**TINY), seed=3)
    nnx.update(model, shard_params(nnx.state(model), mesh))
    res = {}
    for on in (False, True):
        eng = PagedGenerator(model, **ENGINE, mesh=mesh, enable_prefix_caching=on)
        out = eng.generate(dp, SAMPLED, n=2)
        res[str(on)] = {"responses": np.asarray(out.batch["responses"]).tolist(),
                        "lp": np.asarray(out.batch["rollout_log_probs"]).tolist(), "stats": {
                        k: v for k, v in eng.last_stats.items() if k.startswith(("prefix", "prefill", "replica_seq"))}}
    print("RESULT" + json.dumps(res))
    """
)


@pytest.mark.slow  # two engines on 2 fake devices in a subprocess (~30 s on 2 cores)
def test_two_replicas_each_keep_their_own_cache(setup):
    _, prompts, _, want, _ = setup
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {CHEAP_COMPILE_FLAGS}"
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.split("RESULT", 1)[1])
    off, on = res["False"], res["True"]
    for r in (off, on):
        np.testing.assert_array_equal(r["responses"], want.batch["responses"])
        np.testing.assert_allclose(r["lp"], want.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    assert on["responses"] == off["responses"] and on["lp"] == off["lp"]
    assert all(on["stats"]["replica_sequences"]), "both replicas ran prompts"
    # each replica prefills the prefix once: 6 prompts, 2 first prompts
    assert on["stats"]["prefix_cache_hits"] == 8 * (len(prompts) - 2)
    assert on["stats"]["prefill_tokens"] == off["stats"]["prefill_tokens"] - 8 * (len(prompts) - 2)
