"""Validation metrics: hand-computed values, brute-force enumeration, verl naming."""

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from jaxrl_post.rl import validation as V


def test_sample_sizes_as_verl():
    assert V.sample_sizes(1) == []
    assert V.sample_sizes(2) == [2]
    assert V.sample_sizes(5) == [2, 4, 5]
    assert V.sample_sizes(8) == [2, 4, 8]
    assert V.sample_sizes(16) == [2, 4, 8, 16]


def test_pass_at_k_hand_and_comb():
    assert V.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert V.pass_at_k(4, 0, 2) == 0.0
    assert V.pass_at_k(4, 3, 2) == 1.0  # n - c < k: every pair holds a correct one
    assert V.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert V.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError):
        V.pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        V.pass_at_k(3, 1, 4)


def test_best_worst_of_k_hand():
    m, s = V.best_of_k([0.0, 1.0], 2)  # P(max = 1) = 3/4
    assert m == pytest.approx(0.75) and s == pytest.approx(math.sqrt(0.75 - 0.75**2))
    m, s = V.best_of_k([3.0, 1.0, 2.0], 2)  # max over 9 draws: 1 x1, 2 x3, 3 x5
    assert m == pytest.approx(22 / 9) and s == pytest.approx(math.sqrt(38) / 9)
    m, _ = V.worst_of_k([3.0, 1.0, 2.0], 2)  # min: 1 x5, 2 x3, 3 x1
    assert m == pytest.approx(14 / 9)
    m, s = V.best_of_k([0.3, 0.3, 0.3], 4)
    assert m == pytest.approx(0.3) and s == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_best_worst_of_k_brute_force(k):
    rng = np.random.default_rng(k)
    v = rng.integers(0, 3, size=5).astype(float)  # ties on purpose
    draws = np.array(list(itertools.product(range(5), repeat=k)))
    mx, mn = v[draws].max(1), v[draws].min(1)
    assert V.best_of_k(v, k) == pytest.approx((mx.mean(), mx.std()))
    assert V.worst_of_k(v, k) == pytest.approx((mn.mean(), mn.std()))


def _maj_brute(values, preds, k):
    """verl's vote on every ordered draw: Counter.most_common (first-seen wins ties), first such response."""
    out = []
    for d in itertools.product(range(len(values)), repeat=k):
        top = Counter(preds[i] for i in d).most_common(1)[0][0]
        out.append(values[next(i for i in d if preds[i] == top)])
    return np.mean(out), np.std(out)


def test_maj_of_k_hand_and_brute_force():
    # two answers, one each: the first-drawn wins the 1-1 tie -> mean 1/2
    assert V.maj_of_k([1.0, 0.0], ["x", "y"], 2) == pytest.approx((0.5, 0.5))
    # 'y' (wrong) wins only when drawn >= 2 of 3 times: 1 + 6 of 27 draws -> 20/27
    assert V.maj_of_k([1.0, 1.0, 0.0], ["x", "x", "y"], 3)[0] == pytest.approx(20 / 27)
    # k = 1: a uniformly random response
    assert V.maj_of_k([1.0, 0.0, 0.0, 1.0], ["a", "b", "c", None], 1)[0] == pytest.approx(0.5)
    rng = np.random.default_rng(0)
    vals = list(rng.integers(0, 2, size=5).astype(float))
    preds = ["7", "7", None, "3", "7"]
    for k in (2, 3, 4):
        assert V.maj_of_k(vals, preds, k) == pytest.approx(_maj_brute(vals, preds, k))


def test_maj_of_k_bootstrap_close_to_exact():
    vals = [1.0, 0.0, 1.0, 0.0, 0.0]
    preds = ["a", "b", "a", "c", "b"]
    exact = V.maj_of_k(vals, preds, 6, exact_limit=10**5)  # 5^6 = 15625 draws
    boot = V.maj_of_k(vals, preds, 6, exact_limit=10, n_bootstrap=20000, seed=1)
    assert abs(boot[0] - exact[0]) < 0.02 and abs(boot[1] - exact[1]) < 0.02
    assert boot == V.maj_of_k(vals, preds, 6, exact_limit=10, n_bootstrap=20000, seed=1)  # seeded


def test_process_validation_metrics_names_and_values():
    # source A: 2 prompts x 4 responses; source B: 1 prompt x 1 response (n=1)
    ds = ["A"] * 8 + ["B"]
    uid = ["p0"] * 4 + ["p1"] * 4 + ["q0"]
    reward = np.array([1, 0, 0, 0, 1, 1, 1, 0, 0.5])
    preds = ["5", "6", "6", "7", "2", "2", "2", "9", None]
    m = V.process_validation_metrics(ds, uid, {"reward": reward}, preds)
    # mean@4: (0.25 + 0.75) / 2
    assert m["val-core/A/reward/mean@4"] == pytest.approx(0.5)
    assert m["val-aux/A/reward/std@4"] == pytest.approx(np.mean([np.std([1, 0, 0, 0]), np.std([1, 1, 1, 0])]))
    # best@4: 1 - (3/4)^4 for p0 (one 1), 1 - (1/4)^4 for p1 (three 1s)
    assert m["val-core/A/reward/best@4/mean"] == pytest.approx((1 - 0.75**4 + 1 - 0.25**4) / 2)
    assert "val-core/A/reward/best@4/std" in m  # verl's rule: starts with best and has @n_max
    assert m["val-aux/A/reward/best@2/mean"] == pytest.approx((1 - 0.75**2 + 1 - 0.25**2) / 2)
    assert m["val-aux/A/reward/worst@4/mean"] == pytest.approx((0.25**4 + 0.75**4) / 2)  # all 4 draws are 1s
    # pass@k (Codex): p0 c=1, p1 c=3, n=4
    assert m["val-core/A/reward/pass@4"] == pytest.approx(1.0)
    assert m["val-aux/A/reward/pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0) / 2)
    assert m["val-core/A/reward/maj@4/mean"] == pytest.approx(
        (_maj_brute([1, 0, 0, 0], preds[:4], 4)[0] + _maj_brute([1, 1, 1, 0], preds[4:8], 4)[0]) / 2
    )
    assert m["val-core/B/reward/mean@1"] == 0.5
    assert not [k for k in m if k.startswith("val-") and "/B/" in k and k != "val-core/B/reward/mean@1"]
    groups = {k.split("/")[0] for k in m}
    assert groups == {"val-core", "val-aux"}


def test_process_validation_metrics_acc_is_core_and_nan_rows():
    ds = ["g"] * 4
    uid = ["a", "a", "b", "b"]
    infos = {"reward": [1.0, 0.1, 0.1, 0.1], "acc": [1.0, 0.0, 0.0, 0.0], "extra": [np.nan, 2.0, 4.0, np.nan]}
    m = V.process_validation_metrics(ds, uid, infos)
    assert m["val-core/g/acc/mean@2"] == pytest.approx(0.25)
    assert m["val-aux/g/reward/mean@2"] == pytest.approx((0.55 + 0.1) / 2)  # reward is aux when acc exists
    assert m["val-core/g/acc/pass@2"] == pytest.approx(0.5)
    assert "val-aux/g/reward/pass@2" not in m  # pass@k only for the core variable
    # NaN entries are left out: each prompt has one 'extra' value -> n = 1
    assert m["val-aux/g/extra/mean@1"] == pytest.approx(3.0)
    assert not any("maj@" in k for k in m)  # no answers given
    with pytest.raises(ValueError, match="reward has 3 entries"):
        V.process_validation_metrics(ds, uid, {"reward": [1, 2, 3]})


def test_extract_answer():
    assert V.extract_answer("openai/gsm8k", "so #### 1,000") == V.extract_answer("openai/gsm8k", "#### 1000.0")
    assert V.extract_answer("openai/gsm8k", "no answer") is None
    assert V.extract_answer("reasoning_gym/basic_arithmetic", "x <answer> 42 </answer>") == "42"
    assert V.extract_answer("lighteval/MATH", r"thus \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert V.extract_answer("unknown_source", "#### 3") is None


def test_multi_turn_rows_report_tool_calls_rate_and_turns():
    """`validation_loop._rows_of` on a multi-turn batch: tool calls per trajectory, the share of trajectories
    that call a tool and the turns become `val-aux/{ds}/{key}/mean@1` (hand-computed below)."""
    from types import SimpleNamespace

    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rl import validation_loop as VL

    out = DataProto.from_dict(
        {"response_attention_mask": np.ones((4, 3), np.int32)},
        {
            "data_source": np.array(["calc"] * 4, object),
            "uid": np.array(["a", "b", "c", "d"], object),
            "tool_calls": np.array([0, 2, 1, 0], np.int32),
            "num_turns": np.array([1, 5, 3, 1], np.int32),
        },
    )
    res = SimpleNamespace(scores=np.array([0.0, 1.0, 1.0, 0.0]), extra_infos={})
    rows = VL._rows_of(out, res, reward_fn=None, n=1)
    np.testing.assert_array_equal(rows["extras"]["tool_calls"], [0, 2, 1, 0])
    np.testing.assert_array_equal(rows["extras"]["tool_call_rate"], [0, 1, 1, 0])
    m = V.process_validation_metrics(rows["sources"], rows["uids"], {"reward": rows["scores"], **rows["extras"]})
    assert m["val-core/calc/reward/mean@1"] == 0.5
    assert m["val-aux/calc/tool_calls/mean@1"] == 0.75  # (0 + 2 + 1 + 0) / 4
    assert m["val-aux/calc/tool_call_rate/mean@1"] == 0.5  # 2 of 4 trajectories called the calculator
    assert m["val-aux/calc/num_turns/mean@1"] == 2.5
