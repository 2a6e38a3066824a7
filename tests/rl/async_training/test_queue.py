"""`GroupQueue` and the staleness rule by hand: the bound holds (a full queue refuses a put), the JSON state is exact
(float32 log-probs to the bit, object arrays), `is_fresh` is `t - v <= s` and refuses versions from the future, and
`staleness_metrics` counts a sample's staleness from its oldest token; a group's version is its oldest token's,
the positions past a response's end (-1: nothing sampled them) left out."""

import json

import numpy as np
import pytest

from jaxrl_post.rl.async_training.queue import GroupQueue, ScoredGroup, group_version, split_groups
from jaxrl_post.rl.async_training.staleness import is_fresh, staleness_metrics


def _group(i, version=0):
    rng = np.random.default_rng(i)
    batch = {
        "rollout_log_probs": rng.normal(size=(2, 3)).astype(np.float32),
        "responses": rng.integers(0, 100, (2, 3)).astype(np.int32),
        "truncated": np.array([True, False]),
    }
    nt = {"uid": np.array([f"u{i}", f"u{i}"], dtype=object), "extra": np.array([{"a": 1}, None], dtype=object)}
    return ScoredGroup(i, version, batch, nt, {"reward/x": 0.25})


def test_queue_is_bounded_and_its_json_state_is_exact():
    q = GroupQueue(capacity=2)
    q.put(_group(0))
    q.put(_group(1, version=3))
    with pytest.raises(OverflowError):
        q.put(_group(2))
    q.drop(q.get(), "stale")
    back = GroupQueue(capacity=1)
    back.load_state_dict(json.loads(json.dumps(q.state_dict())))
    assert (len(back), back.capacity, back.produced, back.dropped) == (1, 2, 2, {"stale": [0]})
    got, want = back.get(), _group(1, version=3)
    assert (got.group_id, got.version, got.metrics) == (1, 3, want.metrics)
    for k, v in want.batch.items():
        assert got.batch[k].dtype == v.dtype
        np.testing.assert_array_equal(got.batch[k], v)  # bit for bit
    assert list(got.non_tensor["uid"]) == ["u1", "u1"] and list(got.non_tensor["extra"]) == [{"a": 1}, None]


def test_staleness_rule_and_metrics_by_hand():
    assert is_fresh(3, 5, 2) and not is_fresh(2, 5, 2) and is_fresh(5, 5, 0)
    with pytest.raises(ValueError, match="versions run ahead"):
        is_fresh(6, 5, 2)
    versions = np.array([[3, 4, 4], [4, 4, -1], [-1, -1, -1]], np.int32)  # row 0: resumed under version 4
    mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    m = staleness_metrics(versions, mask, step=5)
    # samples: 5 - 3 = 2, 5 - 4 = 1, no tokens = 0; tokens: 2, 1, 1, 1, 1
    assert m == {"async/staleness/mean": 1.0, "async/staleness/max": 2.0, "async/token_staleness/mean": 6 / 5}


def test_group_version_is_its_oldest_existing_token():
    # partial rollout: row 0 resumed (versions 3 then 4), row 1 shorter, its tail -1 (no token there)
    versions = np.array([[3, 4, 4, 4], [4, 4, -1, -1]], np.int32)
    assert group_version(versions, current=5) == 3
    assert group_version(versions[1:], current=5) == 4  # was -1: every short group dropped as stale (issue 57)
    assert group_version(np.full((2, 4), -1, np.int32), current=5) == 5  # no token at all: nothing is stale
    b = {"responses": np.zeros((4, 4), np.int32)}
    nt = {"uid": np.array(list("aabb"), dtype=object)}
    both = np.concatenate([versions, np.array([[2, -1, -1, -1], [6, 6, 6, -1]], np.int32)])
    groups = split_groups(b, nt, 2, both, first_id=7, metrics={}, current=6)
    assert [(g.group_id, g.version) for g in groups] == [(7, 3), (8, 2)]
    np.testing.assert_array_equal(groups[1].batch["rollout_versions"], both[2:])  # the per-token tags are kept
    # a group saved with the old rule's -1 (a checkpoint written before the fix) loads with its real version
    old = groups[0].to_json()
    old["version"] = -1
    assert ScoredGroup.from_json(json.loads(json.dumps(old))).version == 3
