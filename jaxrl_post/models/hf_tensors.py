"""Reading an HF checkpoint's tensors for `hf_io.load_state_dict_into`: the safetensors files one tensor at a time,
names normalized onto the text model's, and the stream reshaped into the tensors `hf_io.param_map` names (Mixtral's
names, MXFP4 experts dequantized (`mxfp4`), per-expert tensors stacked (`moe.stack_experts`))."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxrl_post.models.moe import stack_experts
from jaxrl_post.models.moe_families import FUSED_EXPERTS, hf_to_ours_name
from jaxrl_post.models.mxfp4 import dequantize_experts

_SKIP_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def _normalize_name(name: str) -> str | None:
    """Map Gemma 3 multimodal / legacy names onto text-model names; None for tensors we ignore."""
    if name.startswith(_SKIP_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def checkpoint_tensors(
    config, named: Iterable[tuple[str, np.ndarray]], dtype_of: Callable[[str], object], incomplete: list
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) pairs of a checkpoint -> the (name, array) pairs `hf_io.param_map(config)` names: ignored
    tensors dropped, multimodal / Mixtral names mapped, GPT-OSS's MXFP4 `*_blocks` / `*_scales` dequantized to
    `dtype_of(name)` (`mxfp4.dequantize_experts`), per-expert tensors stacked (not for fused experts). Halves of a
    pair or stack that never complete are appended to `incomplete`."""
    family = config.family
    named = ((hf_to_ours_name(family, n), a) for n, a in ((_normalize_name(r), a) for r, a in named) if n)
    if family in FUSED_EXPERTS:
        return dequantize_experts(named, dtype_of, incomplete)
    return stack_experts(named, config.num_experts, incomplete)


def iter_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, numpy array) from `model.safetensors` or the shards of `model.safetensors.index.json`."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
