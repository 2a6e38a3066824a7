"""The asynchronous state in a checkpoint, on the model-free rollout (fake_rollout.py): the numeric arrays of the
queue, the batch in flight and the pending prompts go to one flat buffer per dtype (an orbax array item, written
and read back here by the real `Checkpointer`) and the host JSON keeps references; a state saved so continues
exactly; the old form (every array a JSON list) still loads; and a reward failure in the middle of a step puts the
producer back to the step's start, so the step redone trains, drops and counts exactly what an unbroken run does."""

import json

import jax
import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.engine.run.checkpoint import Checkpointer
from jaxrl_post.rewards import RewardFunctionError
from jaxrl_post.rl.async_training.host_arrays import ArrayPacker
from jaxrl_post.rl.async_training.partial import PartialGeneration
from jaxrl_post.rl.async_training.producer import AsyncRollout
from jaxrl_post.rl.async_training.settings import AsyncSettings
from jaxrl_post.rollout.paged.scheduler import Seq
from tests.rl.async_training.fake_rollout import FakeRollout, prompt_batches
from tests.rl.async_training.test_schedule import B, N, _train

S2_K2_R2 = AsyncSettings("fully_async", 2, 2, 2, False, 2, B, N)


def _json_arrays(d, out):
    """Every `{"dtype", "shape", "data"}` list in a JSON tree (the old form's arrays)."""
    if isinstance(d, dict):
        if "data" in d and "dtype" in d:
            out.append(d)
        for v in d.values():
            _json_arrays(v, out)
    elif isinstance(d, list):
        for v in d:
            _json_arrays(v, out)
    return out


def _partial_generation():
    """A batch stopped mid-way: two rows done, one unfinished sequence with its tokens, log-probs, thresholds."""
    rng = np.random.default_rng(0)
    prompts = DataProto.from_dict({"input_ids": rng.integers(0, 99, (1, 5)).astype(np.int32)}, {"uid": np.array(["a"])})
    out = DataProto.from_dict(
        {"responses": rng.integers(0, 99, (2, 4)).astype(np.int32), "rollout_log_probs": rng.normal(size=(2, 4))},
        {},
    )
    out.batch["rollout_log_probs"] = out.batch["rollout_log_probs"].astype(np.float32)
    lp = list(rng.normal(size=3).astype(np.float32))
    routes = [rng.integers(0, 4, (1, 7, 2)).astype(np.int32)]  # an MoE model's experts of the 7 tokens fed (k = 2)
    seq = Seq(1, np.arange(5, dtype=np.int32), 4, [3, 1, 4], lp, lp[::-1], routes=routes)
    versions = np.array([[2, 2, 2, -1], [2, 2, 2, -1]], np.int32)
    return PartialGeneration(prompts, 17, 2, out, [seq], versions)


def _same_partial(a, b):
    assert (a.seed, a.n) == (b.seed, b.n)
    np.testing.assert_array_equal(a.versions, b.versions)
    for x, y in ((a.prompts, b.prompts), (a.out, b.out)):
        assert set(x.batch) == set(y.batch)
        for k in x.batch:
            assert np.asarray(x.batch[k]).dtype == np.asarray(y.batch[k]).dtype
            np.testing.assert_array_equal(x.batch[k], y.batch[k])
    (s,), (t,) = a.unfinished, b.unfinished
    assert (s.row, s.limit, s.tokens) == (t.row, t.limit, t.tokens)
    assert len(s.routes) == len(t.routes) and all(np.array_equal(x, y) for x, y in zip(s.routes, t.routes))
    np.testing.assert_array_equal(s.prompt, t.prompt)
    for u, v in ((s.log_probs, t.log_probs), (s.thresholds, t.thresholds)):
        assert np.asarray(u, np.float32).tobytes() == np.asarray(v, np.float32).tobytes()  # to the bit


def test_packed_state_goes_through_a_checkpoint_and_continues_exactly(tmp_path):
    ref_rollout, rollout = FakeRollout(N), FakeRollout(N)
    ref, ar = AsyncRollout(S2_K2_R2, ref_rollout), AsyncRollout(S2_K2_R2, rollout)
    want = _train(ref, ref_rollout, prompt_batches(B), 6)
    loader = prompt_batches(B)
    _train(ar, rollout, loader, 3)
    ar.in_flight = _partial_generation()  # also a batch in flight (the fake rollout never stops one)
    assert len(ar.queue) > 0  # mid-queue

    tree = {"host": {}}
    ar.add_to_checkpoint(tree, rollout_params={"w": jax.numpy.zeros(2, jax.numpy.float32)})
    host = tree["host"]["async"]
    n_values = sum(np.asarray(x).size for g in ar.queue._items for x in g.batch.values())
    assert sum(host["arrays"].values()) >= n_values and set(host["arrays"]) >= {"int32", "float32"}
    # the JSON holds no numeric array: only object arrays (uid, pid) stay lists
    assert {d["dtype"] for d in _json_arrays(host, [])} == {"object"}
    old_form = json.dumps(ar.state_dict())
    assert len(json.dumps(host)) < len(old_form)

    c = Checkpointer(tmp_path, async_save=False)
    c.save(3, tree)
    assert sorted(c.read_host(3)["items"]) == ["async.arrays", "rollout.params"]
    like = {"async": {"arrays": AsyncRollout.arrays_like(c.read_host(3))}, "rollout": tree["rollout"]}
    saved = c.restore(3, like=like)
    c.close()

    resumed_rollout = FakeRollout(N)
    resumed_rollout.publish_copy = lambda params: None
    resumed = AsyncRollout(S2_K2_R2, resumed_rollout)
    assert resumed.restore_checkpoint(saved, like=tree["rollout"]["params"]) is not None
    resumed_rollout.version = resumed.rollout_version
    _same_partial(resumed.in_flight, ar.in_flight)
    assert resumed.state_dict() == ar.state_dict()  # the whole old-form state, to the bit
    resumed.in_flight = None  # what follows runs the fake rollout, which cannot resume a batch
    got = _train(resumed, resumed_rollout, prompt_batches(B, start=next(loader).non_tensor_batch["pid"][0]), 3, 3)
    for (t, b, nt, m), (t2, b2, nt2, m2) in zip(want[3:], got, strict=True):
        assert t == t2 and m == m2
        for k in b:
            np.testing.assert_array_equal(b[k], b2[k], err_msg=k)
        np.testing.assert_array_equal(nt["pid"], nt2["pid"])


def test_old_json_form_of_a_batch_in_flight_still_loads():
    gen = _partial_generation()
    old = json.loads(json.dumps(gen.state_dict()))  # what checkpoints before the array item hold
    assert _json_arrays(old, []) and isinstance(old["unfinished"][0]["tokens"], list)
    _same_partial(PartialGeneration.from_state_dict(old), gen)
    packer = ArrayPacker()
    new = json.loads(json.dumps(gen.state_dict(packer)))
    _same_partial(PartialGeneration.from_state_dict(new, packer.arrays()), gen)
    with pytest.raises(KeyError, match="no int32 buffer"):
        PartialGeneration.from_state_dict(new, {})


class _FailingRollout(FakeRollout):
    """The fake rollout whose reward fails on generation batch `fail_at` (counted from 0) and after."""

    def __init__(self, n, fail_at):
        super().__init__(n)
        self.fail_at = fail_at

    def generate_and_score(self, prompts, seed, timing, reward_fn):
        if len(self.calls) >= self.fail_at:
            raise RewardFunctionError("reward service down")
        return super().generate_and_score(prompts, seed, timing, reward_fn)


def test_reward_failure_mid_step_puts_the_producer_back():
    ref_rollout = FakeRollout(N)
    ref = AsyncRollout(S2_K2_R2, ref_rollout)
    want = _train(ref, ref_rollout, prompt_batches(B), 6)

    rollout = _FailingRollout(N, fail_at=10**9)
    ar = AsyncRollout(S2_K2_R2, rollout)
    loader = prompt_batches(B)
    _train(ar, rollout, loader, 3)
    at = int(next(loader).non_tensor_batch["pid"][0])  # the data position after step 3 (put back by the trainer)
    before, n_calls = json.dumps(ar.state_dict()), len(rollout.calls)
    rollout.fail_at = n_calls + 1  # step 3's second generation batch fails, after the first was queued
    snap = ar.snapshot()
    with pytest.raises(RewardFunctionError):
        _train(ar, rollout, prompt_batches(B, start=at), 1, start=3)
    assert len(rollout.calls) == n_calls + 1 and json.dumps(ar.state_dict()) != before  # the queue moved ...
    ar.restore(snap)
    assert json.dumps(ar.state_dict()) == before  # ... and is back
    rollout.fail_at = 10**9
    got = _train(ar, rollout, prompt_batches(B, start=at), 3, start=3)
    for (t, b, nt, m), (t2, b2, nt2, m2) in zip(want[3:], got, strict=True):
        assert t == t2 and m == m2
        for k in b:
            np.testing.assert_array_equal(b[k], b2[k], err_msg=k)
        np.testing.assert_array_equal(nt["pid"], nt2["pid"])
    q, rq = ar.queue, ref.queue
    assert (q.produced, q.trained, q.dropped) == (rq.produced, rq.trained, rq.dropped)  # nothing counted twice


def test_a_copy_of_a_batch_in_flight_is_not_reached_by_later_runs():
    gen = _partial_generation()
    c = gen.copy()
    c.out.batch["responses"][1, 3] = 7  # what a resumed row's write does
    c.unfinished[0].tokens.append(9)  # what resuming a sequence does
    c.unfinished[0].log_probs.append(np.float32(0.5))
    c.versions[1, 3] = 3
    assert gen.out.batch["responses"][1, 3] != 7 and gen.unfinished[0].tokens == [3, 1, 4]
    assert len(gen.unfinished[0].log_probs) == 3 and gen.versions[1, 3] == -1
    assert list(c.out.batch) == list(gen.out.batch)  # the same key order: the same checkpoint layout
    _same_partial(gen.copy(), gen)
