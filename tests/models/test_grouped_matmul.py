"""The MoE grouped matmul's implementations (issue 58): the Pallas megablox `gmm` (TPU kernel, run here in Pallas
interpret mode) equals `jax.lax.ragged_dot` and a numpy per-group loop, forward and gradients (lhs and weights), with
empty groups, uneven groups, rows after the last group and a row count that is no multiple of the tile; a tiny MoE
layer's output and every gradient under 'megablox' equal 'ragged_dot' (float32); an MoE layer's forward + backward
lowers for TPU with the three megablox kernels in the program; `model.moe_impl` resolves by platform and refuses
'megablox' off TPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.errors import Checker, ConfigError
from jaxrl_post.models import ModelConfig
from jaxrl_post.models.config_checks import check_model
from jaxrl_post.models.grouped_matmul import gmm_tiling, grouped_matmul, resolve_moe_impl
from jaxrl_post.models.layers import ParamInit
from jaxrl_post.models.moe import MoE, set_moe_impl


def _numpy_gmm(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = lhs[start : start + n].astype(np.float64) @ rhs[g]
        start += n
    return out


def test_megablox_equals_ragged_dot_and_numpy_forward_and_gradients():
    """37 rows (tiles of 16: padded to 48), K 40 / N 24 with tiles of 16 (remainders masked by the kernel), groups
    [5, 0, 11, 0, 13, 0] (empty groups, uneven sizes, 8 rows after the last group, which give 0)."""
    rng = np.random.default_rng(0)
    m, k, n, sizes = 37, 40, 24, np.array([5, 0, 11, 0, 13, 0], np.int32)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    cot = rng.standard_normal((m, n)).astype(np.float32)  # the loss is sum(out * cot)
    assert gmm_tiling(m, k, n, (16, 16, 16)) == (16, 16, 40, 24)  # remainders: masked by the kernel
    assert gmm_tiling(5, 40, 200) == (16, 128, 128, 200)  # K padded up to the tile (a Mosaic block's 128 lanes)

    def loss_and_grads(impl):
        def loss(a, b):
            out = grouped_matmul(a, b, jnp.asarray(sizes), impl=impl, tiling=(16, 16, 16), interpret=True)
            return jnp.sum(out * cot), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)
        return np.asarray(out), *map(np.asarray, grads)

    out, d_lhs, d_rhs = loss_and_grads("megablox")
    ref_out, ref_lhs, ref_rhs = loss_and_grads("ragged_dot")
    want = _numpy_gmm(lhs, rhs, sizes)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    assert not out[29:].any()  # rows after the last group
    # d lhs of rows in group g: cot @ rhs[g].T; d rhs[g]: lhs_g.T @ cot_g (0 for an empty group)
    want_lhs, want_rhs, start = np.zeros_like(lhs), np.zeros_like(rhs), 0
    for g, s in enumerate(sizes):
        want_lhs[start : start + s] = cot[start : start + s] @ rhs[g].T
        want_rhs[g] = lhs[start : start + s].T @ cot[start : start + s]
        start += s
    for got, ref, exact in ((d_lhs, ref_lhs, want_lhs), (d_rhs, ref_rhs, want_rhs)):
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def _moe_layer(e=6, k=2, d=32, f=24):
    cfg = ModelConfig(
        family="qwen3_moe", hidden_size=d, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=e,
        num_experts_per_tok=k, moe_intermediate_size=f, norm_topk_prob=True,
    )  # fmt: skip
    moe = MoE(cfg, dtype=jnp.float32, init=ParamInit(jax.random.key(0), jnp.float32))
    rng = np.random.default_rng(1)  # O(1) weights: a router that spreads the tokens, outputs of order 1
    for name, scale in (("router", 1.0), ("gate_proj", 0.3), ("up_proj", 0.3), ("down_proj", 0.3)):
        p = getattr(moe, name)
        p[...] = jnp.asarray(scale * rng.standard_normal(p[...].shape), jnp.float32)
    return moe


@pytest.mark.parametrize("forced", [True, pytest.param(False, marks=pytest.mark.slow)])  # 6-11 s each, 2 loaded cores
def test_moe_layer_under_megablox_equals_ragged_dot_with_every_gradient(forced):
    """A 6-expert top-2 layer on 2 x 7 tokens (14 rows x 2 = 28 assignments: one 16-row tile plus a padded one).
    forced: routes that leave experts 1 and 4 empty and give the others 2 to 12 rows."""
    moe = _moe_layer()
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 7, 32)), jnp.float32)
    mask = jnp.ones((2, 7), bool)
    routes = None
    if forced:
        pairs = np.array([[0, 2]] * 9 + [[3, 0]] * 3 + [[5, 2]] * 2)  # loads 12, 0, 11, 3, 0, 2
        routes = jnp.asarray(rng.permutation(pairs).reshape(2, 7, 2), jnp.int32)

    def run(impl):
        _set_impl(moe, impl)
        graphdef, state = nnx.split(moe)

        def loss(state, x):
            y, (experts, *_) = nnx.merge(graphdef, state)(x, mask, routes)
            return jnp.sum(y * jnp.cos(y)), (y, experts)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        assert ("pallas_call" in str(fn.trace(state, x).jaxpr)) == (impl == "megablox")  # the kernel runs
        (_, (y, experts)), grads = fn(state, x)
        return y, experts, grads

    y_ref, experts, (g_ref, gx_ref) = run("ragged_dot")
    y, _, (g, gx) = run("megablox")
    load = np.bincount(np.asarray(experts).ravel(), minlength=6)
    if forced:
        np.testing.assert_array_equal(load, [12, 0, 11, 3, 0, 2])
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-5, atol=1e-5)
    flat, flat_ref = nnx.to_flat_state(g), dict(nnx.to_flat_state(g_ref))
    assert {p[0] for p, _ in flat} == {"router", "gate_proj", "up_proj", "down_proj"}
    for path, v in flat:
        assert np.abs(np.asarray(v[...])).max() > 0, path
        np.testing.assert_allclose(np.asarray(v[...]), np.asarray(flat_ref[path][...]), rtol=1e-5, atol=1e-5)


def _set_impl(moe, impl, interpret=True):
    """`set_moe_impl` on a one-layer stand-in for a Transformer (it walks `model.layers[i].mlp`)."""
    model = type("M", (), {"layers": [type("B", (), {"mlp": moe})()]})()
    set_moe_impl(model, impl, interpret=interpret)
    assert (moe.impl, moe.interpret) == (impl, interpret)


@pytest.mark.parametrize("d,e,f,k", [(2048, 128, 768, 8), (32, 6, 24, 2)], ids=["qwen3_30b_a3b", "tiny"])
def test_moe_forward_and_backward_lower_for_tpu_with_the_megablox_kernels(d, e, f, k, monkeypatch):
    """One MoE layer at Qwen3-30B-A3B's expert shapes (D 2048, 128 experts of F 768, top-8), and at tiny dims below
    a Mosaic block's 128 lanes (padded up to it), bf16, 512 tokens: the jitted forward + backward (x and every
    weight) lowers for TPU; the program holds megablox's gmm (forward and lhs gradient) and tgmm (weight gradient)
    Mosaic kernels, and no ragged dot. The Mosaic lowering asks the device for its TPU generation: stubbed as a v5p
    (as tests/rollout/test_paged_attention.py)."""
    from jax._src.pallas.mosaic import tpu_info

    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5p")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    cfg = ModelConfig(
        family="qwen3_moe", hidden_size=d, num_heads=4, num_kv_heads=4, head_dim=8, num_experts=e,
        num_experts_per_tok=k, moe_intermediate_size=f, norm_topk_prob=True,
    )  # fmt: skip
    moe = nnx.eval_shape(lambda: MoE(cfg, dtype=jnp.bfloat16, init=ParamInit(jax.random.key(0), jnp.bfloat16)))
    _set_impl(moe, "megablox", interpret=False)
    graphdef, state = nnx.split(moe)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, jnp.ones(x.shape[:2], bool))
        return jnp.sum(y.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((4, 128, d), jnp.bfloat16)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(state, x).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "ragged_dot" not in text
    # forward: gate, up, down; backward: lhs gradient (gmm, transposed weights) and weight gradient (tgmm) of each
    assert len(re.findall(r"call @gmm(_\d+)?\(", text)) == 6
    assert len(re.findall(r"call @tgmm(_\d+)?\(", text)) == 3


def test_moe_impl_resolves_by_platform_and_refuses_megablox_off_tpu():
    from jaxrl_post.rl import builders

    for platform in ("cpu", "gpu", "tpu"):
        assert resolve_moe_impl("auto", platform) == "ragged_dot"  # no TPU measurement yet (module docstring)
        assert resolve_moe_impl("ragged_dot", platform) == "ragged_dot"
    assert resolve_moe_impl("megablox", "tpu") == "megablox"
    assert resolve_moe_impl("megablox", "cpu", interpret=True) == "megablox"
    with pytest.raises(ValueError, match=r"config.model.moe_impl='megablox' is a TPU kernel but the platform is 'cpu'"):
        resolve_moe_impl("megablox", "cpu")
    with pytest.raises(ValueError, match="expected one of"):
        resolve_moe_impl("gmm", "tpu")

    from configs.base import get_base_config

    c = get_base_config()
    model = type("M", (), {"config": ModelConfig(), "layers": []})()
    c.model.moe_impl = "megablox"
    with pytest.raises(ConfigError, match="moe_impl='megablox' is a TPU kernel"):
        builders.apply_moe_impl(c, model, platform="cpu")
    assert builders.apply_moe_impl(c, model, platform="tpu") == "megablox"
    c.model.moe_impl = "auto"
    assert builders.apply_moe_impl(c, model, platform="tpu") == "ragged_dot"
    c.model.moe_impl = "gmm"  # an unknown name: the config check's one line
    checker = Checker(c)
    check_model(checker)
    assert [e for e in checker.errors if "moe_impl" in e] == [
        "config.model.moe_impl='gmm': valid: 'auto', 'ragged_dot', 'megablox'"
    ]
