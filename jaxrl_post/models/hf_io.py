"""Hugging Face checkpoints <-> our Transformer: load a safetensors directory, export one back.

Tensors use HF transformers names (`model.layers.0.self_attn.q_proj.weight`, ...). Loading streams one
tensor at a time (safetensors `safe_open`, memory-mapped) straight onto its target sharding into a model
whose params are still abstract (`empty_model`), so the host never holds a second full copy.

Layout changes HF -> ours (inverse on export): linear weights [out, in] are transposed; q/k/v
[H*K, D] -> [D, H, K]; o_proj [D, H*K] -> [H, K, D]; qkv biases [H*K] -> [H, K]; lm_head [V, D] -> [D, V].
Projection weights and biases live in `Linear` modules (`layers.<i>.attn.q_proj.kernel`, `.bias`).
Llama/Qwen's `post_attention_layernorm` is the pre-MLP norm; Gemma's is the post-attention norm.
MoE layers (Qwen3-MoE): router `mlp.gate.weight` [E, D] -> `mlp.router` [D, E]; the per-expert
`mlp.experts.<j>.<proj>.weight` are stacked into `mlp.<proj>` [E, in, out] (`moe.stack_experts` / `split_experts`);
Mixtral's, Qwen2-MoE's and GPT-OSS's tensors: `moe_families`; GPT-OSS's MXFP4 experts are dequantized on load
(`mxfp4`, reading: `hf_tensors`) and export writes the model's own dtype (GPT-OSS experts: MXFP4 on request).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models import mxfp4
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.decoder import Transformer
from jaxrl_post.models.hf_tensors import checkpoint_tensors, iter_safetensors
from jaxrl_post.models.moe import experts_key, split_experts
from jaxrl_post.models.moe_families import FUSED_EXPERTS, moe_layer_params, ours_to_hf_name
from jaxrl_post.models.resolve import check_model_files
from jaxrl_post.models.reward_model import HF_SEQ_CLS_ARCH, RewardModel
from jaxrl_post.runtime.sharding import _check_divisible, logical_to_mesh_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def param_map(config: ModelConfig) -> dict[str, tuple[tuple, Callable, Callable]]:
    """HF tensor name -> (our param path, hf->ours fn, ours->hf fn) for every param of the model."""
    d, h, n, k = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    ident = (lambda w: w, lambda w: w)
    t = (lambda w: w.T, lambda w: w.T)
    stacked_t = (lambda w: w.transpose(0, 2, 1), lambda w: w.transpose(0, 2, 1))

    def qkv(heads):
        return (lambda w: w.T.reshape(d, heads, k), lambda w: w.reshape(d, heads * k).T)

    def bias(heads):
        return (lambda w: w.reshape(heads, k), lambda w: w.reshape(heads * k))

    o = (lambda w: w.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T)
    out = {
        "model.embed_tokens.weight": (("embedding",), *ident),
        "model.norm.weight": (("final_norm", "scale"), *ident),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head",), *t)
    for i in range(config.num_layers):
        p, a = f"model.layers.{i}.", ("layers", i)
        out[p + "self_attn.q_proj.weight"] = (a + ("attn", "q_proj", "kernel"), *qkv(h))
        out[p + "self_attn.k_proj.weight"] = (a + ("attn", "k_proj", "kernel"), *qkv(n))
        out[p + "self_attn.v_proj.weight"] = (a + ("attn", "v_proj", "kernel"), *qkv(n))
        out[p + "self_attn.o_proj.weight"] = (a + ("attn", "o_proj", "kernel"), *o)
        if config.o_proj_bias:
            out[p + "self_attn.o_proj.bias"] = (a + ("attn", "o_proj", "bias"), *ident)
        if config.attention_sinks:
            out[p + "self_attn.sinks"] = (a + ("attn", "sinks"), *ident)
        if config.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (a + ("attn", "q_proj", "bias"), *bias(h))
            out[p + "self_attn.k_proj.bias"] = (a + ("attn", "k_proj", "bias"), *bias(n))
            out[p + "self_attn.v_proj.bias"] = (a + ("attn", "v_proj", "bias"), *bias(n))
        if config.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (a + ("attn", "q_norm", "scale"), *ident)
            out[p + "self_attn.k_norm.weight"] = (a + ("attn", "k_norm", "scale"), *ident)
        moe = config.is_moe_layer(i)
        if moe:  # router [E, D] -> [D, E]; experts: the [E, out, in] stack of HF's per-expert weights (`experts_key`)
            out.update(moe_layer_params(config, p, a, t))
        for name in () if moe and config.family in FUSED_EXPERTS else ("gate_proj", "up_proj", "down_proj"):
            if moe:
                out[experts_key(i, name)] = (a + ("mlp", name), *stacked_t)
            else:
                out[p + f"mlp.{name}.weight"] = (a + ("mlp", name, "kernel"), *t)
        out[p + "input_layernorm.weight"] = (a + ("input_norm", "scale"), *ident)
        if config.post_norms:
            out[p + "post_attention_layernorm.weight"] = (a + ("post_attn_norm", "scale"), *ident)
            out[p + "pre_feedforward_layernorm.weight"] = (a + ("pre_mlp_norm", "scale"), *ident)
            out[p + "post_feedforward_layernorm.weight"] = (a + ("post_mlp_norm", "scale"), *ident)
        else:
            out[p + "post_attention_layernorm.weight"] = (a + ("pre_mlp_norm", "scale"), *ident)
    return out


def _get_variable(model, path: tuple) -> nnx.Variable:
    obj = model
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj


def _export_value(model, path: tuple) -> jax.Array:
    """The value written for `path`: a projection kernel with its LoRA adapter merged in (`Linear.merged_kernel`),
    every other param as stored."""
    if path[-1] == "kernel":
        return _get_variable(model, path[:-1]).merged_kernel()
    return _get_variable(model, path).get_value()


def _target_sharding(var: nnx.Variable, mesh, path: tuple):
    if mesh is not None:
        spec = logical_to_mesh_spec(var.get_metadata().get("out_sharding"))
        _check_divisible(".".join(map(str, path)), var.shape, spec, mesh)
        return jax.sharding.NamedSharding(mesh, spec)
    value = var.get_value()
    return value.sharding if isinstance(value, jax.Array) else None


def empty_model(config: ModelConfig, *, dtype="float32", mesh=None, param_dtype=None, remat=False) -> Transformer:
    """Transformer whose params are abstract (ShapeDtypeStruct); fill it with `load_state_dict_into`."""
    del mesh  # placement happens per tensor in load_state_dict_into
    return nnx.eval_shape(
        lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype or dtype, remat=remat)
    )


def load_state_dict_into(
    model: Transformer, hf_named_tensors: Iterable[tuple[str, np.ndarray]], mesh=None, *, mapping=None
):
    """Set every param of `model` from (HF name, array) pairs, one tensor at a time; returns the model.

    mapping: HF name -> (param path, hf->ours, ours->hf) (default `param_map(model.config)`; a reward model
    passes `reward_param_map`).

    Each array is reshaped/transposed to our layout, cast to the param's dtype on the host and placed onto
    its sharding (from the logical names when `mesh` is given, else the param's current sharding, else the
    default device). MXFP4 `*_blocks` / `*_scales` pairs (GPT-OSS) are dequantized into the param's dtype
    (`mxfp4.dequantize_experts`). A tied `lm_head.weight` is ignored. Raises ValueError listing missing tensors,
    unexpected tensors and shape mismatches (after the iterator is exhausted), or naming a malformed MXFP4 tensor.
    """
    mapping = param_map(model.config) if mapping is None else mapping
    seen, unexpected, bad_shape, incomplete = set(), [], [], []

    def dtype_of(name):  # MXFP4 experts dequantize straight into their param's dtype
        return _get_variable(model, mapping[name][0]).dtype if name in mapping else np.float32

    for name, array in checkpoint_tensors(model.config, hf_named_tensors, dtype_of, incomplete):
        if name not in mapping:
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                unexpected.append(name)
            continue
        path, to_ours, _ = mapping[name]
        var = _get_variable(model, path)
        arr = np.asarray(to_ours(np.asarray(array)))
        if tuple(arr.shape) != tuple(var.shape):
            bad_shape.append(f"{name}: got {tuple(np.shape(array))} -> {arr.shape}, expected {var.shape}")
            continue
        arr = np.ascontiguousarray(arr.astype(var.dtype, copy=False))
        sharding = _target_sharding(var, mesh, path)
        if sharding is None:
            value = jnp.asarray(arr)
        else:
            value = jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx])
        var.set_value(value)
        seen.add(name)
        del arr, array
    missing = sorted(set(mapping) - seen)
    unexpected += incomplete
    if missing or unexpected or bad_shape:

        def show(xs):
            return ", ".join(xs[:8]) + (f", ... ({len(xs)} total)" if len(xs) > 8 else "")

        msg = []
        if missing:
            msg.append(f"missing tensors: {show(missing)}")
        if unexpected:
            msg.append(f"unexpected tensors: {show(unexpected)}")
        if bad_shape:
            msg.append(f"shape mismatches: {show(bad_shape)}")
        raise ValueError(f"checkpoint does not match {model.config.family} config: " + "; ".join(msg))
    return model


def check_causal_lm_dir(path) -> None:
    """Refuse an HF directory whose config.json names a `*ForSequenceClassification` architecture (a reward
    model: a score head, no LM head) where a generating model is needed (actor, reference, teacher, chat).

    Raises:
      ValueError: naming the directory and the architecture, and where a reward model is used instead
        (`reward_model.model.path`).
    """
    cfg_path = os.path.join(os.fspath(path), "config.json")
    try:
        with open(cfg_path) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return  # a missing or unreadable config.json is reported by the loader itself
    seq_cls = [a for a in archs if str(a).endswith("ForSequenceClassification")]
    if seq_cls:
        raise ValueError(
            f"{path} is a reward model (config.json architectures {seq_cls}): it has a score head and no LM head, "
            "so it cannot generate or give token log-probs; use it as --config.reward_model.model.path, or pass a "
            "*ForCausalLM directory here"
        )


def load_hf_dir(path, dtype="float32", mesh=None, *, param_dtype=None, remat=False) -> Transformer:
    """Transformer from an HF directory (config.json + safetensors), params placed on `mesh` if given.

    dtype: compute dtype (and param dtype unless `param_dtype` is given), e.g. 'float32', 'bfloat16'.
    """
    path = os.fspath(path)
    check_causal_lm_dir(path)
    config = ModelConfig.from_hf_config(os.path.join(path, "config.json"))
    model = empty_model(config, dtype=dtype, mesh=mesh, param_dtype=param_dtype, remat=remat)
    return load_state_dict_into(model, iter_safetensors(path), mesh)


def has_tokenizer_files(path) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save_pretrained(
    model: Transformer,
    tokenizer,
    out_dir,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    mapping=None,
    hf_config_updates: dict | None = None,
    quantization: str | None = None,
) -> None:
    """Write an HF directory: config.json, generation_config.json, model.safetensors (or shards + index),
    tokenizer files (`tokenizer.save_pretrained`, skipped when tokenizer is None).

    Params are written in their own dtype; a projection with a LoRA adapter is written merged
    (`W + (alpha / r) A B`; `models.lora.save_peft_adapter` writes the adapter alone). Tensors are fetched to
    the host one shard-file at a time. On multi-host runs every process must call this (gathers are
    collective); only process 0 writes. `mapping` (default `param_map(model.config)`) and
    `hf_config_updates` (merged into config.json) let a reward model write its own tensors and architecture
    (`save_reward_model`). `quantization='mxfp4'` (GPT-OSS only) writes the experts as MXFP4 `_blocks` / `_scales`
    with `quantization_config` in config.json, as the released gpt-oss checkpoints (`mxfp4.quantize_mxfp4`; lossy
    unless the weights came from such a checkpoint untrained). Raises ValueError for another quantization or family.
    """
    from safetensors.numpy import save_file

    config: ModelConfig = model.config
    mxfp4.check_export(config.family, quantization)
    os.makedirs(out_dir, exist_ok=True)
    write = jax.process_index() == 0
    mapping = param_map(config) if mapping is None else mapping
    # plan shard files from shapes, then materialize one file at a time
    shards, cur, cur_bytes = [], [], 0
    for name, (path, _, _) in mapping.items():
        var = _get_variable(model, path)
        nbytes = int(np.prod(var.shape)) * np.dtype(var.dtype).itemsize
        if cur and cur_bytes + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nbytes
    shards.append(cur)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for fname, names in zip(files, shards):
        tensors = {}
        for name in names:
            path, _, to_hf = mapping[name]
            value = to_hf(_to_host(_export_value(model, path)))
            for hf_name, array in [(name, value)] if config.family in FUSED_EXPERTS else split_experts(name, value):
                for out_name, out in mxfp4.export_tensors(ours_to_hf_name(config.family, hf_name), array, quantization):
                    tensors[out_name] = np.ascontiguousarray(out)
                    weight_map[out_name] = fname
                    total += tensors[out_name].nbytes
        if write:
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors
    if not write:
        return
    if len(files) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_cfg = config.to_hf_config()
    hf_cfg.update(hf_config_updates or {})
    param_dtype = getattr(model, "param_dtype", None) or model.backbone.param_dtype
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = str(jnp.dtype(param_dtype))
    if quantization is not None:
        hf_cfg["quantization_config"] = dict(mxfp4.QUANTIZATION_CONFIG)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    gen = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_cfg.get(k) is not None}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


# ------------------------------------------------------------------------------------ reward models
def reward_param_map(config: ModelConfig) -> dict[str, tuple[tuple, Callable, Callable]]:
    """`param_map` of a `RewardModel` (HF `*ForSequenceClassification`): the backbone's tensors under
    `backbone`, no LM head, and `score.weight` `[1, D]` <-> our `score` `[D, 1]`."""
    out = {
        name: (("backbone", *path), to_ours, to_hf)
        for name, (path, to_ours, to_hf) in param_map(config).items()
        if name != "lm_head.weight"
    }
    out["score.weight"] = (("score",), lambda w: w.T, lambda w: w.T)
    return out


def _check_seq_cls_config(path: str) -> None:
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{path}: config.json architectures {archs} is not a *ForSequenceClassification reward model "
            "(to start a reward model from a causal LM, use RewardModel.from_backbone)"
        )
    n = hf.get("num_labels", len(hf.get("id2label") or {}) or 1)
    if int(n) != 1:
        raise ValueError(f"{path}: a reward model has num_labels=1, this checkpoint has {n}")


def load_reward_model(path, dtype="float32", mesh=None, *, param_dtype=None, remat=False):
    """`RewardModel` from an HF `*ForSequenceClassification` directory (config.json + safetensors).

    Raises ValueError: config.json names another architecture or `num_labels != 1`, the tensors do not
    match (missing `score.weight`, ...), or a file is corrupt or truncated (naming it); FileNotFoundError: no
    safetensors."""

    path = os.fspath(path)
    check_model_files("hf_dir", path)
    _check_seq_cls_config(path)
    config = ModelConfig.from_hf_config(os.path.join(path, "config.json"))
    pdt = param_dtype or dtype
    model = nnx.eval_shape(lambda: RewardModel(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=pdt, remat=remat))
    return load_state_dict_into(model, iter_safetensors(path), mesh, mapping=reward_param_map(config))


def save_reward_model(model, tokenizer, out_dir, *, pad_token_id: int | None = None) -> None:
    """Write a `RewardModel` as an HF `<Family>ForSequenceClassification` directory (`num_labels=1`,
    `score.weight` `[1, D]`, no bias), loadable by transformers' `AutoModelForSequenceClassification`.
    pad_token_id: written into config.json (transformers pools at the last token != it; default the
    model's `pad_token_id`, else the tokenizer's). Multi-host: as `save_pretrained`."""

    if pad_token_id is None:
        pad_token_id = getattr(model, "pad_token_id", None)
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    updates = {
        "architectures": [HF_SEQ_CLS_ARCH[model.config.family]],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    }
    if pad_token_id is not None:
        updates["pad_token_id"] = int(pad_token_id)
    save_pretrained(model, tokenizer, out_dir, mapping=reward_param_map(model.config), hf_config_updates=updates)
