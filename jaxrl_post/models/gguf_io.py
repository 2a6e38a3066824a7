"""Read llama.cpp GGUF checkpoints: metadata -> HF config dict, tensors -> HF-named float32 arrays.

A GGUF file carries no ``config.json``: its metadata (``<arch>.block_count``, ``<arch>.embedding_length``,
...) is the config, and its tensors use llama.cpp names (``blk.N.attn_q.weight``). This module turns both
into what the rest of ``jaxrl_post.models`` reads for an HF directory: a transformers-style config dict
(fed to ``ModelConfig.from_hf_config``) and tensors under HF transformers names
(``model.layers.N.self_attn.q_proj.weight``), so one loader (``hf_io.load_state_dict_into``) serves both.

What llama.cpp's ``convert_hf_to_gguf.py`` changes, and what we undo here:

* Quantization (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, F16, BF16, ... whatever ``gguf.quants.dequantize``
  supports): dequantized to float32, one tensor at a time (the reader memory-maps the file).
* Shapes: GGUF lists dims fastest-first (``ne = [in, out]``); ``GGUFReader`` already exposes numpy
  (row-major) order, which after dequantization is HF's ``[out, in]`` for linear weights and ``[V, D]``
  for the embedding. Checked against the shapes the config implies.
* Llama only: Q and K projection rows are permuted so that llama.cpp's interleaved ("NORM") RoPE sees the
  pairs HF's rotate-half RoPE uses. The converter maps ``w`` to
  ``w.reshape(n, 2, K/2, ...).swapaxes(1, 2)`` (n = query heads for Q, kv heads for K); we apply the
  inverse ``w.reshape(n, K/2, 2, ...).swapaxes(1, 2)`` (transformers' GGUF loader does the same).
  Qwen2/Qwen3/Gemma use NEOX RoPE in llama.cpp and are stored unpermuted.
* Gemma 2/3 only: every RMSNorm weight is stored as ``1 + w`` (llama.cpp multiplies by the weight
  directly, HF multiplies by ``1 + w``); we subtract 1.
* Tied embeddings: llama.cpp omits ``output.weight`` when the LM head is the embedding, so
  ``tie_word_embeddings = 'output.weight' not in tensors``.
* Llama 3 RoPE scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency divisors rather than
  as parameters; we recover ``{"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings}`` from it and check that they reproduce the tensor.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_ARCHS",
    "gguf_metadata",
    "gguf_hf_config",
    "gguf_to_hf_name",
    "unpermute_llama_qk",
    "permute_llama_qk",
    "iter_gguf_hf_tensors",
    "load_gguf",
]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")

# Arrays in the metadata that are large (vocabulary) and not needed for the model config.
_SKIP_ARRAY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)

# Per-layer GGUF leaf name -> HF suffix after `model.layers.N.`. `ffn_norm` and `post_attention_norm`
# mean different HF norms in the Gemma 2/3 layout (pre+post norms), handled in `_layer_map`.
_LAYER_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_PRE_POST = {  # Gemma 2/3: four norms per layer
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_PRE_ONLY = {"ffn_norm": "post_attention_layernorm"}  # Llama/Qwen: norm before the MLP
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF tensors that are not model parameters (consumed into the config instead).
_NON_PARAM = ("rope_freqs.weight",)

_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


# ----------------------------------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    import gguf

    del mtime_ns, size  # cache key only: a rewritten file is parsed again
    return gguf.GGUFReader(path, "r")


def _reader(path_or_reader):
    """An open ``gguf.GGUFReader`` (memory-mapped, read-only).

    Parsing the metadata of a file with a 50k-token vocabulary takes seconds (gguf-py walks every array
    element), so the last two readers are cached by (path, mtime, size): config and tensors of one
    file share one parse.
    """
    import gguf

    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader
    path = os.path.abspath(os.fspath(path_or_reader))
    st = os.stat(path)
    return _cached_reader(path, st.st_mtime_ns, st.st_size)


def _field_value(field) -> Any:
    """Python value of one GGUF metadata field (str, int, float, bool, or list of those)."""
    return field.contents()


def gguf_metadata(path_or_reader, include_vocab: bool = False) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values.

    Args:
      path_or_reader: path of a ``.gguf`` file or an open ``gguf.GGUFReader``.
      include_vocab: also return the (large) ``tokenizer.ggml.tokens/scores/token_type/merges`` arrays;
        by default they are replaced by their length.
    """
    reader = _reader(path_or_reader)
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not include_vocab and key in _SKIP_ARRAY_KEYS:
            out[key] = len(field.data)
            continue
        out[key] = _field_value(field)
    return out


def _np_shape(tensor) -> tuple[int, ...]:
    """Numpy (row-major) shape of a GGUF tensor: its ggml dims (fastest first) reversed."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float, meta_orig: int | None) -> dict:
    """Recover HF's ``llama3`` rope_scaling dict from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores, per rotary frequency ``f_i = theta**(-2i/K)`` (wavelength ``w_i = 2 pi / f_i``), the
    divisor ``r_i``: 1 where ``w_i < orig/high``, ``factor`` where ``w_i > orig/low`` and, in between,
    ``1 / ((1 - s_i) / factor + s_i)`` with ``s_i = (orig / w_i - low) / (high - low)``. The divisors
    only depend on ``orig/low`` and ``orig/high``, so one of (orig, low, high) is a free scale: we take
    ``orig`` from the metadata (``rope.scaling.original_context_length``) when present, else 8192
    (Llama 3.x), and solve for low/high from the transition band.

    Raises:
      ValueError: the tensor does not follow the llama3 rule (checked by recomputing it, rtol 1e-3).
    """
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    n = head_dim // 2
    if freqs.shape[0] != n:
        raise ValueError(f"rope_freqs has {freqs.shape[0]} entries, expected head_dim/2 = {n}")
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    factor = float(freqs.max())
    orig = int(meta_orig) if meta_orig else 8192
    band = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if band.sum() >= 2 and factor > 1:
        # 1/r = (1 - s)/factor + s  =>  s = (1/r - 1/factor) / (1 - 1/factor); s = a/w - b linear in 1/w.
        s = (1.0 / freqs[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, negb = np.polyfit(1.0 / wavelen[band], s, 1)
        # a = orig / (high - low), b = low / (high - low)
        span = orig / a
        low = -negb * span
        high = low + span
        low, high = float(np.round(low, 4)), float(np.round(high, 4))
    else:  # no transition band to fit: Llama 3.x defaults, verified below
        low, high = 1.0, 4.0
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }
    # verify by recomputing llama.cpp's divisors
    lo_wav, hi_wav = orig / low, orig / high
    expect = np.where(wavelen < hi_wav, 1.0, np.where(wavelen > lo_wav, factor, np.nan))
    mid = np.isnan(expect)
    sm = (orig / wavelen[mid] - low) / (high - low)
    expect[mid] = 1.0 / ((1 - sm) / factor + sm)
    if not np.allclose(expect, freqs, rtol=1e-3, atol=1e-4):
        raise ValueError(
            "rope_freqs.weight does not follow the llama3 rope scaling rule; this GGUF's RoPE scaling is not supported"
        )
    return scaling


def _arch_of(meta: dict) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch


def _hf_config_from(reader) -> dict[str, Any]:
    meta = gguf_metadata(reader)
    arch = _arch_of(meta)
    tensors = {t.name: t for t in reader.tensors}

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    def need(name):
        v = key(name)
        if v is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{name}")
        return v

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # some converters write one count per layer
        if len(set(n_kv)) != 1:
            raise NotImplementedError(f"per-layer kv head counts are not supported: {n_kv}")
        n_kv = n_kv[0]
    n_layers = int(need("block_count"))
    head_dim = key("attention.key_length") or hidden // n_heads
    rope_dim = key("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != int(head_dim):
        raise NotImplementedError(f"partial rotary embeddings (rope dim {rope_dim} != head_dim {head_dim})")
    ffn = key("feed_forward_length")
    if isinstance(ffn, list):
        if len(set(ffn)) != 1:
            raise NotImplementedError(f"per-layer feed_forward_length is not supported: {ffn}")
        ffn = ffn[0]
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab = _np_shape(tensors["token_embd.weight"])[0]
    theta = float(key("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": None,
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    has_qkv_bias = "blk.0.attn_q.bias" in tensors

    # RoPE scaling: explicit parameters (linear / yarn), or llama3's rope_freqs tensor.
    stype = key("rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        freqs = _dequantize(tensors["rope_freqs.weight"])
        cfg["rope_scaling"] = _llama3_rope_scaling(
            freqs, int(head_dim), theta, key("rope.scaling.original_context_length")
        )
    elif stype and stype != "none":
        sc: dict[str, Any] = {"rope_type": stype, "factor": float(need("rope.scaling.factor"))}
        if key("rope.scaling.original_context_length"):
            sc["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        cfg["rope_scaling"] = sc

    if arch == "llama":
        cfg.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias=has_qkv_bias,
            mlp_bias=False,
        )
    elif arch == "qwen2":
        cfg.update(
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            hidden_act="silu",
            use_sliding_window=False,
            sliding_window=None,
        )
    elif arch == "qwen3":
        cfg.update(
            model_type="qwen3",
            architectures=["Qwen3ForCausalLM"],
            hidden_act="silu",
            attention_bias=has_qkv_bias,
            use_sliding_window=False,
            sliding_window=None,
        )
    else:  # gemma2 / gemma3
        # llama.cpp scales queries by 1/sqrt(n_embd/n_head) for the 27B models and 1/sqrt(head_dim)
        # otherwise; HF stores that as query_pre_attn_scalar (no metadata key carries it).
        big = (arch == "gemma2" and n_layers == 46) or (arch == "gemma3" and n_layers == 62)
        qpas = hidden // n_heads if big else int(head_dim)
        window = key("attention.sliding_window")
        cfg.update(
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=has_qkv_bias,
            query_pre_attn_scalar=qpas,
            sliding_window=int(window) if window else None,
        )
        if arch == "gemma2":
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
            cfg.update(
                model_type="gemma2",
                architectures=["Gemma2ForCausalLM"],
                attn_logit_softcapping=key("attn_logit_softcapping"),
                final_logit_softcapping=key("final_logit_softcapping"),
            )
        else:
            pattern = key("attention.sliding_window_pattern", 6)
            if isinstance(pattern, list):  # per-layer "is sliding" flags
                layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                pattern = int(pattern)
                layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
                cfg["sliding_window_pattern"] = pattern
            cfg.update(
                model_type="gemma3_text",
                architectures=["Gemma3ForCausalLM"],
                rope_local_base_freq=float(key("rope.freq_base_swa", 10000.0)),
                attn_logit_softcapping=key("attn_logit_softcapping"),
                final_logit_softcapping=key("final_logit_softcapping"),
            )
        cfg["layer_types"] = layer_types
    return cfg


def gguf_hf_config(path_or_reader) -> dict[str, Any]:
    """HF transformers-style ``config.json`` dict built from a GGUF file's metadata.

    Keys follow transformers (``model_type``, ``hidden_size``, ``num_hidden_layers``, ``head_dim``,
    ``rope_theta``, ``rope_scaling``, ``tie_word_embeddings``, ...), so the result goes straight into
    ``ModelConfig.from_hf_config``. ``vocab_size`` is the embedding's row count.

    Raises:
      NotImplementedError: architecture not in ``SUPPORTED_ARCHS`` (llama, qwen2, qwen3, gemma2, gemma3),
        or a layout our decoder has no field for (per-layer head counts, partial RoPE).
      ValueError: required metadata missing.
    """
    return _hf_config_from(_reader(path_or_reader))


# ----------------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------------
def gguf_to_hf_name(name: str, arch: str) -> str | None:
    """HF transformers name of a GGUF tensor.

    ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``blk.N.ffn_norm`` is
    ``post_attention_layernorm`` for Llama/Qwen (the pre-MLP norm) but ``pre_feedforward_layernorm`` for
    Gemma 2/3, whose ``post_attention_norm``/``post_ffw_norm`` are the extra post norms.

    Returns None for GGUF tensors that are not parameters (``rope_freqs.weight``).

    Raises:
      KeyError: a tensor name this mapping does not know (so nothing is silently dropped).
    """
    if name in _NON_PARAM:
        return None
    m = _BLK_RE.match(name)
    if m:
        layer, leaf, kind = m.groups()
        table = dict(_LAYER_COMMON)
        table.update(_LAYER_PRE_POST if arch in ("gemma2", "gemma3") else _LAYER_PRE_ONLY)
        if leaf in table:
            return f"model.layers.{layer}.{table[leaf]}.{kind}"
        raise KeyError(f"unknown GGUF tensor {name!r} for architecture {arch!r}")
    m = _TOP_RE.match(name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"unknown GGUF tensor {name!r} for architecture {arch!r}")


def permute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half layout -> interleaved pairs).

    Args:
      w: ``[n_heads * K, ...]`` projection weight (or bias), HF layout.
      n_heads: query heads for Q, kv heads for K.
    Returns: same shape and dtype, rows reordered: within each head, row ``j*2 + p`` of the result is
      input row ``p*K/2 + j``. (Used by tests to write GGUF files.)
    """
    k = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, k // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_llama_qk` (GGUF interleaved layout -> HF rotate-half layout)."""
    if w.shape[0] % n_heads or (w.shape[0] // n_heads) % 2:
        raise ValueError(f"cannot unpermute rows={w.shape[0]} over {n_heads} heads of even size")
    k = w.shape[0] // n_heads
    return w.reshape(n_heads, k // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    """Float32 numpy array ``_np_shape(tensor)`` of one GGUF tensor (any type gguf can dequantize)."""
    import gguf

    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    arr = np.asarray(arr, dtype=np.float32).reshape(_np_shape(tensor))
    return arr


def _expected_shape(hf_name: str, cfg: dict) -> tuple[int, ...] | None:
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, Hkv, K = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    table = {
        "model.embed_tokens.weight": (V, D),
        "lm_head.weight": (V, D),
        "model.norm.weight": (D,),
        "self_attn.q_proj.weight": (H * K, D),
        "self_attn.k_proj.weight": (Hkv * K, D),
        "self_attn.v_proj.weight": (Hkv * K, D),
        "self_attn.o_proj.weight": (D, H * K),
        "self_attn.q_proj.bias": (H * K,),
        "self_attn.k_proj.bias": (Hkv * K,),
        "self_attn.v_proj.bias": (Hkv * K,),
        "self_attn.q_norm.weight": (K,),
        "self_attn.k_norm.weight": (K,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    if hf_name in table:
        return table[hf_name]
    suffix = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    if suffix in table:
        return table[suffix]
    if suffix.endswith("layernorm.weight"):
        return (D,)
    return None


def iter_gguf_hf_tensors(path_or_reader, config: dict | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` for every parameter of a GGUF file, one tensor at a time.

    Each array is float32 numpy in HF transformers layout and naming (``[out, in]`` for linear weights,
    ``model.embed_tokens.weight [V, D]``, ``lm_head.weight [V, D]`` only when the file has an untied
    head), dequantized, with llama's Q/K permutation and Gemma's ``1 + w`` norm offset undone.

    Args:
      path_or_reader: ``.gguf`` file path or an open ``gguf.GGUFReader``.
      config: the dict from :func:`gguf_hf_config` (recomputed when None).
    Raises:
      KeyError: unknown tensor name. ValueError: a tensor's shape disagrees with the config.
    """
    reader = _reader(path_or_reader)
    cfg = config if config is not None else _hf_config_from(reader)
    arch = reader.fields["general.architecture"].contents()
    gemma = arch in ("gemma2", "gemma3")
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, arch)
        if hf_name is None:
            continue
        w = _dequantize(tensor)
        if arch == "llama":
            if ".self_attn.q_proj." in hf_name:
                w = unpermute_llama_qk(w, cfg["num_attention_heads"])
            elif ".self_attn.k_proj." in hf_name:
                w = unpermute_llama_qk(w, cfg["num_key_value_heads"])
        if gemma and hf_name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        expect = _expected_shape(hf_name, cfg)
        if expect is not None and tuple(w.shape) != tuple(expect):
            raise ValueError(f"GGUF tensor {tensor.name} -> {hf_name}: shape {w.shape}, expected {expect}")
        yield hf_name, np.ascontiguousarray(w, dtype=np.float32)


def load_gguf(path, dtype: str = "float32", mesh=None, *, param_dtype=None, remat: bool = False):
    """Build a ``Transformer`` from a GGUF file (config from metadata, weights dequantized to float32).

    Params are created abstract (``hf_io.empty_model``) and filled tensor by tensor, each cast to the
    param dtype and placed on its sharding, so the host holds one dequantized tensor at a time.

    Args:
      path: ``.gguf`` file.
      dtype: compute dtype name (``'float32'``, ``'bfloat16'``); also the param dtype unless
        ``param_dtype`` is given.
      mesh: optional ``jax.sharding.Mesh``; params are placed with the logical-axis rules.
      remat: rematerialize each layer in the backward pass.
    Returns: ``jaxrl_post.models.decoder.Transformer`` with every parameter set from the file.
    Raises: see :func:`gguf_hf_config` and :func:`iter_gguf_hf_tensors`; ``hf_io.load_state_dict_into``
      raises ValueError when a parameter is missing or unexpected.
    """
    from jaxrl_post.models import hf_io
    from jaxrl_post.models.config import ModelConfig

    reader = _reader(path)
    hf_cfg = _hf_config_from(reader)
    config = ModelConfig.from_hf_config(hf_cfg)
    model = hf_io.empty_model(config, dtype=dtype, mesh=mesh, param_dtype=param_dtype, remat=remat)
    return hf_io.load_state_dict_into(model, iter_gguf_hf_tensors(reader, hf_cfg), mesh)
