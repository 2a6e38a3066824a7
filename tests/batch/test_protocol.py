"""Tests for jaxrl_post.batch.protocol.DataProto (expected values from plain numpy indexing)."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.batch.protocol import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    pad_to_divisor,
    unpad,
    unpad_dataproto,
)

B = 6


def _make(backend="np", n=B):
    """ids [n, 3] int32, score [n] float32, uid (str), extra (dicts), msgs (equal-length lists)."""
    ids = np.arange(n * 3, dtype=np.int32).reshape(n, 3)
    score = np.linspace(0.0, 1.0, n, dtype=np.float32)
    if backend == "jax":
        ids, score = jnp.asarray(ids), jnp.asarray(score)
    return DataProto.from_dict(
        tensors={"ids": ids, "score": score},
        non_tensors={
            "uid": [f"u{i}" for i in range(n)],
            "extra": [{"i": i, "tag": [i, i]} for i in range(n)],
            "msgs": [[{"role": "user", "content": str(i)}] for i in range(n)],
        },
        meta_info={"temperature": 0.7},
    )


def _ids(d):
    return np.asarray(d.batch["ids"])


def _check_type(d, backend):
    want = jax.Array if backend == "jax" else np.ndarray
    for v in d.batch.values():
        assert isinstance(v, want), type(v)
    if backend == "np":
        for v in d.batch.values():
            assert not isinstance(v, jax.Array)


def _assert_rows(d, rows, backend):
    """``d`` holds exactly the rows ``rows`` of ``_make(backend)`` in that order."""
    ref = _make("np")
    rows = np.asarray(rows, dtype=np.int64)
    _check_type(d, backend)
    assert len(d) == len(rows)
    np.testing.assert_array_equal(_ids(d), ref.batch["ids"][rows])
    np.testing.assert_array_equal(np.asarray(d.batch["score"]), ref.batch["score"][rows])
    assert list(d.non_tensor_batch["uid"]) == [f"u{i}" for i in rows]
    assert list(d.non_tensor_batch["extra"]) == [{"i": int(i), "tag": [int(i), int(i)]} for i in rows]
    for v in d.non_tensor_batch.values():
        assert v.shape == (len(rows),)


backends = pytest.mark.parametrize("backend", ["np", "jax"])


# ------------------------------------------------------------------ construction


def test_from_dict_lists_become_1d_object_arrays():
    d = _make()
    assert len(d) == B
    for k in ("uid", "extra", "msgs"):
        arr = d.non_tensor_batch[k]
        assert arr.dtype == object and arr.shape == (B,), (k, arr.shape)
    # equal-length inner lists would give np.array(..., dtype=object) a 2-D shape
    d2 = DataProto.from_dict(non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]]})
    assert d2.non_tensor_batch["pairs"].shape == (3,)
    assert d2.non_tensor_batch["pairs"][1] == [3, 4]
    assert len(d2) == 3
    # numpy arrays are kept as they are (including numeric non-tensors)
    arr = np.arange(3)
    d3 = DataProto.from_dict(non_tensors={"idx": arr})
    assert d3.non_tensor_batch["idx"] is arr


def test_from_single_dict_splits_by_type():
    d = DataProto.from_single_dict(
        {
            "ids": np.ones((2, 3), np.int32),
            "mask": jnp.ones((2, 3), bool),
            "src": np.array(["a", "b"], dtype=object),
            "gt": ["1", "2"],
        },
        meta_info={"x": 1},
    )
    assert set(d.batch) == {"ids", "mask"}
    assert set(d.non_tensor_batch) == {"src", "gt"}
    assert d.meta_info == {"x": 1}


def test_mismatched_batch_sizes_raise():
    with pytest.raises(ValueError, match=r"'b' has leading dim 3, expected 4"):
        DataProto.from_dict({"a": np.zeros((4, 2)), "b": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"non_tensor_batch key 'uid' has leading dim 5, expected 4"):
        DataProto.from_dict({"a": jnp.zeros((4,))}, {"uid": ["x"] * 5})
    with pytest.raises(ValueError, match="scalar"):
        DataProto.from_dict({"a": np.float32(1.0)})
    with pytest.raises(TypeError, match="non_tensor_batch"):
        DataProto.from_dict({"a": np.array(["x", "y"], dtype=object)})
    with pytest.raises(TypeError, match="non_tensor_batch key 'n'"):
        DataProto.from_dict(non_tensors={"n": 3})
    with pytest.raises(TypeError, match="meta_info"):
        DataProto(meta_info=[1])
    d = _make()
    d.batch["bad"] = np.zeros(B + 1)  # mutation after construction is caught by the explicit check
    with pytest.raises(ValueError, match=r"'bad' has leading dim 7, expected 6"):
        d.check_consistency()


def test_empty_and_repr():
    d = DataProto()
    assert len(d) == 0 and list(d) == []
    r = repr(_make("jax"))
    assert "len=6" in r and "ids: jax.int32[6, 3]" in r and "uid: np.object[6]" in r
    assert "temperature" in r


# ------------------------------------------------------------------ indexing


@backends
def test_int_index_returns_item(backend):
    d = _make(backend)
    item = d[2]
    assert isinstance(item, DataProtoItem)
    np.testing.assert_array_equal(np.asarray(item.batch["ids"]), [6, 7, 8])
    assert isinstance(item.batch["ids"], jax.Array if backend == "jax" else np.ndarray)
    assert item.non_tensor_batch["uid"] == "u2"
    assert item.non_tensor_batch["msgs"] == [{"role": "user", "content": "2"}]
    assert item.meta_info == {"temperature": 0.7}
    assert d[-1].non_tensor_batch["uid"] == "u5"
    assert d[np.int64(1)].non_tensor_batch["uid"] == "u1"
    with pytest.raises(IndexError):
        d[B]
    with pytest.raises(IndexError):
        d[-B - 1]
    with pytest.raises(TypeError):
        d[True]
    with pytest.raises(TypeError):
        d["ids"]
    assert [it.non_tensor_batch["uid"] for it in d] == [f"u{i}" for i in range(B)]


@backends
def test_slice_and_index_arrays(backend):
    d = _make(backend)
    _assert_rows(d[1:4], [1, 2, 3], backend)
    _assert_rows(d[::2], [0, 2, 4], backend)
    _assert_rows(d[[4, 0, 0, -1]], [4, 0, 0, 5], backend)
    _assert_rows(d[np.array([3, 1])], [3, 1], backend)
    _assert_rows(d[jnp.array([2, 5])], [2, 5], backend)
    mask = np.array([True, False, True, True, False, False])
    _assert_rows(d[mask], [0, 2, 3], backend)
    _assert_rows(d[jnp.asarray(mask)], [0, 2, 3], backend)
    _assert_rows(d[[]], [], backend)
    assert d[1:4].meta_info == d.meta_info
    # jax would silently clamp an out-of-range gather; DataProto must refuse it
    with pytest.raises(IndexError, match="out of bounds"):
        d[np.array([0, B])]
    with pytest.raises(IndexError, match="boolean mask"):
        d[np.array([True, False])]
    with pytest.raises(IndexError, match="1-D"):
        d[np.zeros((2, 2), np.int64)]
    with pytest.raises(IndexError, match="dtype"):
        d[np.array([0.5])]


def test_jax_only_out_of_range_index_raises():
    # with no numpy arrays present nothing else would notice: a jax gather clamps to the last row
    d = DataProto.from_dict({"x": jnp.arange(4)})
    with pytest.raises(IndexError, match="index 4 is out of bounds"):
        d[jnp.array([1, 4])]
    with pytest.raises(IndexError, match="index -5 is out of bounds"):
        d[[-5]]
    with pytest.raises(IndexError):
        d.reorder(np.array([0, 1, 2, 7]))
    np.testing.assert_array_equal(np.asarray(d[[-1, -4]].batch["x"]), [3, 0])


# ------------------------------------------------------------------ key operations


@backends
def test_select(backend):
    d = _make(backend)
    s = d.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"])
    assert set(s.batch) == {"ids"} and set(s.non_tensor_batch) == {"uid"}
    assert s.batch["ids"] is d.batch["ids"]
    assert s.meta_info == {"temperature": 0.7}
    s_all = d.select()
    assert set(s_all.batch) == set(d.batch) and set(s_all.non_tensor_batch) == set(d.non_tensor_batch)
    assert d.select(meta_info_keys=[]).meta_info == {}
    assert set(d.select(batch_keys="score", non_tensor_batch_keys=[]).batch) == {"score"}
    with pytest.raises(KeyError, match="nope"):
        d.select(batch_keys=["nope"])
    # deepcopy: object elements and numpy arrays are not shared
    c = d.select(deepcopy=True)
    c.non_tensor_batch["extra"][0]["i"] = 99
    assert d.non_tensor_batch["extra"][0]["i"] == 0
    if backend == "np":
        c.batch["ids"][0, 0] = -1
        assert d.batch["ids"][0, 0] == 0
    # the jit boundary: select(...).batch is a plain dict pytree
    out = jax.jit(lambda b: b["ids"].sum(axis=1))(d.select(["ids"]).batch)
    np.testing.assert_array_equal(np.asarray(out), _ids(d).sum(axis=1))


def test_pop():
    d = _make()
    p = d.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert set(p.batch) == {"score"} and set(p.non_tensor_batch) == {"uid"}
    assert p.meta_info == {"temperature": 0.7}
    assert "score" not in d.batch and "uid" not in d.non_tensor_batch and d.meta_info == {}
    assert len(p) == B and len(d) == B
    with pytest.raises(KeyError):
        d.pop(batch_keys=["ids", "score"])
    assert "ids" in d.batch  # a failed pop removes nothing
    assert len(d.pop()) == 0


def test_rename():
    d = _make()
    ids = d.batch["ids"]
    assert d.rename("ids", "input_ids") is d
    assert d.batch["input_ids"] is ids and "ids" not in d
    d.rename(["uid", "score"], ["index", "acc"])
    assert "index" in d.non_tensor_batch and "acc" in d.batch
    with pytest.raises(KeyError):
        d.rename("missing", "x")
    with pytest.raises(ValueError, match="already exists"):
        d.rename("acc", "input_ids")
    with pytest.raises(ValueError):
        d.rename(["a", "b"], ["c"])


@backends
def test_union(backend):
    d = _make(backend)
    extra = DataProto.from_dict(
        {"adv": np.ones(B, np.float32), "ids": np.asarray(d.batch["ids"]).copy()},  # equal values: ok
        {"uid": np.array([f"u{i}" for i in range(B)], dtype=object)},
        {"temperature": 0.7, "step": 3},
    )
    out = d.union(extra)
    assert out is d
    assert set(d.batch) == {"ids", "score", "adv"} and d.meta_info == {"temperature": 0.7, "step": 3}
    with pytest.raises(ValueError, match=r"batch key 'ids'"):
        d.union(DataProto.from_dict({"ids": np.zeros((B, 3), np.int32)}))
    with pytest.raises(ValueError, match=r"non_tensor_batch key 'extra'"):
        d.union(DataProto.from_dict(non_tensors={"extra": [{"i": -1}] * B}))
    with pytest.raises(ValueError, match=r"meta_info key 'temperature'"):
        d.union(DataProto(meta_info={"temperature": 1.0}))
    with pytest.raises(ValueError, match="batch sizes differ"):
        d.union(DataProto.from_dict({"z": np.zeros(B + 1)}))
    assert "z" not in d.batch
    # NaN equals NaN when the same values are merged again
    nan = DataProto.from_dict({"v": np.array([np.nan, 1.0] * 3)})
    nan.union(DataProto.from_dict({"v": np.array([np.nan, 1.0] * 3)}))
    # meta-only DataProto merges with any length
    assert d.union(DataProto(meta_info={"k": 1})).meta_info["k"] == 1


# ------------------------------------------------------------------ row operations


@backends
def test_chunk_split_concat_roundtrip(backend):
    d = _make(backend)
    chunks = d.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    for i, c in enumerate(chunks):
        _assert_rows(c, [2 * i, 2 * i + 1], backend)
    _assert_rows(DataProto.concat(chunks), range(B), backend)
    assert DataProto.concat(chunks).meta_info == {"temperature": 0.7}
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by chunks=4"):
        d.chunk(4)
    with pytest.raises(ValueError):
        d.chunk(0)
    parts = d.split(4)
    assert [len(p) for p in parts] == [4, 2]
    _assert_rows(parts[1], [4, 5], backend)
    _assert_rows(DataProto.concat(parts), range(B), backend)
    assert [len(p) for p in d.split(6)] == [6]
    with pytest.raises(ValueError):
        d.split(0)


def test_concat_mixed_and_errors():
    a, b = _make("np", 2), _make("jax", 3)
    c = DataProto.concat([a, b])
    assert isinstance(c.batch["ids"], jax.Array) and len(c) == 5
    np.testing.assert_array_equal(np.asarray(c.batch["ids"]), np.concatenate([_ids(a), _ids(b)]))
    assert c.non_tensor_batch["msgs"].shape == (5,)
    with pytest.raises(ValueError, match="empty"):
        DataProto.concat([])
    with pytest.raises(ValueError, match=r"item 1 has batch keys \['ids'\]"):
        DataProto.concat([a, a.select(batch_keys=["ids"])])
    with pytest.raises(ValueError, match="non_tensor_batch keys"):
        DataProto.concat([a, a.select(non_tensor_batch_keys=["uid"])])
    wide = DataProto.from_dict(
        {"ids": np.zeros((1, 4), np.int32), "score": np.zeros(1, np.float32)},
        {k: a.non_tensor_batch[k][:1] for k in a.non_tensor_batch},
    )
    with pytest.raises(ValueError, match=r"'ids' has trailing shape \(3,\) in item 0 but \(4,\) in item 1"):
        DataProto.concat([a, wide])
    other_t = a.select()
    other_t.meta_info["temperature"] = 1.0
    with pytest.raises(ValueError, match="temperature"):
        DataProto.concat([a, other_t])
    # metrics dicts are gathered per item rather than compared
    x, y = a.select(), a.select()
    x.meta_info["metrics"] = {"loss": 1.0}
    y.meta_info["metrics"] = {"loss": 2.0}
    assert DataProto.concat([x, y]).meta_info["metrics"] == {"loss": [1.0, 2.0]}


@backends
@pytest.mark.parametrize("times", [1, 3])
def test_repeat_matches_numpy(backend, times):
    d = _make(backend)
    r = d.repeat(times, interleave=True)
    _assert_rows(r, np.repeat(np.arange(B), times), backend)
    np.testing.assert_array_equal(_ids(r), np.repeat(_make().batch["ids"], times, axis=0))
    t = d.repeat(repeat_times=times, interleave=False)
    _assert_rows(t, np.tile(np.arange(B), times), backend)
    np.testing.assert_array_equal(_ids(t), np.tile(_make().batch["ids"], (times, 1)))
    assert r.meta_info == d.meta_info
    with pytest.raises(ValueError):
        d.repeat(0)


def test_repeat_small_hand_case():
    d = DataProto.from_dict({"x": np.array([10, 20])}, {"s": ["a", "b"]})
    assert d.repeat(2).batch["x"].tolist() == [10, 10, 20, 20]
    assert list(d.repeat(2).non_tensor_batch["s"]) == ["a", "a", "b", "b"]
    assert d.repeat(2, interleave=False).batch["x"].tolist() == [10, 20, 10, 20]


@backends
def test_reorder_in_place(backend):
    d = _make(backend)
    perm = np.array([5, 3, 1, 0, 2, 4])
    assert d.reorder(perm) is None
    _assert_rows(d, perm, backend)
    d.reorder(jnp.argsort(jnp.asarray(perm)))  # inverse permutation restores the order
    _assert_rows(d, range(B), backend)
    with pytest.raises(IndexError):
        d.reorder([0, 99])


@backends
@pytest.mark.parametrize("divisor,pad", [(4, 2), (3, 0), (8, 2), (16, 10), (1, 0)])
def test_pad_unpad_roundtrip(backend, divisor, pad):
    d = _make(backend)
    padded, pad_size = pad_to_divisor(d, divisor)
    assert pad_size == pad and len(padded) % divisor == 0 and len(padded) == B + pad
    # padding repeats rows from the start, wrapping around (verl pad_dataproto_to_divisor)
    _assert_rows(padded, np.arange(B + pad) % B, backend)
    back = unpad(padded, pad_size)
    _assert_rows(back, range(B), backend)
    assert back.meta_info == d.meta_info
    # verl names and method forms are the same operation
    p2, s2 = pad_dataproto_to_divisor(d, divisor)
    np.testing.assert_array_equal(_ids(p2), _ids(padded))
    p3, s3 = d.pad_to_divisor(divisor)
    assert s2 == s3 == pad
    _assert_rows(unpad_dataproto(p3, s3), range(B), backend)
    _assert_rows(p3.unpad(s3), range(B), backend)


def test_pad_errors_and_small_batch():
    d = _make("np", 1)
    padded, pad = pad_to_divisor(d, 4)
    assert pad == 3 and list(padded.non_tensor_batch["uid"]) == ["u0"] * 4
    with pytest.raises(ValueError):
        pad_to_divisor(d, 0)
    with pytest.raises(ValueError):
        unpad(d, 2)
    assert pad_to_divisor(DataProto(), 4)[1] == 0


# ------------------------------------------------------------------ host/device, pickling


def test_to_numpy_and_device_put():
    d = _make("jax")
    n = d.to_numpy()
    _assert_rows(n, range(B), "np")
    assert isinstance(d.batch["ids"], jax.Array)  # original untouched
    back = n.device_put()
    _assert_rows(back, range(B), "jax")
    dev = jax.devices()[0]
    on_dev = n.device_put(dev)
    assert on_dev.batch["ids"].devices() == {dev}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sh = n.device_put(sharding)
    assert sh.batch["ids"].sharding == sharding and sh.batch["score"].sharding == sharding
    part = n.device_put({"ids": sharding})
    assert part.batch["ids"].sharding == sharding and isinstance(part.batch["score"], jax.Array)
    assert sh.non_tensor_batch["uid"] is n.non_tensor_batch["uid"]


@backends
def test_pickle_roundtrip(backend):
    d = _make(backend)
    state = d.__getstate__()
    assert all(isinstance(v, np.ndarray) for v in state["batch"].values())
    e = pickle.loads(pickle.dumps(d))
    _assert_rows(e, range(B), backend)
    assert e.meta_info == d.meta_info
