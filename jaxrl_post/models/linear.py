"""The decoder's projection layer: one einsum weight, optional bias, the precision policy, optional LoRA.

`Linear(spec, kernel, bias=None, *, dtype)` computes `einsum(spec, x, kernel)` (+ bias) in the compute
`dtype` with float32 accumulation. After `add_lora(a, b, alpha)` it adds the low-rank update of LoRA
(Hu et al. 2021, arXiv:2106.09685, with PEFT's conventions):

    y = x . W (+ bias) + (alpha / r) * (x . A) . B

A `[in..., r]` and B `[r, out...]` are `nnx.LoRAParam`s (float32; B starts at zero, so a fresh adapter
changes nothing), the kernel's input dims come first and its output dims last, e.g. q_proj W `[D, H, K]`
-> A `[D, r]`, B `[r, H, K]`; o_proj W `[H, K, D]` -> A `[H, K, r]`, B `[r, D]`. A and B carry the
kernel's logical axis names (plus `'lora'` for the rank dim), so the one rules table in
`jaxrl_post.runtime.sharding` shards them like the kernel. `lora_enabled = False` (see
`models.lora.set_lora_enabled`) turns the adapter off: the output is then exactly the base layer's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LORA_AXIS = "lora"  # logical name of the rank dim of LoRA A/B (replicated: see sharding.LOGICAL_AXIS_RULES)


def _dot(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """einsum in `dtype` with float32 accumulation, result cast back to `dtype` (as torch bf16 matmuls do).

    Asking for a float32 result keeps bfloat16 operands on XLA:CPU's native bf16 kernels (AMX/AVX512-BF16);
    a bf16-out dot is otherwise upcast to a float32 dot, converting the weights every call.
    """
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)


def split_spec(spec: str) -> tuple[str, str, str, str]:
    """'BTD,DNK->BTNK' -> (x letters, kernel input letters 'D', kernel output letters 'NK', batch letters 'BT').

    Raises ValueError unless the kernel lists its input letters (those shared with x) before its output
    letters, every output letter is in the result, and 'r' (the LoRA rank letter) is unused.
    """
    lhs, out = spec.replace(" ", "").split("->")
    xs, ks = lhs.split(",")
    ins = "".join(c for c in ks if c in xs)
    outs = "".join(c for c in ks if c not in xs)
    batch = "".join(c for c in xs if c not in ks)
    if ks != ins + outs or any(c not in out for c in outs) or "r" in spec:
        raise ValueError(f"Linear spec {spec!r}: kernel letters must be inputs then outputs, without 'r'")
    return xs, ins, outs, batch


class Linear(nnx.Module):
    """Projection `x [..., in...] -> y [..., out...]` by `einsum(spec, x, kernel)` in `dtype`.

    kernel: `nnx.Param` `[in..., out...]` (param dtype, logical axis names as `out_sharding` metadata);
    bias: optional `nnx.Param` `[out...]`, added in `dtype`. LoRA attributes: `lora_a`, `lora_b`
    (`nnx.LoRAParam` or None), `lora_scale = alpha / r` and `lora_enabled` (static, default True).
    """

    def __init__(self, spec: str, kernel: nnx.Param, bias: nnx.Param | None = None, *, dtype):
        xs, ins, outs, batch = split_spec(spec)
        self.spec, self.dtype = spec, dtype
        self.kernel, self.bias = kernel, bias
        self.n_in = len(ins)
        self.lora_specs = (f"{xs},{ins}r->{batch}r", f"{batch}r,r{outs}->{spec.split('->')[1].strip()}")
        self.lora_a: nnx.LoRAParam | None = nnx.data(None)  # data attributes: `add_lora` may set them later
        self.lora_b: nnx.LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0
        self.lora_enabled = True

    # ------------------------------------------------------------------ shapes
    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.kernel.shape[: self.n_in])

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.kernel.shape[self.n_in :])

    @property
    def lora_rank(self) -> int:
        """Rank r of the attached adapter (0 without one)."""
        return 0 if self.lora_a is None else int(self.lora_a.shape[-1])

    def lora_axis_names(self) -> tuple[tuple, tuple]:
        """Logical axis names of (A, B): the kernel's input names + 'lora', 'lora' + its output names."""
        names = self.kernel.get_metadata().get("out_sharding") or (None,) * len(self.kernel.shape)
        return tuple(names[: self.n_in]) + (LORA_AXIS,), (LORA_AXIS,) + tuple(names[self.n_in :])

    def add_lora(self, a: jax.Array, b: jax.Array, alpha: float) -> None:
        """Attach an adapter: a `[in..., r]`, b `[r, out...]` (stored float32, kernel's logical names + 'lora').

        Raises ValueError when the shapes do not fit the kernel or r < 1.
        """
        r = int(np.shape(a)[-1]) if np.ndim(a) else 0
        if r < 1 or tuple(np.shape(a)) != self.in_shape + (r,) or tuple(np.shape(b)) != (r,) + self.out_shape:
            raise ValueError(
                f"LoRA A {tuple(np.shape(a))} / B {tuple(np.shape(b))} do not fit kernel {tuple(self.kernel.shape)} "
                f"(expected A {self.in_shape + ('r',)}, B {('r',) + self.out_shape}, r >= 1)"
            )
        a_names, b_names = self.lora_axis_names()
        self.lora_a = nnx.LoRAParam(jnp.asarray(a, jnp.float32), out_sharding=a_names, eager_sharding=False)
        self.lora_b = nnx.LoRAParam(jnp.asarray(b, jnp.float32), out_sharding=b_names, eager_sharding=False)
        self.lora_scale = float(alpha) / r

    def lora_delta(self) -> jax.Array:
        """`(alpha / r) * A . B` `[in..., out...]` float32 (the kernel update of a merge). Raises without LoRA."""
        if self.lora_a is None:
            raise ValueError("this Linear has no LoRA adapter")
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        return self.lora_scale * jnp.tensordot(a, b, axes=1)

    def merged_kernel(self) -> jax.Array:
        """The kernel with the adapter folded in, `W + (alpha / r) A . B` (computed in float32, returned in the
        kernel's dtype); the plain kernel without an adapter or with `lora_enabled = False`."""
        w = self.kernel[...]
        if self.lora_a is None or not self.lora_enabled:
            return w
        return (w.astype(jnp.float32) + self.lora_delta()).astype(w.dtype)

    # ---------------------------------------------------------------- forward
    def __call__(self, x: jax.Array) -> jax.Array:
        y = _dot(self.spec, x, self.kernel[...], self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_a is not None and self.lora_enabled:
            spec_a, spec_b = self.lora_specs
            h = _dot(spec_a, x, self.lora_a[...], self.dtype)
            y = y + (_dot(spec_b, h, self.lora_b[...], self.dtype) * self.lora_scale).astype(self.dtype)
        return y
