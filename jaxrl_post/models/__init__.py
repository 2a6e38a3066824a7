"""Decoder models (Llama, Qwen2/2.5, Qwen3, Gemma 2/3), critic, reward model, LoRA adapters, checkpoint I/O and
tokenizer helpers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.critic import CriticModel
from jaxrl_post.models.decoder import Transformer
from jaxrl_post.models.gguf_io import load_gguf
from jaxrl_post.models.hf_io import load_hf_dir, load_reward_model, save_pretrained, save_reward_model
from jaxrl_post.models.kv_cache import KVCache
from jaxrl_post.models.lora import LoRAConfig, apply_lora, load_peft_adapter, save_peft_adapter
from jaxrl_post.models.presets import PRESETS, get_preset
from jaxrl_post.models.resolve import resolve_model_path as _resolve
from jaxrl_post.models.reward_model import RewardModel
from jaxrl_post.models.tokenizer import load_tokenizer as _load
from jaxrl_post.runtime.sharding import param_shardings

__all__ = [
    "ModelConfig",
    "PRESETS",
    "get_preset",
    "Transformer",
    "CriticModel",
    "RewardModel",
    "load_reward_model",
    "save_reward_model",
    "KVCache",
    "LoRAConfig",
    "apply_lora",
    "load_peft_adapter",
    "save_peft_adapter",
    "init_model",
    "load_pretrained",
    "save_pretrained",
    "load_hf_dir",
    "load_tokenizer",
    "resolve_model_path",
]


def init_model(
    config: ModelConfig, *, seed: int = 0, dtype="float32", mesh=None, param_dtype=None, remat=False
) -> Transformer:
    """Randomly initialized Transformer (HF-style init: normal(0.02) weights, unit norms).

    Params are created by one jitted init program (cached per config/dtypes/mesh; the seed is a traced
    argument); with a mesh directly on their shardings (eval_shape + jit with out_shardings), never
    materialized whole on one device. Raises ValueError when a param dim does not divide its mesh axis.
    """
    graphdef, init = _init_program(config, jnp.dtype(dtype), jnp.dtype(param_dtype or dtype), remat, mesh)
    return nnx.merge(graphdef, init(jnp.asarray(seed, jnp.uint32)))


@functools.lru_cache(maxsize=16)
def _init_program(config, dtype, param_dtype, remat, mesh):
    def make(seed):
        return Transformer(
            config, rngs=nnx.Rngs(jax.random.key(seed)), dtype=dtype, param_dtype=param_dtype, remat=remat
        )

    graphdef, abstract_state = nnx.split(nnx.eval_shape(make, 0))
    shardings = None
    if mesh is not None:
        shardings = param_shardings(abstract_state, mesh)
    return graphdef, jax.jit(lambda seed: nnx.state(make(seed)), out_shardings=shardings)


def load_tokenizer(path_or_alias, **kwargs):
    """Tokenizer for an HF dir, a .gguf file, a hub id or an alias (see models/tokenizer.py)."""

    return _load(path_or_alias, **kwargs)


def resolve_model_path(name_or_path):
    """Local HF dir / .gguf / hub id / alias -> (kind in {'hf_dir', 'gguf'}, local path) (see models/resolve.py)."""

    return _resolve(name_or_path)


def load_pretrained(path_or_alias, *, dtype="float32", mesh=None, param_dtype=None):
    """(model, tokenizer) from an HF directory, a .gguf file, an HF hub id or an alias.

    dtype is the compute dtype, param_dtype the storage dtype of the weights (None: = dtype). For an HF
    directory without tokenizer files the tokenizer is None. Raises what `resolve_model_path` raises for
    unknown / unreachable names, and ValueError naming a corrupt or truncated file (`resolve.check_model_files`).
    """
    kind, path = resolve_model_path(path_or_alias)
    from jaxrl_post.models.resolve import check_model_files  # lazily, as resolve_model_path above

    check_model_files(kind, path)  # a corrupt or truncated file: ValueError naming it
    if kind == "gguf":
        return load_gguf(path, dtype, mesh=mesh, param_dtype=param_dtype), load_tokenizer(path)
    return load_hf_dir(path, dtype, mesh, param_dtype=param_dtype), load_tokenizer(path, missing_ok=True)
