"""DAPO: overlong reward shaping (core_algos.compute_overlong_penalty, the reward manager), dynamic sampling
(algorithm.filter_groups: the group filter, the generation-batch loop, max_num_gen_batches), the config
checks, and configs/dapo.py:tiny end to end (fixed shapes, compile once, resume, the error path)."""

import os
import sys

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import dapo
from jaxrl_post.algos import core_algos
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.config_check import validate_config
from jaxrl_post.rl.dynamic_sampling import (
    FilterGroupsError,
    GroupCollector,
    filter_metric_values,
    kept_groups,
    merge_reward_metrics,
)


# ----------------------------------------------------------------------------------------- overlong penalty
def test_overlong_penalty_hand_cases():
    # Lmax = 12, Lbuf = 4, factor 1: no penalty up to 8 tokens, then -1/4 per token, -1 at (and past) 12
    lengths = np.array([0, 5, 8, 9, 10, 11, 12, 15])
    got = core_algos.compute_overlong_penalty(lengths, 12, 4, 1.0)
    assert got.dtype == np.float32 and got.shape == (8,)
    np.testing.assert_allclose(got, [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0], rtol=0, atol=1e-7)
    # Lmax = 20, Lbuf = 5, factor 0.5: 0.5 * (15 - L) / 5 inside the buffer
    got = core_algos.compute_overlong_penalty(np.array([15, 16, 17, 19, 20, 21]), 20, 5, 0.5)
    np.testing.assert_allclose(got, [0, -0.1, -0.2, -0.4, -0.5, -0.5], rtol=0, atol=1e-7)
    # the buffer may be the whole response; factor 0 switches the penalty off; traced lengths under jit
    np.testing.assert_allclose(core_algos.compute_overlong_penalty(np.array([0, 2, 4]), 4, 4, 2.0), [0, -1, -2])
    np.testing.assert_array_equal(core_algos.compute_overlong_penalty(np.array([3, 12]), 12, 4, 0.0), [0, 0])
    jitted = jax.jit(lambda x: core_algos.compute_overlong_penalty(x, 12, 4, 1.0))
    np.testing.assert_allclose(jitted(np.array([9, 13], np.int32)), [-0.25, -1.0])


@pytest.mark.parametrize(
    "args, match",
    [((12, 0, 1.0), "overlong_buffer_len"), ((12, 13, 1.0), "overlong_buffer_len"), ((12, 4, -1.0), "penalty_factor")],
)
def test_overlong_penalty_rejects_bad_settings(args, match):
    with pytest.raises(ValueError, match=match):
        core_algos.compute_overlong_penalty(np.array([1]), *args)


class _CharTok:
    """Token id = ord(char)."""

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(t) for t in s) for s in seqs]


def _batch(texts, R):
    from jaxrl_post.batch.protocol import DataProto

    B = len(texts)
    resp, mask = np.full((B, R), ord("Z"), np.int32), np.zeros((B, R), np.int32)
    for i, t in enumerate(texts):
        resp[i, : len(t)] = [ord(c) for c in t]
        mask[i, : len(t)] = 1
    return DataProto.from_dict(
        tensors={"responses": resp, "response_mask": mask},
        non_tensors={"data_source": np.array(["toy"] * B, object), "ground_truth": np.array(["7"] * B, object)},
    )


def _has_seven(data_source, solution_str, ground_truth, extra_info=None):
    return float("7" in solution_str)


def _dict_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0 * ("7" in solution_str), "acc": float(len(solution_str) % 2)}


def test_reward_manager_adds_the_overlong_penalty_and_logs_it():
    from jaxrl_post.rewards import RewardManager

    # Lmax = 10, buffer 4: lengths 3, 6, 7, 8, 10 -> penalties 0, 0, -0.25, -0.5, -1.0 (factor 1)
    texts = ["a7a", "bbbbbb", "7cccccc", "dddddd7d", "eeeeeeeeee"]
    mgr = RewardManager(
        _has_seven, _CharTok(), num_workers=0, overlong_buffer_len=4, overlong_penalty_factor=1.0,
        max_response_length=10, overlong_log=True,
    )  # fmt: skip
    out = mgr.compute(_batch(texts, 10))
    raw = np.array([1, 0, 1, 1, 0], np.float32)
    pen = np.array([0, 0, -0.25, -0.5, -1.0], np.float32)
    np.testing.assert_allclose(out.scores, raw + pen)
    np.testing.assert_array_equal(out.function_scores, raw)
    want = np.zeros((5, 10), np.float32)
    want[np.arange(5), [2, 5, 6, 7, 9]] = raw + pen  # on each response's last valid token
    np.testing.assert_allclose(out.token_level_scores, want)
    np.testing.assert_array_equal(out.extra_infos["acc"], raw)  # verl: acc = the function's own score
    np.testing.assert_allclose(out.extra_infos["overlong_reward"], pen)
    np.testing.assert_array_equal(out.extra_infos["overlong"], [0, 0, 1, 1, 1])
    assert out.metrics["reward/extra/overlong_reward/mean"] == pytest.approx(-1.75 / 5)
    assert out.metrics["reward/extra/overlong/mean"] == pytest.approx(0.6)
    assert out.metrics["reward/extra/acc/mean"] == pytest.approx(0.6)

    # a dict result keeps its own acc; without `log` no overlong keys; off: the scores are untouched
    mgr = RewardManager(
        _dict_reward, _CharTok(), num_workers=0, overlong_buffer_len=4, overlong_penalty_factor=2.0,
        max_response_length=10,
    )  # fmt: skip
    out = mgr.compute(_batch(texts, 10))
    np.testing.assert_allclose(out.scores, 2 * raw + 2 * pen)
    np.testing.assert_array_equal(out.extra_infos["acc"], [1, 0, 1, 0, 0])
    assert "overlong_reward" not in out.extra_infos and "overlong" not in out.extra_infos
    out = RewardManager(_has_seven, _CharTok(), num_workers=0).compute(_batch(texts, 10))
    np.testing.assert_array_equal(out.scores, raw)
    assert "acc" not in out.extra_infos
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        RewardManager(_has_seven, _CharTok(), num_workers=0, overlong_buffer_len=11, max_response_length=10)


# ----------------------------------------------------------------------------------------- the group filter
def test_kept_groups_hand_cases():
    # groups of 4: all correct, all wrong, mixed, mixed (values not adjacent), all equal partial credit
    uids = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d", "e", "d", "e", "d", "e", "d", "e"] + ["f"] * 4, object)
    acc = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0.5, 0, 0.5, 0, 0.5, 1, 0.5, 0.3, 0.3, 0.3, 0.3])
    keep, kept, dropped = kept_groups(uids, acc)
    assert kept == ["c", "d"] and dropped == ["a", "b", "e", "f"]
    np.testing.assert_array_equal(keep, np.isin(uids.astype(str), ["c", "d"]))
    # verl keeps a group of one response; non-numeric values: kept when they differ
    keep, kept, _ = kept_groups(np.array([7, 8, 8]), np.array([1.0, 0.0, 0.0]))
    assert kept == [7] and keep.tolist() == [True, False, False]
    keep, kept, dropped = kept_groups(np.array([1, 1, 2, 2]), np.array(["x", "y", "z", "z"], object))
    assert kept == [1] and dropped == [2]


def test_filter_metric_values_resolve_names():
    fs = np.array([1.0, 0.0])
    tls = np.array([[0.0, 0.5], [0.0, -1.0]])
    extra = {"overlong": np.array([0.0, 1.0], np.float32)}
    kw = dict(function_scores=fs, token_level_scores=tls, extra_infos=extra)
    np.testing.assert_array_equal(filter_metric_values("acc", **kw), [1.0, 0.0])
    np.testing.assert_array_equal(filter_metric_values("score", **kw), [1.0, 0.0])
    np.testing.assert_array_equal(filter_metric_values("seq_reward", **kw), [0.5, -1.0])
    np.testing.assert_array_equal(filter_metric_values("seq_final_reward", **kw), [0.5, -1.0])
    np.testing.assert_array_equal(filter_metric_values("overlong", **kw), [0.0, 1.0])
    kw["extra_infos"] = dict(extra, acc=np.array([0.0, 0.0], np.float32))  # the function's own acc wins
    np.testing.assert_array_equal(filter_metric_values("acc", **kw), [0.0, 0.0])
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.metric='nope'.*'overlong'"):
        filter_metric_values("nope", **kw)


def _round(first_uid, pattern, n=2):
    """One generation batch of len(pattern) groups of n: 'k' = a mixed group (kept), 'd' = uniform (dropped)."""
    uids, vals = [], []
    for g, p in enumerate(pattern):
        uids += [first_uid + g] * n
        vals += [1.0, 0.0] + [0.0] * (n - 2) if p == "k" else [1.0] * n
    uids = np.array(uids)
    return {"row": uids * 10 + np.tile(np.arange(n), len(pattern)), "uid": uids}, uids, np.array(vals)


def test_collector_needs_two_and_three_generation_batches():
    # train_batch_size 3, n 2: rounds keep 2 then 2 groups -> 2 rounds, the 4th kept group is surplus
    c = GroupCollector(3, 2, max_num_gen_batches=0)
    assert not c.add(*_round(0, "kdk"))
    assert c.add(*_round(10, "kkd"))
    b = c.batch()
    np.testing.assert_array_equal(b["uid"], [0, 0, 2, 2, 10, 10])  # first 3 kept groups, generation order
    np.testing.assert_array_equal(b["row"], [0, 1, 20, 21, 100, 101])
    assert c.metrics() == {"train/num_gen_batches": 2, "train/num_kept_groups": 4, "train/num_dropped_groups": 2}

    # 1 + 0 + 2 kept groups -> 3 rounds; rows of the kept groups only
    c = GroupCollector(3, 2, max_num_gen_batches=3)
    assert not c.add(*_round(0, "ddk"))
    assert not c.add(*_round(10, "ddd"))
    assert c.add(*_round(20, "kdk"))
    np.testing.assert_array_equal(c.batch()["uid"], [2, 2, 20, 20, 22, 22])
    assert c.metrics() == {"train/num_gen_batches": 3, "train/num_kept_groups": 3, "train/num_dropped_groups": 6}

    # enough in the first batch: one round, nothing dropped
    c = GroupCollector(3, 2, max_num_gen_batches=1)
    assert c.add(*_round(0, "kkk"))
    assert c.metrics()["train/num_gen_batches"] == 1 and len(c.batch()["uid"]) == 6


def test_collector_stops_at_max_num_gen_batches():
    c = GroupCollector(3, 2, max_num_gen_batches=2, metric="acc")
    assert not c.add(*_round(0, "kdd"))
    with pytest.raises(FilterGroupsError, match=r"2 generation batches gave 2 of the data\.train_batch_size=3"):
        c.add(*_round(10, "dkd"))
    with pytest.raises(FilterGroupsError, match=r"max_num_gen_batches=2"):
        c2 = GroupCollector(3, 2, max_num_gen_batches=2)
        c2.add(*_round(0, "ddd"))
        c2.add(*_round(10, "ddd"))
    # <= 0: no limit (verl)
    c = GroupCollector(1, 2, max_num_gen_batches=0)
    for i in range(12):
        assert not c.add(*_round(10 * i, "ddd"))
    assert c.add(*_round(200, "dkd"))
    assert c.metrics()["train/num_gen_batches"] == 13 and c.batch()["uid"].tolist() == [201, 201]
    with pytest.raises(ValueError, match="rollout.n = 2"):  # a group with the wrong number of responses
        GroupCollector(1, 2, 0).add({"uid": np.array([1, 1, 1])}, np.array([1, 1, 1]), np.array([0.0, 1.0, 1.0]))


def test_merge_reward_metrics_over_generation_batches():
    from jaxrl_post.rewards import RewardOutput

    def out(acc, errors):
        m = {"reward/num_errors": errors, "reward/num_timeouts": 0.0, "reward/extra/acc/mean": float(np.mean(acc))}
        return RewardOutput(None, None, m, {"acc": np.asarray(acc, np.float32)})

    m = merge_reward_metrics([out([1, 0, 0, 0], 1.0), out([1, 1, np.nan, 1], 2.0)])
    assert m == {"reward/num_errors": 3.0, "reward/num_timeouts": 0.0, "reward/extra/acc/mean": pytest.approx(4 / 7)}


# ----------------------------------------------------------------------------------------- config checks
def test_dapo_config_and_its_errors():
    for variant in (None, "tiny"):
        c = dapo.get_config(variant)
        validate_config(c, n_devices=1)
        assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
        assert not c.actor.use_kl_loss and not c.algorithm.use_kl_in_reward
        assert c.algorithm.filter_groups.enable and c.reward_model.overlong_buffer.enable

    def bad(match, **kv):
        c = dapo.get_config("tiny")
        c.custom_reward_function.path = None if kv.pop("builtin", False) else c.custom_reward_function.path
        for key, value in kv.items():
            node = c
            *parents, leaf = key.split("__")
            for p in parents:
                node = node[p]
            node[leaf] = value
        with pytest.raises(ConfigError, match=match):
            validate_config(c, n_devices=1)

    bad(r"config\.rollout\.n=1: algorithm\.filter_groups", rollout__n=1, algorithm__adv_estimator="reinforce_plus_plus")
    bad(r"config\.algorithm\.filter_groups\.metric='nope': unknown metric", builtin=True, **{
        "algorithm__filter_groups__metric": "nope"})  # fmt: skip
    bad(r"config\.algorithm\.filter_groups\.metric='': must name", algorithm__filter_groups__metric="")
    bad(r"filter_groups\.metric='seq_final_reward'", algorithm__filter_groups__metric="seq_final_reward",
        algorithm__use_kl_in_reward=True)  # fmt: skip
    bad(r"config\.reward_model\.overlong_buffer\.len=13: must be an int in \(0, data\.max_response_length=12\]",
        reward_model__overlong_buffer__len=13)  # fmt: skip
    bad(r"overlong_buffer\.len=0", reward_model__overlong_buffer__len=0)
    bad(r"overlong_buffer\.penalty_factor=-1\.0: must be >= 0", reward_model__overlong_buffer__penalty_factor=-1.0)
    # a custom reward function may report any extra key: checked when the first batch is scored
    c = dapo.get_config("tiny")
    c.algorithm.filter_groups.metric = "my_extra_key"
    validate_config(c, n_devices=1)


# ----------------------------------------------------------------------------------------- end to end
_TIME_KEYS = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")


def _tiny(workdir, **kv):
    c = dapo.get_config("tiny")
    c.trainer.default_local_dir = str(workdir)
    c.trainer.save_freq = 1
    for k, v in kv.items():
        node = c
        *parents, leaf = k.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = v
    return c


def _text(ids):
    from jaxrl_post.models.char_tokenizer import CHARS, SPECIAL_TOKENS

    first = len(SPECIAL_TOKENS)  # ids past the 101 of the tokenizer (vocab 128) decode to nothing
    return "".join(CHARS[t - first] for t in ids if first <= t < first + len(CHARS))


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A module-wide persistent XLA compilation cache: the second trainer (same shapes) starts cheaply."""
    from jax._src import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {n: getattr(jax.config, n) for n in names}
    # the session's cache (tests/conftest.py; shared with the other files' tiny trainers), else one for this module
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for n, v in old.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def dapo_run(jax_cache, tmp_path_factory):
    """configs/dapo.py:tiny, 2 steps (checkpoint after each), every update's batch recorded."""
    from jaxrl_post.rl import updates
    from jaxrl_post.rl.trainer import RLTrainer
    from jaxrl_post.rollout import TRACE_COUNTS

    workdir = tmp_path_factory.mktemp("dapo")
    t = RLTrainer(_tiny(workdir), console_write=lambda s: None)
    batches = []
    update = updates.update_actor  # the trainer calls `updates.update_actor(cfg, policy, geometry, state, ...)`
    updates.update_actor = lambda cfg, policy, geometry, state, host, b, mask, rng: (
        batches.append(dict({k: np.copy(v) for k, v in b.items()}, train_mask=np.copy(mask))),
        update(cfg, policy, geometry, state, host, b, mask, rng),
    )[1]
    try:
        result = t.fit()
        out = {
            "workdir": str(workdir),
            "result": result,
            "batches": batches,
            "data_state": t.data.train_loader.get_state(),
            "params": _host(t.state.actor.params),
            "counts": (t.compile_counts(), dict(t.trace_counts)),
        }
        before = (dict(t.trace_counts), dict(TRACE_COUNTS), t.compile_counts())
        t.train_step(next(t.data.train_loader))  # a third step (more generation batches possible) compiles nothing
        out["third_step_compiles"] = before != (dict(t.trace_counts), dict(TRACE_COUNTS), t.compile_counts())
    finally:
        updates.update_actor = update
        t.close()
    return out


@pytest.mark.slow
def test_dapo_tiny_end_to_end(dapo_run):
    hist = dapo_run["result"]["history"]
    assert len(hist) == 2
    n_gen = [int(m["train/num_gen_batches"]) for m in hist]
    for m, g in zip(hist, n_gen):
        assert m["train/num_kept_groups"] + m["train/num_dropped_groups"] == 4 * g  # 4 prompts per batch
        assert m["train/num_kept_groups"] >= 4 and g >= 1
        for k in ("reward/extra/acc/mean", "reward/extra/overlong_reward/mean", "reward/extra/overlong/mean"):
            assert k in m, k
        assert "actor/pg_clipfrac" in m and "actor/kl_loss" not in m  # DAPO: no KL loss
    assert sum(n_gen) > 2  # this seed needs a second generation batch (checked: deterministic on CPU)
    # the data position is after every generation batch read (checkpoints resume from there)
    assert dapo_run["data_state"]["next_index"] == sum(n_gen)

    # every update saw exactly 4 groups x 4 responses, each with a varying acc (recomputed from the tokens),
    # and the scores are acc + the overlong penalty computed here by hand (Lmax 12, buffer 4, factor 1)
    assert len(dapo_run["batches"]) == 3  # steps 1, 2 and the extra third step
    for b in dapo_run["batches"]:
        assert b["responses"].shape == (16, 12) and b["advantages"].shape == (16, 12)
        prompts = b["input_ids"][:, :-12].reshape(4, 4, -1)
        assert (prompts == prompts[:, :1]).all() and len({p.tobytes() for p in prompts[:, 0]}) == 4  # 4 groups
        mask = b["response_attention_mask"].astype(bool)
        acc = np.array([any(ch.isdigit() for ch in _text(r[m])) for r, m in zip(b["responses"], mask)], float)
        assert all(len(set(g)) == 2 for g in acc.reshape(4, 4)), acc  # no all-right / all-wrong group
        pen = np.clip((8 - mask.sum(-1)) / 4, -1.0, 0.0)
        np.testing.assert_allclose(b["token_level_scores"].sum(-1), acc + pen, atol=1e-6)
    compile_counts, trace_counts = dapo_run["counts"]
    assert set(compile_counts.values()) == {1} and set(trace_counts.values()) == {1}, dapo_run["counts"]
    assert not dapo_run["third_step_compiles"]

    # validation is never filtered: all 16 held-out prompts, acc is the core metric
    for v in (dapo_run["result"]["val_before"], dapo_run["result"]["val_after"]):
        assert v["val-aux/reasoning_gym/basic_arithmetic/num_samples"] == 16
        assert "val-core/reasoning_gym/basic_arithmetic/acc/mean@1" in v
        assert "val-aux/reasoning_gym/basic_arithmetic/overlong_reward/mean@1" in v


@pytest.mark.slow  # the `dapo_run` fixture: a tiny DAPO run end to end (104 s on 2 shared, loaded cores)
def test_dapo_resume_is_exact_and_max_num_gen_batches_stops_cleanly(dapo_run, tmp_path, monkeypatch):
    """Resuming from step 1 repeats step 2 bit for bit (the data position includes the extra generation
    batches); a step that cannot fill its batch raises FilterGroupsError with the last step saved and the
    data position and RNG put back."""
    from jaxrl_post.rl import dynamic_sampling
    from jaxrl_post.rl.trainer import RLTrainer

    step1 = os.path.join(dapo_run["workdir"], "checkpoints", "global_step_1")
    c = _tiny(
        tmp_path,
        trainer__resume_mode="resume_path",
        trainer__resume_from_path=step1,
        trainer__total_training_steps=3,  # constant lr: the schedule does not depend on it
        trainer__val_before_train=False,
        trainer__val_at_end=False,
    )
    lines = []
    t = RLTrainer(c, console_write=lines.append)
    try:
        assert t.global_steps == 1
        (m2,) = t.fit(max_steps=1)["history"]
        keep = lambda m: {k: v for k, v in m.items() if not k.startswith(_TIME_KEYS) and not k.startswith("val-")}
        assert keep(m2) == keep(dapo_run["result"]["history"][1])
        assert t.data.train_loader.get_state() == dapo_run["data_state"]
        for x, y in zip(jax.tree.leaves(_host(t.state.actor.params)), jax.tree.leaves(dapo_run["params"])):
            assert x.tobytes() == y.tobytes()

        # step 3: every group's metric is made identical -> 2 generation batches, then the error
        monkeypatch.setattr(dynamic_sampling, "filter_metric_values", lambda metric, **kw: np.ones(16))
        t.config.algorithm.filter_groups.max_num_gen_batches = 2
        data_state, rng = t.data.train_loader.get_state(), np.asarray(jax.random.key_data(t.state.rng))
        with pytest.raises(FilterGroupsError, match=r"2 generation batches gave 0 of the data\.train_batch_size=4"):
            t.fit()
        assert t.global_steps == 2 and t.data.train_loader.get_state() == data_state
        assert np.array_equal(np.asarray(jax.random.key_data(t.state.rng)), rng)
        assert lines[-1].startswith("stopped by an error in step 3; checkpoint of step 2 is ")
    finally:
        t.close()
