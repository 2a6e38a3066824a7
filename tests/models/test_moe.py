"""Mixture of experts (issue 58), the model: Qwen3-MoE parity with transformers (logits, loss with the
load-balancing term, every parameter gradient, greedy generation, export), grouped-matmul dispatch against a
per-expert loop, checkpoint stacking, presets and config fields, LoRA. Routing replay and training:
tests/models/test_moe_replay.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models import ModelConfig, save_pretrained
from jaxrl_post.models.hf_io import load_hf_dir, param_map
from jaxrl_post.models.moe import MoE, experts_key, load_balancing_loss
from jaxrl_post.rollout.generate import generate_sequences
from jaxrl_post.rollout.sampling import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HF_BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    router_aux_loss_coef=0.5,
)
CASES = {
    "topk_norm_mlp_only": HF_BASE,
    "no_norm_sparse_step": dict(HF_BASE, norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2, top=3),
}


def _hf_model(kw, seed=0):
    kw = dict(kw)
    if "top" in kw:
        kw["num_experts_per_tok"] = kw.pop("top")
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # O(1) logits and a router that spreads tokens over the experts
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def _batch(vocab, b=3, t=10, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    return ids, mask


def _label_valid(mask):
    """Token t is a label iff it and the token before it are real (a padded position predicts nothing)."""
    valid = mask.astype(bool).copy()
    valid[:, 1:] &= mask[:, :-1].astype(bool)
    valid[:, 0] = False
    return valid


def _hf_grads(hf, ids, mask):
    """transformers' loss (mean next-token CE + coef * aux loss), logits, aux loss and every param gradient,
    keyed by our HF-side names (the fused `gate_up_proj` split into the gate / up stacks)."""
    labels = np.where(_label_valid(mask), ids, -100)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    hf.zero_grad()
    out = hf(
        input_ids=torch.tensor(ids, dtype=torch.long),
        attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(pos),
        labels=torch.tensor(labels, dtype=torch.long),
        output_router_logits=True,
    )
    out.loss.backward()
    grads = {}
    for name, p in hf.named_parameters():
        g = p.grad.numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = int(name.split(".")[2])
            grads[experts_key(layer, "gate_proj")], grads[experts_key(layer, "up_proj")] = np.split(g, 2, axis=1)
        else:
            grads[name] = g
    return float(out.loss.detach()), out.logits.detach().numpy(), float(out.aux_loss.detach()), grads


def _our_loss(model, ids, mask, valid):
    logits, moe = model(ids, mask, with_moe=True)
    labels, valid = ids[:, 1:], valid[:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    aux = load_balancing_loss(moe)
    return jnp.sum(nll * valid) / jnp.sum(valid) + model.config.router_aux_loss_coef * aux, (logits, aux)


@jax.jit
def _loss_and_grads(model, ids, mask, valid):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        return _our_loss(nnx.merge(graphdef, p, rest), ids, mask, valid)

    (loss, (logits, aux)), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, logits, aux, grads


def _close(got, ref, tol, what):
    scale = max(1.0, float(np.abs(ref).max()))
    diff = float(np.abs(np.asarray(got) - ref).max())
    assert diff <= tol * scale, f"{what}: max abs diff {diff} > {tol} * {scale}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_qwen3_moe_logits_loss_and_every_gradient_match_transformers(case, tmp_path):
    """Loaded from transformers' own save_pretrained (per-expert tensors): logits, the aux loss, the training
    loss (CE + router_aux_loss_coef * aux) and the gradient of every parameter equal transformers' within
    1e-5 (relative to max(1, |ref|)) in float32; the router's gradient is among them and non-zero."""
    hf = _hf_model(CASES[case])
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    cfg = model.config
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 8
    assert [type(b.mlp).__name__ for b in model.layers] == ["MoE" if cfg.is_moe_layer(i) else "MLP" for i in range(3)]
    assert sum(isinstance(b.mlp, MoE) for b in model.layers) == (2 if case == "topk_norm_mlp_only" else 1)
    ids, mask = _batch(cfg.vocab_size)
    ref_loss, ref_logits, ref_aux, ref_grads = _hf_grads(hf, ids, mask)
    loss, logits, aux, grads = _loss_and_grads(model, jnp.asarray(ids), jnp.asarray(mask), _label_valid(mask))
    valid = mask.astype(bool)
    _close(np.asarray(logits)[valid], ref_logits[valid], 1e-5, "logits")
    _close(aux, ref_aux, 1e-5, "aux loss")
    _close(loss, ref_loss, 1e-5, "loss")
    assert ref_aux > 1.0  # E * sum f P >= 1 (k counts per token): a real, unbalanced value
    ours = {}
    for name, (path, _, to_hf) in param_map(cfg).items():
        g = grads
        for p in path:
            g = g[p]
        ours[name] = np.asarray(to_hf(g[...]))
    assert set(ours) == set(ref_grads) - {"lm_head.weight"} | ({"lm_head.weight"} & set(ours))
    for name, ref in ref_grads.items():
        assert ours[name].shape == ref.shape, name
        _close(ours[name], ref, 1e-5, f"grad {name}")
    router = [n for n in ours if n.endswith("mlp.gate.weight")]
    assert router and all(np.abs(ours[n]).max() > 1e-4 for n in router)


@pytest.mark.slow
def test_qwen3_moe_greedy_generation_matches_transformers(tmp_path):
    _assert_greedy_matches_transformers(_hf_model(HF_BASE, seed=1), HF_BASE["vocab_size"], tmp_path)


def _assert_greedy_matches_transformers(hf, vocab_size: int, tmp_path):
    """12 greedy tokens of `hf` (saved to `tmp_path`, loaded here) equal transformers' `generate`."""
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    ids, mask = _batch(vocab_size, b=3, t=8, seed=2)
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            pad_token_id=0,
            eos_token_id=None,
        ).numpy()[:, ids.shape[1] :]
    out = generate_sequences(
        model,
        DataProto.from_dict({"input_ids": ids, "attention_mask": mask}),
        SamplingParams(max_new_tokens=12, do_sample=False),
    )
    np.testing.assert_array_equal(out.batch["responses"], ref)


def _tiny_cfg(**kw):
    base = dict(
        family="qwen3_moe",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
    )
    return ModelConfig(**{**base, **kw})


def _random_model(cfg, seed=0, dtype="float32"):
    """numpy-random O(1) weights loaded through the HF-name loader (stacked expert names included)."""
    from jaxrl_post.models.hf_io import _get_variable, empty_model, load_state_dict_into

    rng = np.random.RandomState(seed)
    model = empty_model(cfg, dtype=dtype, param_dtype="float32")
    tensors = []
    for name, (path, _, to_hf) in param_map(cfg).items():
        w = rng.randn(*_get_variable(model, path).shape).astype(np.float32)
        tensors.append((name, to_hf(1.0 + 0.1 * w if name.endswith("norm.weight") else 0.3 * w)))
    return load_state_dict_into(model, tensors)


def test_qwen3_moe_export_loads_in_transformers_with_equal_logits(tmp_path):
    """save_pretrained writes HF's per-expert tensors and a qwen3_moe config.json; transformers loads them with
    equal logits, and our loader reads them back to the same model (bitwise logits)."""
    cfg = _tiny_cfg(num_layers=3, mlp_only_layers=(1,), bos_token_id=1, eos_token_id=2)
    model = _random_model(cfg, seed=5)
    save_pretrained(model, None, tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == "qwen3_moe" and hf_cfg["num_experts"] == 4 and hf_cfg["mlp_only_layers"] == [1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids, mask = _batch(cfg.vocab_size, b=3, t=7)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    ours = np.asarray(_forward(model, ids, mask))
    valid = mask.astype(bool)
    _close(ours[valid], ref.logits.numpy()[valid], 1e-5, "logits")
    again = load_hf_dir(tmp_path)
    assert again.config == model.config
    np.testing.assert_array_equal(np.asarray(_forward(again, ids, mask)), ours)


_forward = jax.jit(lambda model, ids, mask: model(ids, mask))


def test_loader_stacks_experts_and_reports_a_missing_one(tmp_path):
    from jaxrl_post.models.hf_io import empty_model, iter_safetensors, load_state_dict_into

    cfg = _tiny_cfg()
    save_pretrained(_random_model(cfg, seed=1), None, tmp_path)
    names = [n for n, _ in iter_safetensors(str(tmp_path))]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    tensors = [(n, a) for n, a in iter_safetensors(str(tmp_path)) if n != "model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.up_proj \(3 of 4 experts\)"):
        load_state_dict_into(empty_model(cfg), tensors)


def test_grouped_matmul_dispatch_equals_per_expert_loop():
    """The ragged_dot dispatch against a numpy loop over tokens and their chosen experts (router softmax, top-k,
    renormalized), with and without forced routes; the statistics against numpy counts."""
    cfg = _tiny_cfg(num_experts=5, num_experts_per_tok=3)
    model = _random_model(cfg, seed=2)
    moe = model.layers[0].mlp
    rng = np.random.RandomState(0)
    x = rng.randn(2, 6, cfg.hidden_size).astype(np.float32)
    token_mask = np.ones((2, 6), bool)
    token_mask[0, :2] = False
    r, g, u, dn = (
        np.asarray(moe.router[...]),
        np.asarray(moe.gate_proj[...]),
        np.asarray(moe.up_proj[...]),
        np.asarray(moe.down_proj[...]),
    )

    def reference(forced=None):
        flat = x.reshape(-1, cfg.hidden_size).astype(np.float64)
        logits = flat @ r
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, :3] if forced is None else forced.reshape(-1, 3)
        y = np.zeros_like(flat)
        for n in range(flat.shape[0]):
            w = p[n, top[n]] / p[n, top[n]].sum()
            for slot, e in enumerate(top[n]):
                h = flat[n] @ g[e]
                y[n] += w[slot] * ((h / (1 + np.exp(-h))) * (flat[n] @ u[e])) @ dn[e]
        return y.reshape(x.shape), top.reshape(2, 6, 3), p

    y, (experts, load, prob_sum, ent, dropped) = moe(jnp.asarray(x), jnp.asarray(token_mask))
    ref, top, p = reference()
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(experts), top)
    assert dropped is None  # dropless (no moe_capacity_factor)
    m = token_mask.reshape(-1)
    np.testing.assert_array_equal(np.asarray(load), np.bincount(top.reshape(-1, 3)[m].ravel(), minlength=5))
    np.testing.assert_allclose(np.asarray(prob_sum), p[m].sum(0), rtol=1e-5)
    np.testing.assert_allclose(float(ent), -(p[m] * np.log(p[m])).sum(), rtol=1e-5)
    forced = rng.randint(0, 5, (2, 6, 3))
    forced[..., 1] = (forced[..., 0] + 1) % 5  # distinct experts per token
    forced[..., 2] = (forced[..., 0] + 2) % 5
    y2, (experts2, *_) = moe(jnp.asarray(x), jnp.asarray(token_mask), jnp.asarray(forced, jnp.uint8))
    np.testing.assert_allclose(np.asarray(y2), reference(forced)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(experts2), forced)


def test_presets_and_config_fields():
    from jaxrl_post.models import PRESETS

    # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated; Qwen3-235B-A22B: 235B / 22B
    for name, total, active in (("qwen3_30b_a3b", 30.5e9, 3.3e9), ("qwen3_235b_a22b", 235e9, 22e9)):
        cfg = PRESETS[name]
        assert abs(cfg.num_params() - total) / total < 0.01, name
        assert abs(cfg.num_params(active=True) - active) / active < 0.03, name
        assert cfg.moe_layers == tuple(range(cfg.num_layers))
    cfg = _tiny_cfg(num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert cfg.moe_layers == (1,)
    abstract = nnx.eval_shape(lambda: __import__("jaxrl_post").models.Transformer(cfg, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract))) == cfg.num_params()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _tiny_cfg(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        _tiny_cfg(family="qwen3").to_hf_config()


def test_lora_on_an_moe_model_adapts_attention_only_and_exports_merged(tmp_path):
    """`apply_lora(all-linear)` on an MoE model puts adapters on q/k/v/o only (stacked experts are no `Linear`);
    a fresh adapter changes nothing, a trained one is merged into the exported attention weights."""
    from jaxrl_post.models.lora import LoRAConfig, apply_lora, iter_projections

    cfg = _tiny_cfg()
    model = _random_model(cfg, seed=9)
    ids, mask = _batch(cfg.vocab_size, b=2, t=5)
    base = np.asarray(_forward(model, ids, mask))
    apply_lora(model, LoRAConfig(rank=2))
    assert sorted({name for *_, name, lin in iter_projections(model) if lin.lora_a is not None}) == [
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    ]
    np.testing.assert_allclose(np.asarray(_forward(model, ids, mask)), base, atol=1e-5)  # B = 0: no change
    q = model.layers[0].attn.q_proj
    q.lora_b.set_value(jnp.full(q.lora_b.shape, 0.1, jnp.float32))
    adapted = np.asarray(_forward(model, ids, mask))
    assert np.abs(adapted - base).max() > 1e-3
    save_pretrained(model, None, tmp_path)
    np.testing.assert_allclose(np.asarray(_forward(load_hf_dir(tmp_path), ids, mask)), adapted, atol=1e-5)
