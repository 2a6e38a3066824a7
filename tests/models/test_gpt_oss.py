"""GPT-OSS (issue 58, `GptOssForCausalLM`): parity with transformers (torch as a test-only reference) in float32 on a
tiny random config that exercises every difference from Qwen3-MoE: router bias, expert biases, the fused interleaved
`gate_up_proj`, the clamped SwiGLU, attention sinks, q/k/v/o biases, alternating sliding / full layers and YaRN rope.
Also the YaRN frequencies against transformers' own function, the gpt-oss-20b preset's counts against the model card,
and the fields / backends that are refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.models import PRESETS, ModelConfig, save_pretrained
from jaxrl_post.models.attention import chunked_attention, resolve_attention_impl
from jaxrl_post.models.hf_io import load_hf_dir, param_map
from jaxrl_post.models.layers import rope_attention_factor, rope_inv_freq
from tests.models.test_moe import (
    _assert_greedy_matches_transformers,
    _batch,
    _close,
    _forward,
    _label_valid,
    _loss_and_grads,
    _random_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

YARN = dict(
    rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=16
)
HF_KW = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=4,  # shorter than the prompts: the window hides keys in prefill and in decode
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=64,
    rope_parameters=dict(YARN, rope_theta=10000.0),
    swiglu_limit=1.0,  # the 0.15-scale weights give |gate/up| up to ~3: both clamps bite
    router_aux_loss_coef=0.5,
)


def _hf_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**{**HF_KW, **kw})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # O(1) logits, non-zero biases and sinks, a router that spreads tokens over the experts
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def _hf_grads(hf, ids, mask):
    """transformers' loss (CE + coef * aux), logits, aux loss and every param gradient by HF name (GPT-OSS's
    names are ours: no per-expert stacking)."""
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
    grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}
    return float(out.loss.detach()), out.logits.detach().numpy(), float(out.aux_loss.detach()), grads


@pytest.mark.slow
def test_gpt_oss_logits_loss_and_every_gradient_match_transformers(tmp_path):
    """Loaded from transformers' save_pretrained: parameter count, logits, aux loss, loss and the gradient of every
    parameter (router weight and bias, fused gate_up and biases, sinks, o_proj bias, ...) within 1e-5 (relative to
    max(1, |ref|)) in float32; the router, router-bias and sink gradients are non-zero."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path)
    cfg = model.config
    assert cfg.family == "gpt_oss" and cfg.moe_layers == (0, 1, 2) and cfg.num_params() == hf.num_parameters()
    assert [model.layers[i].attn.window for i in range(3)] == [4, None, 4]
    ids, mask = _batch(cfg.vocab_size)
    ref_loss, ref_logits, ref_aux, ref_grads = _hf_grads(hf, ids, mask)
    loss, logits, aux, grads = _loss_and_grads(model, jnp.asarray(ids), jnp.asarray(mask), _label_valid(mask))
    valid = mask.astype(bool)
    _close(np.asarray(logits)[valid], ref_logits[valid], 1e-5, "logits")
    _close(aux, ref_aux, 1e-5, "aux loss")
    _close(loss, ref_loss, 1e-5, "loss")
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
    for suffix in ("mlp.router.weight", "mlp.router.bias", "self_attn.sinks"):
        names = [n for n in ours if n.endswith(suffix)]
        assert len(names) == 3 and all(np.abs(ours[n]).max() > 1e-4 for n in names), suffix


@pytest.mark.slow
def test_gpt_oss_greedy_generation_matches_transformers(tmp_path):
    """12 greedy tokens after 8-token prompts (window 4: sliding layers drop keys in decode) equal transformers'
    `generate` (its sliding-window cache, sinks in every decode step)."""
    _assert_greedy_matches_transformers(_hf_model(seed=1), HF_KW["vocab_size"], tmp_path)


def _tiny(**kw):
    base = dict(
        family="gpt_oss",
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
        qkv_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        moe_bias=True,
        swiglu_limit=7.0,
        sliding_window=3,
        layer_types=("sliding_attention", "full_attention"),
        rope_scaling=YARN,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    return ModelConfig(**{**base, **kw})


def test_gpt_oss_export_loads_in_transformers_with_equal_logits(tmp_path):
    """save_pretrained writes GPT-OSS's names (fused `gate_up_proj` `[E, D, 2F]`, biases, sinks) and config.json;
    transformers loads it into GptOssForCausalLM with equal logits; our loader reads it back to the same config and
    bitwise-equal logits."""
    model = _random_model(_tiny(), seed=5)
    save_pretrained(model, None, tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["num_local_experts"] == 4 and hf_cfg["sliding_window"] == 3 and hf_cfg["swiglu_limit"] == 7.0
    assert hf_cfg["rope_parameters"]["rope_type"] == "yarn"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == [4, 32, 32]
    assert shapes["model.layers.1.mlp.experts.gate_up_proj_bias"] == [4, 32]
    assert shapes["model.layers.0.self_attn.sinks"] == [4] and shapes["model.layers.0.self_attn.o_proj.bias"] == [32]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    ids, mask = _batch(61, b=3, t=9)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
    ours = np.asarray(_forward(model, ids, mask))
    valid = mask.astype(bool)
    _close(ours[valid], ref.logits.numpy()[valid], 1e-5, "logits")
    again = load_hf_dir(tmp_path)
    assert again.config == model.config
    np.testing.assert_array_equal(np.asarray(_forward(again, ids, mask)), ours)


def test_yarn_frequencies_and_attention_factor_match_transformers():
    """`rope_inv_freq` / `rope_attention_factor` equal transformers' `_compute_yarn_parameters` (truncated or not,
    given or implied factor, DeepSeek's mscale ratio)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for extra in (
        dict(truncate=False),
        dict(truncate=True, beta_fast=32.0),
        dict(factor=8.0, mscale=1.0, mscale_all_dim=0.7),
        dict(attention_factor=1.3, original_max_position_embeddings=32),
    ):
        rope = dict(YARN, rope_theta=150000.0, **extra)
        hf_cfg = transformers.GptOssConfig(**{**HF_KW, "rope_parameters": rope, "head_dim": 64})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        np.testing.assert_allclose(rope_inv_freq(64, 150000.0, scaling, 64), inv.numpy(), rtol=1e-6, err_msg=str(extra))
        assert rope_attention_factor(scaling, 64) == pytest.approx(factor, rel=1e-12), extra
    assert rope_attention_factor({"rope_type": "llama3", "factor": 8.0}) == 1.0


def test_sinks_in_the_chunked_backend_equal_the_dense_path():
    """The 'chunked' backend (sinks passed per head) equals the dense attention of the same model, and a numpy
    softmax with one extra per-head logit in the denominator gives the dense path's attention output."""
    model = _random_model(_tiny(layer_types=None, sliding_window=None, num_layers=1), seed=3)
    ids, mask = _batch(61, b=2, t=7)
    dense = np.asarray(_forward(model, ids, mask))
    model.set_attention_impl("chunked")
    np.testing.assert_allclose(np.asarray(_forward(model, ids, mask)), dense, rtol=1e-5, atol=1e-5)
    rng = np.random.RandomState(0)
    q, k, v = (rng.randn(1, 5, h, 8).astype(np.float32) for h in (4, 2, 2))
    sinks = rng.randn(4).astype(np.float32) * 2
    allowed = np.tril(np.ones((5, 5), bool))[None]
    got = chunked_attention(q, k, v, allowed, scale=0.5, softcap=None, dtype=jnp.float32, chunk=2, sinks=sinks)
    ref = np.zeros((1, 5, 4, 8))
    for h in range(4):
        s = 0.5 * q[0, :, h] @ k[0, :, h // 2].T
        s = np.where(allowed[0], s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        p = e / (e.sum(-1, keepdims=True) + np.exp(sinks[h] - s.max(-1, keepdims=True)))
        ref[0, :, h] = p @ v[0, :, h // 2]
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def test_gpt_oss_scanned_layers_equal_unrolled():
    """4 layers alternating sliding / full (period 2): `scan_layers` (2 groups of 2 layers, `block.scan_blocks`) gives
    the unrolled forward's logits and routes."""
    model = _random_model(_tiny(num_layers=4, layer_types=("sliding_attention", "full_attention") * 2), seed=4)
    ids, mask = _batch(61, b=2, t=7)
    run = jax.jit(lambda m, i, k: m(i, k, with_moe=True))
    (unrolled, moe) = run(model, ids, mask)
    model.scan_layers = True
    (scanned, moe_scanned) = run(model, ids, mask)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(moe_scanned.routed_experts), np.asarray(moe.routed_experts))


def test_gpt_oss_preset_and_refused_fields():
    """gpt-oss-20b's preset: 20.91B total, 3.61B active as OpenAI's model card counts them (Table 1: the embedding
    table not active, the unembedding active) within 1%, and it round-trips through config.json; a quantization
    other than mxfp4, `attention_bias: false`, biased experts outside GPT-OSS, a GPT-OSS export transformers cannot
    express and the flash kernels without sinks each raise, naming the field."""
    cfg = PRESETS["gpt_oss_20b"]
    total, active = cfg.num_params(), cfg.num_params(active=True) - cfg.vocab_size * cfg.hidden_size
    assert abs(total - 20.91e9) / 20.91e9 < 0.01 and abs(active - 3.61e9) / 3.61e9 < 0.01
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention") and cfg.sliding_window == 128
    hf = cfg.to_hf_config()
    with pytest.raises(NotImplementedError, match="quantization_config.*fp8"):  # mxfp4 loads: test_mxfp4.py
        ModelConfig.from_hf_config(dict(hf, quantization_config={"quant_method": "fp8"}))
    with pytest.raises(NotImplementedError, match="attention_bias"):
        ModelConfig.from_hf_config(dict(hf, attention_bias=False))
    with pytest.raises(ValueError, match="moe_bias"):
        _tiny(family="qwen3_moe")
    with pytest.raises(ValueError, match="attention_sinks=False"):
        _tiny(attention_sinks=False).to_hf_config()
    for impl in ("cudnn", "splash"):
        with pytest.raises(ValueError, match="attention sinks"):
            resolve_attention_impl(impl, {"cudnn": "gpu", "splash": "tpu"}[impl], dtype=jnp.bfloat16, sinks=True)
    assert resolve_attention_impl("auto", "gpu", dtype=jnp.bfloat16, sinks=True) == "xla"
    # the released config.json's layout (v4 rope keys, no layer_types): transformers' defaults fill in
    raw = dict(hf, rope_parameters=None, layer_types=None)
    assert ModelConfig.from_hf_config(raw) == cfg


@pytest.mark.slow  # a dense Generator and a paged engine compiled
def test_paged_engine_gpt_oss_greedy_equals_the_dense_generator():
    """The paged engine's XLA attention with sinks, the sliding window over pages and YaRN: 4 prompts (2-9 tokens)
    x n 2 through 3 slots with a 9-page pool (sequences preempted and recomputed), layers scanned: the dense
    `Generator`'s tokens, masks and `routed_experts`, log-probs within 1e-5. The Pallas TPU kernel refuses sinks."""
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rollout import Generator, SamplingParams
    from jaxrl_post.rollout.paged.attention import paged_attention
    from jaxrl_post.rollout.paged.engine import PagedGenerator

    model = _random_model(
        _tiny(num_layers=3, layer_types=("sliding_attention", "full_attention", "sliding_attention")), seed=1
    )
    greedy = SamplingParams(max_new_tokens=12, do_sample=False, eos_token_ids=(7, 8), seed=2)
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((4, 9), np.int32), np.zeros((4, 9), np.int32)
    for i, n in enumerate([5, 9, 2, 7]):
        ids[i, 9 - n :], mask[i, 9 - n :] = rng.integers(3, 61, n), 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    dense = Generator(model, decode_chunk=4, compact_min_rows=None, return_routed_experts=True).generate(
        dp, greedy, n=2
    )
    eng = PagedGenerator(
        model, max_num_seqs=3, max_num_batched_tokens=16, page_size=4, steps_per_dispatch=4, num_pages=9,
        scan_layers=True, return_routed_experts=True,
    )  # fmt: skip
    out = eng.generate(dp, greedy, n=2)
    assert eng.last_stats["preemptions"] > 0
    for k in ("responses", "attention_mask", "routed_experts"):
        np.testing.assert_array_equal(out.batch[k], dense.batch[k], err_msg=k)
    np.testing.assert_allclose(out.batch["rollout_log_probs"], dense.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    q, pages = jnp.zeros((1, 4, 8)), jnp.zeros((2, 4, 4, 8))
    one = jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="no attention sinks"):
        paged_attention(q, pages, one, jnp.zeros((1, 1), jnp.int32), jnp.array([0, 1]), one, sm_scale=1.0,
                        impl="pallas_tpu", sinks=jnp.zeros(4))  # fmt: skip
