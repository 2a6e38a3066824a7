"""GGUF metadata -> a transformers-style config dict (``gguf_hf_config``), and the shared reader.

A GGUF file carries no ``config.json``: its metadata (``<arch>.block_count``, ``<arch>.embedding_length``,
...) is the config. ``gguf_hf_config`` maps it to transformers' keys for ``ModelConfig.from_hf_config``.
Llama 3 RoPE scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency divisors rather than as
parameters; we recover ``{"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
original_max_position_embeddings}`` from it and check that they reproduce the tensor. Tensors and the
loader: ``jaxrl_post.models.gguf_io``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

__all__ = ["SUPPORTED_ARCHS", "gguf_metadata", "gguf_hf_config"]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")

# Arrays in the metadata that are large (vocabulary) and not needed for the model config.
_SKIP_ARRAY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


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


def _dequantize(tensor) -> np.ndarray:
    """Float32 numpy array ``_np_shape(tensor)`` of one GGUF tensor (any type gguf can dequantize)."""
    import gguf

    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    arr = np.asarray(arr, dtype=np.float32).reshape(_np_shape(tensor))
    return arr
