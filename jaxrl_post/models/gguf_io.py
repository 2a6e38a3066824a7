"""Read llama.cpp GGUF checkpoints: metadata -> HF config dict, tensors -> HF-named float32 arrays.

A GGUF file carries no ``config.json``: its metadata (``<arch>.block_count``, ``<arch>.embedding_length``,
...) is the config, and its tensors use llama.cpp names (``blk.N.attn_q.weight``). This module turns both
into what the rest of ``jaxrl_post.models`` reads for an HF directory: a transformers-style config dict
(fed to ``ModelConfig.from_hf_config``) and tensors under HF transformers names
(``model.layers.N.self_attn.q_proj.weight``), so one loader (``hf_io.load_state_dict_into``) serves both.
The metadata side (reader, ``gguf_metadata``, ``gguf_hf_config``) lives in ``gguf_config`` and is re-exported.

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

import re
from collections.abc import Iterator

import numpy as np

from jaxrl_post.models import hf_io
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.gguf_config import (
    SUPPORTED_ARCHS,
    _dequantize,
    _reader,
    gguf_hf_config,
    gguf_metadata,
)

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
    cfg = config if config is not None else gguf_hf_config(reader)
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

    reader = _reader(path)
    hf_cfg = gguf_hf_config(reader)
    config = ModelConfig.from_hf_config(hf_cfg)
    model = hf_io.empty_model(config, dtype=dtype, mesh=mesh, param_dtype=param_dtype, remat=remat)
    return hf_io.load_state_dict_into(model, iter_gguf_hf_tensors(reader, hf_cfg), mesh)
