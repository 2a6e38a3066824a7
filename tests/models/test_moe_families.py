"""Mixture-of-experts families beyond Qwen3-MoE (issue 58 item 1): Mixtral and Qwen2-MoE parity with transformers
(logits, loss with the load-balancing term, every parameter gradient, greedy generation, export back into
transformers), their config mapping; and the capacity factor (items 2/3) against a numpy reference. The helpers
are test_moe.py's (the Qwen3-MoE parity tests)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models import ModelConfig, save_pretrained
from jaxrl_post.models.hf_io import load_hf_dir, param_map
from jaxrl_post.models.moe import capacity_keep, collect, router_metrics
from tests.models.test_moe import (
    _assert_greedy_matches_transformers,
    _batch,
    _close,
    _forward,
    _hf_grads,
    _label_valid,
    _loss_and_grads,
    _random_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
HF_CASES = {  # (transformers config class, kwargs, our family)
    "mixtral": (
        "MixtralConfig",
        dict(
            SHAPE, intermediate_size=32, num_hidden_layers=2, head_dim=16, num_local_experts=6, router_aux_loss_coef=0.5
        ),
        "mixtral",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            SHAPE,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            router_aux_loss_coef=0.5,
        ),
        "qwen2_moe",
    ),
}


def _hf_model(case, seed=0):
    cls, kw, _ = HF_CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls)(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # O(1) logits and a router that spreads tokens over the experts
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.slow
def test_family_logits_loss_and_every_gradient_match_transformers(case, tmp_path):
    """Loaded from transformers' save_pretrained (Mixtral: `block_sparse_moe.experts.<j>.w1/w2/w3`; Qwen2-MoE: the
    shared expert, its gate, qkv biases): parameter count, logits, aux loss, loss and every parameter's gradient
    equal transformers' within 1e-5 (relative to max(1, |ref|)) in float32; router and shared-gate gradients
    are non-zero."""
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    cfg = model.config
    assert cfg.family == HF_CASES[case][2]
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    want = ["MoE", "MoE"] if case == "mixtral" else ["MoE", "MLP", "MoE"]
    assert [type(b.mlp).__name__ for b in model.layers] == want
    ids, mask = _batch(cfg.vocab_size)
    ref_loss, ref_logits, ref_aux, ref_grads = _hf_grads(hf, ids, mask)
    loss, logits, aux, grads = _loss_and_grads(model, jnp.asarray(ids), jnp.asarray(mask), _label_valid(mask))
    valid = mask.astype(bool)
    _close(np.asarray(logits)[valid], ref_logits[valid], 1e-5, "logits")
    _close(aux, ref_aux, 1e-5, "aux loss")
    _close(loss, ref_loss, 1e-5, "loss")
    assert ref_aux > 1.0
    ours = {}
    for name, (path, _, to_hf) in param_map(cfg).items():
        g = grads
        for p in path:
            g = g[p]
        ours[name] = np.asarray(to_hf(g[...]))
    assert set(ours) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ours[name].shape == ref.shape, name
        _close(ours[name], ref, 1e-5, f"grad {name}")
    gates = [n for n in ours if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))]
    assert len(gates) == (2 if case == "mixtral" else 4) and all(np.abs(ours[n]).max() > 1e-4 for n in gates)


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.slow
def test_family_greedy_generation_matches_transformers(case, tmp_path):
    _assert_greedy_matches_transformers(_hf_model(case, seed=1), SHAPE["vocab_size"], tmp_path)


def _tiny(family, **kw):
    base = dict(
        family=family,
        vocab_size=61,
        hidden_size=32,
        intermediate_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen2_moe":
        base.update(qkv_bias=True, shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=(0,))
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_family_export_loads_in_transformers_with_equal_logits(family, tmp_path):
    """save_pretrained writes the family's hub names and config.json; transformers loads the directory into the
    family's class with equal logits, and our loader reads it back to the same config and bitwise logits."""
    model = _random_model(_tiny(family), seed=5)
    save_pretrained(model, None, tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    if family == "mixtral":
        assert hf_cfg["num_local_experts"] == 4 and hf_cfg["intermediate_size"] == 16
        assert {
            "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "model.layers.0.block_sparse_moe.experts.0.w3.weight",
        } <= names
        assert not any(".mlp." in n for n in names)
    else:
        assert hf_cfg["shared_expert_intermediate_size"] == 24 and hf_cfg["qkv_bias"] is True
        assert {"model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.experts.3.up_proj.weight"} <= names
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (
        type(hf).__name__
        == hf_cfg["architectures"][0]
        == ("MixtralForCausalLM", "Qwen2MoeForCausalLM")[family == "qwen2_moe"]
    )
    ids, mask = _batch(61, b=3, t=7)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    ours = np.asarray(_forward(model, ids, mask))
    valid = mask.astype(bool)
    _close(ours[valid], ref.logits.numpy()[valid], 1e-5, "logits")
    again = load_hf_dir(tmp_path)
    assert again.config == model.config
    np.testing.assert_array_equal(np.asarray(_forward(again, ids, mask)), ours)


def test_family_config_fields_and_unsupported_ones():
    from jaxrl_post.models import PRESETS

    # model cards: Mixtral-8x7B 46.7B total / 12.9B active; Qwen1.5-MoE-A2.7B 14.3B / 2.7B
    for name, total, active in (("mixtral_8x7b", 46.7e9, 12.9e9), ("qwen1_5_moe_a2_7b", 14.3e9, 2.7e9)):
        cfg = PRESETS[name]
        assert (
            abs(cfg.num_params() - total) / total < 0.01 and abs(cfg.num_params(active=True) - active) / active < 0.01
        )
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg, name
    mixtral = ModelConfig.from_hf_config(transformers.MixtralConfig(**HF_CASES["mixtral"][1]).to_dict())
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.num_experts_per_tok) == (6, 32, 2)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (0, 1) and not mixtral.qk_norm and not mixtral.qkv_bias
    qwen2 = ModelConfig.from_hf_config(transformers.Qwen2MoeConfig(**HF_CASES["qwen2_moe"][1]).to_dict())
    assert qwen2.qkv_bias and qwen2.shared_expert_intermediate_size == 48 and qwen2.moe_layers == (0, 2)
    for bad, field in (
        (dict(mixtral.to_hf_config(), router_jitter_noise=0.01), "router_jitter_noise"),
        (dict(mixtral.to_hf_config(), sliding_window=16), "sliding_window"),
        (dict(qwen2.to_hf_config(), use_sliding_window=True), "use_sliding_window"),
    ):
        with pytest.raises(NotImplementedError, match=field):
            ModelConfig.from_hf_config(bad)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        mixtral.replace(norm_topk_prob=False).to_hf_config()
    with pytest.raises(ValueError, match="no shared expert"):
        _tiny("qwen3_moe", shared_expert_intermediate_size=8).to_hf_config()
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        _tiny("qwen3_moe", moe_capacity_factor=0.0)


def _keep_reference(experts, mask, num_experts, cf):
    """numpy: per row, each expert takes its first ceil(cf * T * k / E) assignments, valid tokens first, then by
    position, then by slot."""
    b, t, k = experts.shape
    cap = int(np.ceil(cf * t * k / num_experts))
    keep = np.zeros(experts.shape, bool)
    for r in range(b):
        taken = np.zeros(num_experts, int)
        order = [(n, s) for n in range(t) if mask[r, n] for s in range(k)]
        order += [(n, s) for n in range(t) if not mask[r, n] for s in range(k)]
        for n, s in order:
            e = experts[r, n, s]
            keep[r, n, s] = taken[e] < cap
            taken[e] += 1
    return keep


def test_capacity_factor_drops_against_numpy_reference():
    """`capacity_keep` equals a numpy loop; the MoE layer's output under a capacity factor equals the dropless
    layer's computed with the dropped assignments' weights zeroed (numpy) at factors 1 and 0.5, whose grouped matmuls
    run on only the rows the experts can take; the dropped count and the `dropped_token_fraction` metric count the
    valid tokens' dropped assignments; a large factor drops nothing."""
    rng = np.random.RandomState(3)
    experts = rng.randint(0, 4, (3, 9, 2))
    experts[0, :, 0] = 2  # a hot expert: row 0 sends every token to expert 2
    experts[..., 1] = (experts[..., 0] + 1 + rng.randint(0, 3, (3, 9))) % 4  # k distinct experts per token
    mask = np.ones((3, 9), bool)
    mask[1, :4] = False  # left padding: dropped first
    factors = (0.5, 1.0, 1.25, 2.0)
    kept = jax.jit(lambda e, m: [capacity_keep(e, m, 4, cf) for cf in factors])(experts, mask)
    for cf, got in zip(factors, kept):
        np.testing.assert_array_equal(np.asarray(got), _keep_reference(experts, mask, 4, cf))
    assert np.asarray(kept[-1]).all()  # C = T * k / 2 >= any expert's load (at most one per token)

    x = rng.randn(3, 9, 32).astype(np.float32)
    run = jax.jit(lambda lay, x, m: lay(x, m))
    for cf in (1.0, 0.5):
        cfg = _tiny("qwen2_moe", moe_capacity_factor=cf, mlp_only_layers=())
        _check_capacity_layer(cfg, x, mask, run)
    cfg = _tiny("qwen2_moe", moe_capacity_factor=1.0, mlp_only_layers=())
    _, stats0 = run(_random_model(cfg.replace(moe_capacity_factor=None), seed=2).layers[0].mlp, x, mask)
    assert stats0[4] is None and not any("dropped" in k for k in router_metrics(collect([stats0], mask, 4)))


def _check_capacity_layer(cfg, x, mask, run):
    """The MoE layer of `cfg` (a capacity factor) against numpy, and its grouped matmuls' static rows:
    `min(B * T * k, B * E * C)` (fewer than B * T * k below a factor of 1: the compute a capacity factor saves)."""
    layer = _random_model(cfg, seed=2).layers[0].mlp
    assert x.shape[-1] == cfg.hidden_size
    rows = {
        tuple(e.invars[0].aval.shape)
        for e in jax.make_jaxpr(lambda lay, x, m: lay(x, m))(layer, jnp.asarray(x), jnp.asarray(mask)).eqns
        for e in _walk(e)
        if "ragged_dot" in e.primitive.name
    }
    cap = math.ceil(cfg.moe_capacity_factor * 9 * 2 / 4)  # per row and expert
    assert {r[0] for r in rows} == {min(3 * 9 * 2, 3 * 4 * cap)}, rows
    y, stats = run(layer, jnp.asarray(x), jnp.asarray(mask))
    # numpy: softmax router, top-2 (not renormalized: qwen2_moe default), capacity, SwiGLU experts, shared expert
    r, g, u, dn = (
        np.asarray(getattr(layer, n)[...], np.float64) for n in ("router", "gate_proj", "up_proj", "down_proj")
    )
    xf = x.reshape(27, -1).astype(np.float64)
    logits = xf @ r
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.asarray(stats[0]).reshape(27, 2), top)
    keep = _keep_reference(top.reshape(3, 9, 2), mask, 4, cfg.moe_capacity_factor).reshape(27, 2)
    silu = lambda h: h / (1 + np.exp(-h))
    ref = np.zeros_like(xf)
    for n in range(27):
        for slot, e in enumerate(top[n]):
            if keep[n, slot]:
                ref[n] += p[n, e] * (silu(xf[n] @ g[e]) * (xf[n] @ u[e])) @ dn[e]
    sh = layer.shared_expert
    sg, su, sd = (np.asarray(getattr(sh, n).kernel[...], np.float64) for n in ("gate_proj", "up_proj", "down_proj"))
    gate = 1 / (1 + np.exp(-(xf @ np.asarray(layer.shared_expert_gate[...], np.float64))))
    ref += gate * ((silu(xf @ sg) * (xf @ su)) @ sd)
    np.testing.assert_allclose(np.asarray(y).reshape(27, -1), ref, rtol=1e-5, atol=1e-5)
    n_dropped = (~keep & mask.reshape(27, 1)).sum()
    assert 0 < n_dropped < mask.sum() * 2 and float(stats[4]) == n_dropped
    m = router_metrics(collect([stats, stats], jnp.asarray(mask), 4))
    assert float(m["actor/moe/layer_1/dropped_token_fraction"]) == pytest.approx(n_dropped / (2 * mask.sum()))
    # gradients: the grouped matmuls on the kept rows == a dense per-expert jnp layer with the same kept routes
    cot = jnp.asarray(np.random.RandomState(5).randn(3, 9, 32).astype(np.float32))

    def dense(w, xj):
        probs = jax.nn.softmax(xj.reshape(27, -1) @ w["router"], axis=-1)
        pk = jnp.take_along_axis(probs, jnp.asarray(top), axis=-1) * jnp.asarray(keep)
        out = jnp.zeros((27, 32))
        for e in range(4):
            h = jax.nn.silu(xj.reshape(27, -1) @ w["gate_proj"][e]) * (xj.reshape(27, -1) @ w["up_proj"][e])
            out = out + jnp.sum(jnp.where(jnp.asarray(top) == e, pk, 0.0), -1, keepdims=True) * (h @ w["down_proj"][e])
        return jnp.sum(out * cot.reshape(27, -1))

    names = ("router", "gate_proj", "up_proj", "down_proj")
    w0 = {n: getattr(layer, n)[...] for n in names}
    gdef, state = nnx.split(layer)

    def ours(st, xj):
        lay = nnx.merge(gdef, st)
        y, _ = lay(xj, jnp.asarray(mask))
        g = jax.nn.sigmoid(jnp.einsum("BTD,DO->BTO", xj, lay.shared_expert_gate[...]))
        return jnp.sum((y.astype(jnp.float32) - g * lay.shared_expert(xj).astype(jnp.float32)) * cot)

    g_state, g_x = jax.grad(ours, argnums=(0, 1))(state, jnp.asarray(x))
    got = ({n: g_state[n][...] for n in names}, g_x)
    want = jax.grad(dense, argnums=(0, 1))(w0, jnp.asarray(x))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _walk(eqn):
    """`eqn` and every equation of the jaxprs nested in it (pjit, custom_vjp, ...)."""
    yield eqn
    for v in eqn.params.values():
        for sub in v if isinstance(v, (list, tuple)) else [v]:
            jaxpr = getattr(sub, "jaxpr", sub)
            for e in getattr(jaxpr, "eqns", []):
                yield from _walk(e)
