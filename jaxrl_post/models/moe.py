"""Mixture-of-experts feed-forward block (HF Qwen3-MoE's `Qwen3MoeSparseMoeBlock`), its routing statistics and
the load-balancing loss.

Shape letters as in decoder.py, plus N = B * T tokens, E experts, k = `num_experts_per_tok`, F =
`moe_intermediate_size`, M = number of MoE layers (`ModelConfig.moe_layers`).

Per token: router logits `x @ router` in float32 (HIGHEST precision, also under bf16 compute), softmax over
the E experts, top-k, optionally renormalized (`norm_topk_prob`); each chosen expert j computes
`down_j(act(x @ gate_j) * (x @ up_j))` and the outputs are summed weighted by the chosen probabilities.
Dispatch is dropless: the N * k (token, expert) assignments are sorted by expert and every expert's
contiguous group goes through one grouped matmul (`grouped_matmul.grouped_matmul`: `jax.lax.ragged_dot`, or the
Pallas megablox `gmm` on TPU with `model.moe_impl='megablox'`; group sizes = tokens per expert), so the FLOPs are
those of the k chosen experts only (no dense all-experts einsum).

Qwen2-MoE's shared expert (`shared_expert_intermediate_size` > 0): every token also goes through one dense MLP,
scaled by `sigmoid(x @ shared_expert_gate)`, added to the routed experts' sum. A capacity factor
(`moe_capacity_factor`, MaxText's `capacity_factor`; default None: dropless) caps each expert at
`ceil(cf * T * k / E)` assignments per sequence (`capacity_keep`); the dropped ones get weight 0 (the residual
carries the token).

Rollout routing replay (R3, arXiv 2510.11370): `MoE.__call__(x, routes=...)` takes the experts to use
instead of the router's top-k; their probabilities are still computed by the router (and renormalized), so
the router weights get gradients, and the same forced routes as those emitted give bitwise the same output.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models import moe_ep
from jaxrl_post.models.grouped_matmul import grouped_matmul
from jaxrl_post.models.layers import MLP, ParamInit, activation, clamped_swiglu

F32 = jnp.float32
EXPERT_AXIS = "expert"  # logical name of the experts dim (sharding.LOGICAL_AXIS_RULES)
_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def routes_dtype(num_experts: int):
    """Smallest integer dtype that holds expert ids: uint8 up to 256 experts, else int16 (verl/ROLL's rule)."""
    return jnp.uint8 if num_experts <= 256 else jnp.int16


class MoEOutput(NamedTuple):
    """Routing of one forward over its M MoE layers (`Transformer.hidden_states(..., with_moe=True)`).

    routed_experts: `[B, T, M, k]` uint8/int16 (`routes_dtype`), the experts each token used per layer, in
        the router's top-k order (verl's `routed_experts`; pass back as forced routes to replay them).
    expert_load: `[M, E]` float32, assignments per expert over the valid tokens (each token counts k times).
    router_prob_sum: `[M, E]` float32, the router's softmax probabilities summed over the valid tokens.
    router_entropy_sum: `[M]` float32, the router's softmax entropy (nats) summed over the valid tokens.
    num_tokens: `[]` float32, valid (attention-mask) tokens.
    dropped: `[M]` float32, assignments of valid tokens dropped by the capacity factor (None when dropless).
    """

    routed_experts: jax.Array
    expert_load: jax.Array
    router_prob_sum: jax.Array
    router_entropy_sum: jax.Array
    num_tokens: jax.Array
    dropped: jax.Array | None = None


class MoE(nnx.Module):
    """Top-k routed experts. Params: `router` `[D, E]`, `gate_proj` / `up_proj` `[E, D, F]`, `down_proj`
    `[E, F, D]` (logical axes 'expert', 'embed', 'mlp'); HF's `mlp.gate.weight` and `mlp.experts.<j>.*`. With
    `cfg.shared_expert_intermediate_size` > 0 also `shared_expert` (an `MLP`) and `shared_expert_gate` `[D, 1]`.
    GPT-OSS (`cfg.moe_bias`): `router_bias` `[E]`, the fused `gate_up_proj` `[E, D, 2F]` (gate and up interleaved,
    HF's layout) instead of `gate_proj` / `up_proj`, `gate_up_proj_bias` `[E, 2F]`, `down_proj_bias` `[E, D]`;
    `cfg.swiglu_limit` set: the experts' activation is `layers.clamped_swiglu`.
    impl / interpret: the grouped matmul's implementation ('ragged_dot' until `set_moe_impl`)."""

    def __init__(self, cfg, *, dtype, init: ParamInit):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.norm_topk_prob = e, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act, self.dtype = cfg.hidden_act, dtype
        self.swiglu = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)
        self.router = init.normal((d, e), ("embed", None))  # every token needs all E logits: not split
        bias = cfg.moe_bias
        self.router_bias = init.normal((e,), (None,)) if bias else None
        self.gate_up_proj = init.normal((e, d, 2 * f), (EXPERT_AXIS, "embed", "mlp")) if bias else None
        self.gate_up_proj_bias = init.const((e, 2 * f), (EXPERT_AXIS, "mlp")) if bias else None
        self.gate_proj = None if bias else init.normal((e, d, f), (EXPERT_AXIS, "embed", "mlp"))
        self.up_proj = None if bias else init.normal((e, d, f), (EXPERT_AXIS, "embed", "mlp"))
        self.down_proj = init.normal((e, f, d), (EXPERT_AXIS, "mlp", "embed"))
        self.down_proj_bias = init.const((e, d), (EXPERT_AXIS, "embed")) if bias else None
        self.capacity_factor = cfg.moe_capacity_factor
        self.impl, self.interpret = "ragged_dot", False  # `set_moe_impl`
        s = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, dtype=dtype, init=init, intermediate_size=s) if s else None
        self.shared_expert_gate = init.normal((d, 1), ("embed", None)) if s else None

    def route(self, x: jax.Array, routes: jax.Array | None = None):
        """x `[N, D]` -> (probs `[N, E]` float32, weights `[N, k]` float32, experts `[N, k]` int32).

        routes: optional forced experts `[N, k]` (any int dtype); their probabilities are gathered from the
        router's softmax (differentiable), else the top-k of the softmax (ties: lowest expert id first)."""
        logits = jnp.einsum(
            "ND,DE->NE",
            x.astype(jnp.float32),
            self.router[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        if routes is None:
            weights, experts = jax.lax.top_k(probs, self.top_k)
        else:
            experts = routes.astype(jnp.int32)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return probs, weights, experts

    def experts(
        self, x: jax.Array, weights: jax.Array, experts: jax.Array, keep: jax.Array | None = None, rows: int = 0
    ) -> jax.Array:
        """Grouped-matmul dispatch on one program: x `[N, D]`, weights/experts `[N, k]` -> `[N, D]` float32 (with an
        expert mesh axis `__call__` uses `moe_ep.dispatch` instead).

        keep: optional `[N, k]` bool, the assignments a capacity factor keeps (`capacity_keep`): dropped ones are
        sorted after every kept one and belong to no group, so the grouped matmuls never compute them; rows: the
        static row count of the grouped matmuls (0 = N * k, dropless), with a capacity factor `capacity_rows`, the
        most assignments the experts can take (fewer than N * k when the factor is below 1: that much less compute)."""
        n, k = experts.shape
        rows = rows or n * k
        flat = experts.reshape(-1)  # [N*k] assignment a = token a // k, slot a % k
        if keep is None:
            key, sizes = flat, jnp.bincount(flat, length=self.num_experts)
        else:  # dropped assignments: one trailing block, in no group (ragged_dot / gmm leave those rows at 0)
            kf = keep.reshape(-1)
            key = jnp.where(kf, flat, self.num_experts)
            sizes = jnp.bincount(flat, weights=kf.astype(jnp.int32), length=self.num_experts)
        order = jnp.argsort(key, stable=True)[:rows]  # assignments grouped by expert, the first `rows`
        xs = jnp.take(x, order // k, axis=0).astype(self.dtype)  # [rows, D]
        ys = self.ffn(xs, sizes.astype(jnp.int32), jnp.take(key, order), self.expert_params())  # [rows, D] sorted
        # where each assignment sits in `ys`; `rows` (out of range -> 0) for an assignment past the buffer (dropped)
        inverse = jnp.full((n * k,), rows, order.dtype).at[order].set(jnp.arange(rows, dtype=order.dtype))
        ys = jnp.take(ys, inverse, axis=0, mode="fill", fill_value=0).astype(jnp.float32).reshape(n, k, -1)
        return jnp.einsum("NKD,NK->ND", ys, weights)

    def expert_params(self) -> dict[str, jax.Array]:
        """The experts' arrays by param name (`[E, ...]`: gate/up/down, or GPT-OSS's fused gate_up and biases)."""
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        names = names if self.gate_up_proj is not None else ("gate_proj", "up_proj", "down_proj")
        return {n: getattr(self, n)[...] for n in names}

    def ffn(self, xs: jax.Array, sizes: jax.Array, expert_of: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        """The experts' MLP on rows grouped by expert: xs `[R, D]` sorted by expert, sizes `[E']` int32 rows per
        expert, expert_of `[R]` int32 each row's expert (>= E' for rows in no group: padding, dropped), p the
        `expert_params` of these E' experts (all of them, or one device's under expert parallelism) -> `[R, D]` in
        the compute dtype: grouped matmuls (`impl`, float32 accumulation as `linear._dot`); GPT-OSS's biases are
        gathered per row (0 for rows in no group) and its fused gate/up split into (gate, up) pairs (a 2F split
        over 'tensor' stays split over F)."""

        def gmm(lhs, w):
            return grouped_matmul(lhs, w.astype(self.dtype), sizes, impl=self.impl, interpret=self.interpret)

        if "gate_up_proj" not in p:
            return gmm(self._act(gmm(xs, p["gate_proj"]), gmm(xs, p["up_proj"])), p["down_proj"])
        bias = lambda b: jnp.take(b, expert_of, axis=0, mode="fill", fill_value=0).astype(self.dtype)
        gu = gmm(xs, p["gate_up_proj"]) + bias(p["gate_up_proj_bias"])
        gu = gu.reshape(gu.shape[0], -1, 2)  # [R, F, 2]: (gate, up) pairs
        return gmm(self._act(gu[..., 0], gu[..., 1]), p["down_proj"]) + bias(p["down_proj_bias"])

    def _act(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.swiglu is None:
            return activation(self.act, gate) * up
        return clamped_swiglu(gate, up, *self.swiglu)

    def __call__(self, x: jax.Array, token_mask: jax.Array, routes: jax.Array | None = None):
        """x `[B, T, D]`; token_mask `[B, T]` bool (tokens counted in the statistics); routes: optional
        forced experts `[B, T, k]`. Returns (y `[B, T, D]` compute dtype, stats): stats = (experts
        `[B, T, k]` int32, expert load `[E]`, router prob sum `[E]`, entropy sum `[]`, dropped assignments `[]`
        or None when dropless), float32 sums over the masked tokens (`MoEOutput`). The expert load counts the
        routed assignments, dropped ones included (as the load-balancing loss wants)."""
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        probs, weights, experts = self.route(xf, None if routes is None else routes.reshape(b * t, self.top_k))
        m = token_mask.reshape(-1).astype(jnp.float32)
        dropped = keep = None
        if self.capacity_factor is not None:
            keep = capacity_keep(experts.reshape(b, t, -1), token_mask, self.num_experts, self.capacity_factor)
            keep = keep.reshape(b * t, self.top_k)
            weights = jnp.where(keep, weights, 0.0)
            dropped = jnp.sum(jnp.where(keep, 0.0, m[:, None]))
        if moe_ep.expert_parallel_size() > 1:  # experts split over the mesh's 'expert' axis: all-to-all dispatch
            cap = None if keep is None else expert_capacity(t, self.top_k, self.num_experts, self.capacity_factor)
            y = moe_ep.dispatch(
                x,
                weights.reshape(b, t, self.top_k),
                experts.reshape(b, t, self.top_k),
                self.expert_params(),
                self.ffn,
                num_experts=self.num_experts,
                dtype=self.dtype,
                check_vma=self.impl != "megablox",  # a Pallas call's output carries no varying-axes type
                keep=None if keep is None else keep.reshape(b, t, self.top_k),  # dropped: not sent, not computed
                capacity=cap,
            ).astype(self.dtype)
        else:
            rows = 0 if keep is None else capacity_rows(b, t, self.top_k, self.num_experts, self.capacity_factor)
            y = self.experts(xf, weights, experts, keep, rows).astype(self.dtype).reshape(b, t, d)
        if self.shared_expert is not None:  # Qwen2-MoE: + sigmoid(x @ w_gate) * shared_mlp(x)
            g = jnp.einsum("BTD,DO->BTO", x, self.shared_expert_gate[...].astype(x.dtype), preferred_element_type=F32)
            y = (y.astype(F32) + jax.nn.sigmoid(g) * self.shared_expert(x).astype(F32)).astype(self.dtype)
        load = jnp.bincount(experts.reshape(-1), weights=jnp.repeat(m, self.top_k), length=self.num_experts)
        entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, jnp.finfo(jnp.float32).tiny)), axis=-1)
        stats = (experts.reshape(b, t, self.top_k), load, m @ probs, m @ entropy, dropped)
        return y, stats


def set_moe_impl(model, impl: str, *, interpret: bool = False) -> None:
    """Grouped matmul of every MoE layer of `model` (a `Transformer`): 'ragged_dot' (the default) or 'megablox' (the
    Pallas TPU kernel; pick one with `grouped_matmul.resolve_moe_impl`). interpret: run megablox in Pallas interpret
    mode (CPU tests). Set before splitting the model (the choice is static, part of the graphdef); a dense model is
    left as it is. Raises ValueError for another name."""
    if impl not in ("ragged_dot", "megablox"):
        raise ValueError(f"moe impl must be 'ragged_dot' or 'megablox', got {impl!r}")
    for block in model.layers:
        if isinstance(block.mlp, MoE):
            block.mlp.impl, block.mlp.interpret = impl, bool(interpret)


def expert_capacity(t: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments of one row (sequence) an expert takes: `ceil(capacity_factor * T * k / E)` (MaxText's rule)."""
    return math.ceil(capacity_factor * t * k / num_experts)


def capacity_rows(b: int, t: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """The most assignments `[B, T, k]` routes can keep under a capacity factor: `min(B * T * k, B * E * C)` (each of
    the B rows gives each of the E experts at most C, `expert_capacity`), the grouped matmuls' static rows."""
    return min(b * t * k, b * num_experts * expert_capacity(t, k, num_experts, capacity_factor))


def capacity_keep(experts: jax.Array, token_mask: jax.Array, num_experts: int, capacity_factor: float) -> jax.Array:
    """Which assignments an expert takes under a capacity factor (MaxText's `capacity_factor`, per sequence as
    its dropping path): experts `[B, T, k]` int, token_mask `[B, T]` bool -> keep `[B, T, k]` bool.

    Each expert takes at most `C = ceil(capacity_factor * T * k / E)` assignments of a row (a packed row of several
    sequences is one row), in priority order:
    the valid (masked-in) tokens first, then by position, then by slot (the top-1 choice of a token before its
    top-2); the rest are dropped. A decode step (T = 1) never drops when C >= 1."""
    t, k = experts.shape[1:]
    cap = expert_capacity(t, k, num_experts, capacity_factor)

    def row(e, valid):
        flat = e.reshape(-1)  # [T*k], token-major
        invalid = jnp.repeat(~valid, k).astype(jnp.int32)
        order = jnp.argsort(flat * 2 + invalid, stable=True)  # grouped by expert, valid first, then position
        sizes = jnp.bincount(flat, length=num_experts)
        starts = jnp.cumsum(sizes) - sizes
        rank = jnp.zeros_like(flat).at[order].set(jnp.arange(t * k, dtype=flat.dtype) - starts[flat[order]])
        return (rank < cap).reshape(t, k)

    return jax.vmap(row)(experts.astype(jnp.int32), token_mask.astype(bool))


def layer_routes(cfg, routed_experts, shape) -> list:
    """Forced routes `[B, T, M, k]` (or None) -> per layer `[B, T, k]` (None for dense layers or without routes).
    Raises ValueError when the shape is not `(*shape, len(cfg.moe_layers), cfg.num_experts_per_tok)`."""
    routes = [None] * cfg.num_layers
    if routed_experts is None:
        return routes
    want = (*shape, len(cfg.moe_layers), cfg.num_experts_per_tok)
    if not cfg.moe_layers or tuple(routed_experts.shape) != want:
        raise ValueError(f"routed_experts has shape {tuple(routed_experts.shape)}, this model needs {want}")
    for j, i in enumerate(cfg.moe_layers):
        routes[i] = routed_experts[:, :, j]
    return routes


def collect(stats: list, token_mask: jax.Array, num_experts: int) -> MoEOutput:
    """Per-MoE-layer `MoE.__call__` stats (in layer order) -> one `MoEOutput`."""
    experts, load, prob_sum, entropy, dropped = (list(x) for x in zip(*stats))
    routes = jnp.stack(experts, axis=2).astype(routes_dtype(num_experts))
    n = jnp.sum(token_mask.astype(jnp.float32))
    dropped = None if any(x is None for x in dropped) else jnp.stack(dropped)
    return MoEOutput(routes, jnp.stack(load), jnp.stack(prob_sum), jnp.stack(entropy), n, dropped)


def load_balancing_loss(moe: MoEOutput) -> jax.Array:
    """HF's `load_balancing_loss_func` (Switch Transformer eqs. 4-6, summed over layers as transformers does):
    `E * sum_e f_e * P_e`, f_e = expert e's share of all layers' assignments per token, P_e = its mean router
    probability, both over the M layers' valid tokens. `[]` float32; the gradient flows through P only.
    Counts come from the experts actually used (the forced routes under replay)."""
    m, e = moe.expert_load.shape
    rows = jnp.maximum(moe.num_tokens * m, 1.0)
    f = jnp.sum(moe.expert_load, axis=0) / rows
    p = jnp.sum(moe.router_prob_sum, axis=0) / rows
    return e * jnp.sum(jax.lax.stop_gradient(f) * p)


def router_metrics(moe: MoEOutput, prefix: str = "actor/moe") -> dict[str, jax.Array]:
    """Per-layer routing metrics (float32 scalars), keyed `{prefix}/layer_{j}/...` for MoE layer j:
    `expert_load_max` (the busiest expert's share of assignments times E: 1 = balanced, E = collapsed),
    `expert_load_min` (same, the idlest), `router_entropy` (mean softmax entropy per token, nats), plus
    `{prefix}/aux_loss` (`load_balancing_loss`); under a capacity factor also `dropped_token_fraction` (the share
    of the valid tokens' k assignments dropped)."""
    m, e = moe.expert_load.shape
    share = moe.expert_load / jnp.maximum(jnp.sum(moe.expert_load, axis=1, keepdims=True), 1.0) * e
    ent = moe.router_entropy_sum / jnp.maximum(moe.num_tokens, 1.0)
    out = {f"{prefix}/aux_loss": load_balancing_loss(moe)}
    for j in range(m):
        out[f"{prefix}/layer_{j}/expert_load_max"] = jnp.max(share[j])
        out[f"{prefix}/layer_{j}/expert_load_min"] = jnp.min(share[j])
        out[f"{prefix}/layer_{j}/router_entropy"] = ent[j]
        if moe.dropped is not None:
            k = moe.routed_experts.shape[-1]
            out[f"{prefix}/layer_{j}/dropped_token_fraction"] = moe.dropped[j] / jnp.maximum(moe.num_tokens * k, 1.0)
    return out


# ------------------------------------------------------------------------ HF checkpoint layout (hf_io.py)
def experts_key(layer: int, proj: str) -> str:
    """Name of layer `layer`'s stacked expert weights `[E, out, in]` (HF's `mlp.experts.<j>.<proj>.weight`
    stacked over j; for down_proj also transformers' own in-memory name and layout)."""
    return f"model.layers.{layer}.mlp.experts.{proj}"


def stack_experts(named: Iterable[tuple[str, np.ndarray]], num_experts: int, incomplete: list):
    """HF's per-expert tensors `model.layers.<i>.mlp.experts.<j>.<proj>.weight` -> one `[E, out, in]` array named
    `experts_key(i, proj)`, yielded once all E experts are in (one layer's projection is buffered at a time in a
    layer-ordered checkpoint); transformers' fused `mlp.experts.gate_up_proj` `[E, 2F, D]` -> gate and up
    stacks; other tensors pass through. Stacks still incomplete at the end are appended to `incomplete`."""
    pending: dict[str, dict[int, np.ndarray]] = {}
    for name, array in named:
        m = _EXPERT_NAME.match(name)
        if num_experts and m:
            key = experts_key(int(m.group(1)), m.group(3))
            parts = pending.setdefault(key, {})
            parts[int(m.group(2))] = np.asarray(array)
            if set(parts) == set(range(num_experts)):
                yield key, np.stack([parts.pop(j) for j in range(num_experts)])
                del pending[key]
        elif num_experts and name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = np.split(np.asarray(array), 2, axis=1)
            yield name[: -len("gate_up_proj")] + "gate_proj", gate
            yield name[: -len("gate_up_proj")] + "up_proj", up
        else:
            yield name, array
    incomplete.extend(f"{k} ({len(v)} of {num_experts} experts)" for k, v in pending.items())


def split_experts(name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `stack_experts` on export: a stacked `experts_key` array -> HF's per-expert tensors."""
    m = _STACKED_NAME.match(name)
    if m is None:
        yield name, array
        return
    for j in range(array.shape[0]):
        yield f"model.layers.{m.group(1)}.mlp.experts.{j}.{m.group(2)}.weight", array[j]
