"""LoRA adapters on the decoder's projections, and their PEFT-format files.

`apply_lora(model, LoRAConfig(rank, alpha, target_modules))` attaches A/B (`nnx.LoRAParam`, float32) to the
targeted `Linear` projections of every layer: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's default
kaiming-uniform init), B = 0, scale alpha / rank, so the adapted model starts equal to the base model.
Only `nnx.LoRAParam` state is trained; `set_lora_enabled(model, False)` gives the base model back (the
reference policy) without a second copy of the weights.

PEFT's adapter format (what `peft.PeftModel.from_pretrained(hf_base_model, dir)` loads):
`adapter_model.safetensors` with `base_model.model.model.layers.<i>.{self_attn,mlp}.<proj>.lora_A.weight`
`[r, in]` and `...lora_B.weight` `[out, r]` (HF layout: in/out flattened, q/k/v out = heads x head_dim,
o_proj in = heads x head_dim), and `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`,
`target_modules`, ...). Ours <-> PEFT: A `[in..., r]` = `lora_A.T` reshaped, B `[r, out...]` = `lora_B.T`
reshaped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.models.hf_io import _to_host
from jaxrl_post.models.linear import Linear
from jaxrl_post.runtime.sharding import logical_to_mesh_spec

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}
_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


def parse_target_modules(value) -> tuple[str, ...]:
    """verl/PEFT `target_modules` -> projection names in `TARGET_MODULES` order.

    value: 'all-linear' (every projection), a comma-separated string or a list of names (a PEFT full
    module path such as 'model.layers.0.self_attn.q_proj' counts as its last part). Raises ValueError
    for an empty selection or an unknown name (the message lists the valid ones).
    """
    if isinstance(value, str):
        if value.strip() == ALL_LINEAR:
            return TARGET_MODULES
        value = value.split(",")
    names = {str(v).strip().rsplit(".", 1)[-1] for v in value} - {""}
    unknown = sorted(names - set(TARGET_MODULES))
    if unknown or not names:
        raise ValueError(
            f"target_modules {value!r}: unknown module names {unknown}; valid: {ALL_LINEAR!r} or any of "
            f"{list(TARGET_MODULES)}"
        )
    return tuple(m for m in TARGET_MODULES if m in names)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank r >= 1, alpha (scale = alpha / r), target_modules (see `parse_target_modules`).

    Raises ValueError for rank < 1, alpha <= 0 or a bad target_modules value."""

    rank: int
    alpha: float = 16.0
    target_modules: tuple[str, ...] = TARGET_MODULES

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an int >= 1, got {self.rank!r}")
        if not float(self.alpha) > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        object.__setattr__(self, "target_modules", parse_target_modules(self.target_modules))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": float(self.alpha), "target_modules": list(self.target_modules)}


def iter_projections(model) -> Iterator[tuple[int, str, str, Linear]]:
    """(layer, 'attn' | 'mlp', name, Linear) for every projection of a `Transformer` (or a critic's backbone).
    An MoE layer's stacked experts (`models/moe.py`) are not `Linear`s: its MLP projections are skipped (LoRA on
    attention only there)."""
    model = getattr(model, "backbone", model)
    for i, block in enumerate(model.layers):
        for parent, names in (("attn", TARGET_MODULES[:4]), ("mlp", TARGET_MODULES[4:])):
            for name in names:
                proj = getattr(getattr(block, parent), name)
                if isinstance(proj, Linear):
                    yield i, parent, name, proj


def lora_config_of(model) -> LoRAConfig | None:
    """The adapters attached to `model` as a LoRAConfig (None without any).

    Raises ValueError when layers differ in their adapters (every layer must be alike)."""
    per_layer: dict[int, set] = {}
    ranks, scales = set(), set()
    for i, _, name, lin in iter_projections(model):
        per_layer.setdefault(i, set())
        if lin.lora_a is not None:
            per_layer[i].add(name)
            ranks.add(lin.lora_rank)
            scales.add(lin.lora_scale)
    if not ranks:
        return None
    if len(ranks) > 1 or len(scales) > 1 or len({frozenset(v) for v in per_layer.values()}) > 1:
        raise ValueError("LoRA adapters differ between projections or layers (rank, alpha or targets)")
    (r,), (scale,) = ranks, scales
    return LoRAConfig(r, scale * r, tuple(per_layer[0]))


def _place(value: np.ndarray, like: jax.Array | None, names: tuple) -> jax.Array:
    """Host array -> jax.Array on `like`'s mesh (sharded by the logical `names`), else the default device."""
    sharding = getattr(like, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        target = jax.sharding.NamedSharding(sharding.mesh, logical_to_mesh_spec(names))
        return jax.make_array_from_callback(value.shape, target, lambda idx: value[idx])
    return jnp.asarray(value)


def apply_lora(model, lora: LoRAConfig, *, seed: int = 0):
    """Attach fresh adapters (A uniform in +-1/sqrt(fan_in), B = 0) to `lora.target_modules` of every layer,
    placed on the kernels' mesh; returns `model`. Raises ValueError if a projection already has one."""
    rng = np.random.default_rng(seed)
    for i, parent, name, lin in iter_projections(model):
        if name not in lora.target_modules:
            continue
        if lin.lora_a is not None:
            raise ValueError(f"layers.{i}.{parent}.{name} already has a LoRA adapter")
        bound = 1.0 / math.sqrt(math.prod(lin.in_shape))
        a = rng.uniform(-bound, bound, lin.in_shape + (lora.rank,)).astype(np.float32)
        b = np.zeros((lora.rank,) + lin.out_shape, np.float32)
        kernel, (a_names, b_names) = lin.kernel.get_value(), lin.lora_axis_names()
        lin.add_lora(_place(a, kernel, a_names), _place(b, kernel, b_names), lora.alpha)
    return model


def merged_state(model):
    """`model`'s base `nnx.Param` state (no LoRA A/B) with every adapted kernel replaced by its
    `Linear.merged_kernel()` (`W + (alpha / r) A . B`, float32 sum, kernel dtype): the params of the same
    model without adapters, e.g. a rollout copy (`RLTrainer.sync_weights`). Traceable; `model` is unchanged."""
    from flax import nnx

    prefix = ("backbone",) if hasattr(model, "backbone") else ()
    base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    merged = {
        prefix + ("layers", i, parent, name, "kernel"): lin.merged_kernel()
        for i, parent, name, lin in iter_projections(model)
        if lin.lora_a is not None
    }
    flat = [(p, v.replace(merged[p]) if p in merged else v) for p, v in nnx.to_flat_state(base)]
    if len(merged) != sum(p in merged for p, _ in flat):
        raise ValueError("merged_state: adapted kernels not found at their expected state paths")
    return nnx.from_flat_state(flat)


def set_lora_enabled(model, enabled: bool):
    """Switch every adapter of `model` on or off (off: each projection is exactly its base layer); returns it."""
    for *_, lin in iter_projections(model):
        lin.lora_enabled = bool(enabled)
    return model


# ---------------------------------------------------------------------------------------- PEFT files
def peft_key(layer: int, parent: str, name: str, which: str) -> str:
    """PEFT tensor name, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"base_model.model.model.layers.{layer}.{_HF_PARENT[parent]}.{name}.lora_{which}.weight"


def save_peft_adapter(model, out_dir, *, base_model_name_or_path: str | None = None) -> LoRAConfig:
    """Write `adapter_model.safetensors` + `adapter_config.json` (PEFT LoRA format, float32) for the adapters of
    `model` into `out_dir`; returns their LoRAConfig. Every process must call it (gathers are collective);
    process 0 writes. Raises ValueError when the model has no adapters."""
    from safetensors.numpy import save_file

    lora = lora_config_of(model)
    if lora is None:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    tensors = {}
    for i, parent, name, lin in iter_projections(model):
        if lin.lora_a is not None:
            a, b = _to_host(lin.lora_a.get_value()), _to_host(lin.lora_b.get_value())
            tensors[peft_key(i, parent, name, "A")] = np.ascontiguousarray(a.reshape(-1, lora.rank).T, np.float32)
            tensors[peft_key(i, parent, name, "B")] = np.ascontiguousarray(b.reshape(lora.rank, -1).T, np.float32)
    if jax.process_index() != 0:
        return lora
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else float(lora.alpha)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": alpha,
        "target_modules": list(lora.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return lora


# adapter_config.json entries we cannot honour -> the value meaning "not used"
_UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layers_to_transform": None,
}


def read_adapter_config(path) -> dict:
    """`adapter_config.json` of a PEFT LoRA adapter directory.

    Raises FileNotFoundError (no directory / no adapter_config.json or adapter_model.safetensors),
    ValueError (not a LoRA adapter), NotImplementedError (DoRA, rsLoRA, per-module ranks, biases, ...)."""
    path = os.fspath(path)
    for fname in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(path, fname)):
            raise FileNotFoundError(f"LoRA adapter {path}: no {fname} (expected a PEFT adapter directory)")
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, off in _UNSUPPORTED.items():
        if cfg.get(key, off) not in (off, None, {}, []):
            raise NotImplementedError(f"LoRA adapter {path}: {key}={cfg[key]!r} is not supported")
    return cfg


def load_peft_adapter(model, path, *, rank: int = 0) -> LoRAConfig:
    """Attach the PEFT LoRA adapter in directory `path` to `model` (rank, alpha and targets from its files, as
    PEFT does); returns its LoRAConfig.

    rank: the configured `model.lora_rank`; 0 accepts the file's rank. Raises ValueError for a rank other
    than the file's, tensors that are not per-layer projections of this model, layers with different
    targets (every layer must carry the same adapters) or shapes that do not fit; plus what
    `read_adapter_config` raises.
    """
    from safetensors.numpy import load_file

    cfg = read_adapter_config(path)
    r = int(cfg["r"])
    if rank and rank != r:
        raise ValueError(f"LoRA adapter {path} has rank r={r} but model.lora_rank={rank}; set them equal (or 0)")
    raw = load_file(os.path.join(os.fspath(path), ADAPTER_WEIGHTS))
    tensors, bad = {}, []
    for key, value in raw.items():
        m = _PEFT_KEY.match(key)
        if m is None or m.group(3) not in TARGET_MODULES:
            bad.append(key)
            continue
        parent = "attn" if m.group(2) == "self_attn" else "mlp"
        tensors[(int(m.group(1)), parent, m.group(3), m.group(4))] = value
    if bad:
        raise ValueError(f"LoRA adapter {path}: tensors that are not decoder projections: {sorted(bad)[:6]}")
    n_layers = len(getattr(model, "backbone", model).layers)
    targets = {name for (_, _, name, _) in tensors}
    want = {(i, p, n, w) for i, p, n, _ in iter_projections(model) if n in targets for w in "AB"}
    if set(tensors) != want:
        missing = sorted(".".join(map(str, k)) for k in want - set(tensors))
        extra = sorted(".".join(map(str, k)) for k in set(tensors) - want)
        raise ValueError(
            f"LoRA adapter {path}: every one of the model's {n_layers} layers needs lora_A and lora_B for "
            f"{sorted(targets)}; missing {missing[:6]}, unexpected {extra[:6]}"
        )
    lora = LoRAConfig(r, float(cfg.get("lora_alpha", 8)), tuple(targets))  # PEFT's default alpha: 8
    values = {}
    for i, parent, name, lin in iter_projections(model):
        if name not in targets:
            continue
        a_hf, b_hf = tensors[(i, parent, name, "A")], tensors[(i, parent, name, "B")]
        in_size, out_size = math.prod(lin.in_shape), math.prod(lin.out_shape)
        if a_hf.shape != (r, in_size) or b_hf.shape != (out_size, r):
            raise ValueError(
                f"LoRA adapter {path}: layers.{i}.{name} lora_A {a_hf.shape} / lora_B {b_hf.shape}, expected "
                f"{(r, in_size)} / {(out_size, r)}"
            )
        a = np.ascontiguousarray(a_hf.T.reshape(lin.in_shape + (r,)), np.float32)
        values[(i, name)] = (a, np.ascontiguousarray(b_hf.T.reshape((r,) + lin.out_shape), np.float32))
    apply_lora(model, lora)
    for i, _, name, lin in iter_projections(model):
        if (i, name) in values:
            (a, b), (a_names, b_names) = values[(i, name)], lin.lora_axis_names()
            lin.lora_a.set_value(_place(a, lin.lora_a.get_value(), a_names))
            lin.lora_b.set_value(_place(b, lin.lora_b.get_value(), b_names))
    return lora
