"""One decoder-only transformer (Flax NNX) for Llama, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 and the MoE families.

Families differ only by `ModelConfig` fields. Layout follows HF transformers (rotate-half RoPE, GQA where
query head h uses kv head h // (H / Hkv)), so HF checkpoints map 1:1 (see hf_io.py).

Shape letters: B batch, T new tokens, S key/cache slots, D width, H query heads, N kv heads, G = H / N,
K head dim, F mlp width, V vocab, L layers.
Params carry logical axis names (`out_sharding` metadata) mapped to mesh axes by `jaxrl_post.runtime.sharding`.
Every q/k/v/o/gate/up/down projection is a `linear.Linear` (weight `<proj>.kernel`, bias, optional LoRA);
param init, RMSNorm, RoPE and the dense MLP live in layers.py, the MoE block in moe.py, the residual block and the
layer scan in block.py.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models import attention as fused
from jaxrl_post.models.attention import SEGMENT_SUB_BITS, segment_mask
from jaxrl_post.models.block import Block, layer_period, run_block, scan_blocks
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.kv_cache import KVCache, per_row_index, write_slots, write_slots_per_row
from jaxrl_post.models.layers import (
    ParamInit,
    RMSNorm,
    _constrain,
    _rope_angles,
    apply_rope,
    positions_from_mask,
    rope_attention_factor,
)
from jaxrl_post.models.linear import Linear
from jaxrl_post.models.lm_head import model_logits, model_token_stats
from jaxrl_post.models.moe import collect, layer_routes

_NEG = float(np.finfo(np.float32).min)
# Dense attention without a cache (training / scoring forwards) over rows longer than CAUSAL_BLOCK tokens runs
# in at most MAX_CAUSAL_BLOCKS causal query blocks of >= CAUSAL_BLOCK tokens (`Attention.__call__`).
CAUSAL_BLOCK = 256
MAX_CAUSAL_BLOCKS = 8


class Attention(nnx.Module):
    """GQA self-attention: RoPE, q/k/v/o biases, q/k RMSNorm, soft-cap, sliding window, sinks `[H]` (GPT-OSS)."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, init: ParamInit):
        d, h, n, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dtype = dtype  # no per-layer Python attribute: layers of one scan period share a graphdef
        self.num_heads, self.num_kv_heads, self.head_dim = h, n, k
        self.rope_base, rope_scaling = cfg.layer_rope(layer)
        self.rope_scaling = tuple(sorted(rope_scaling.items()))
        self.max_pos = cfg.max_position_embeddings
        self.scale = (cfg.query_pre_attn_scalar or k) ** -0.5 * rope_attention_factor(rope_scaling, self.max_pos) ** 2
        self.softcap = cfg.attn_logit_softcap
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        qkv = {"q": (h, "heads"), "k": (n, "kv_heads"), "v": (n, "kv_heads")}  # creation order fixes init
        w = {m: init.normal((d, heads, k), ("embed", ax, "head_dim")) for m, (heads, ax) in qkv.items()}
        o = init.normal((h, k, d), ("heads", "head_dim", "embed"))
        bias = {m: init.const((heads, k), (ax, "head_dim")) if cfg.qkv_bias else None for m, (heads, ax) in qkv.items()}
        self.q_proj = Linear("BTD,DNK->BTNK", w["q"], bias["q"], dtype=dtype)
        self.k_proj = Linear("BTD,DNK->BTNK", w["k"], bias["k"], dtype=dtype)
        self.v_proj = Linear("BTD,DNK->BTNK", w["v"], bias["v"], dtype=dtype)
        self.o_proj = Linear("BTHK,HKD->BTD", o, init.const((d,), ("embed",)) if cfg.o_proj_bias else None, dtype=dtype)
        norm = partial(RMSNorm, k, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, names=("head_dim",), init=init)
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None
        self.sinks = init.normal((h,), ("heads",)) if cfg.attention_sinks else None
        self.attention_impl, self.attention_interpret = "xla", False  # `Transformer.set_attention_impl`

    def __call__(self, x, positions, kv_mask, index, kv=None, segment_ids=None):
        """x [B, T, D]; positions [B, T] int32; kv_mask [B, S] bool (valid key slots, S = T without a cache);
        index: slot of x[:, 0] (int32 scalar or Python int, or [B] int32 per row); kv: optional (k segments
        [B, N, K, S_j], v segments [B, N, S_j, K]) of this layer's cache to write the new keys/values into;
        segment_ids: optional [B, T] int32 (packed rows, no cache): a key is visible only from its own
        segment or, as a shared prompt, from its responses (`segment_mask`); the sliding window then counts
        positions (= slots inside a contiguous segment).
        Without a cache, another backend (`attention_impl` 'cudnn' / 'splash' / 'chunked', models/attention.py) replaces
        the dense scores; under 'splash' shared-prompt segment ids (chunk >= 1) give NaN outputs (loud, not
        wrong numbers): splash sees equal ids only.
        Returns (y [B, T, D], kv updated or None)."""
        b, t, _ = x.shape
        n, g = self.num_kv_heads, self.num_heads // self.num_kv_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H, K], [B, T, N, K] x 2
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        angles = _rope_angles(positions, self.head_dim, self.rope_base, dict(self.rope_scaling), self.max_pos)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        keys = k.transpose(0, 2, 3, 1)  # [B, N, K, T]
        values = v.transpose(0, 2, 1, 3)  # [B, N, T, K]
        row = per_row_index(index)  # [B] write slots (multi-turn cache): every row has its own query slots
        if kv is not None:
            write = write_slots_per_row if row else write_slots
            kv = (write(kv[0], keys, index, axis=3), write(kv[1], values, index, axis=2))
            k_segs, v_segs = kv
        else:
            k_segs, v_segs = (keys,), (values,)
        s = kv_mask.shape[1]
        # [T, 1], or [B, T, 1] per row
        q_slot = index[:, None, None] + jnp.arange(t)[None, :, None] if row else index + jnp.arange(t)[:, None]
        kv_slot = jnp.arange(s)[None, :]  # [1, S]
        lead = (lambda a: a) if row else (lambda a: a[None])
        allowed = lead(kv_slot <= q_slot) & kv_mask[:, None, :]  # [B, T, S]
        if self.window is not None and segment_ids is None:  # HF: key is visible iff q_slot - window < kv_slot
            allowed &= lead(kv_slot > q_slot - self.window)
        if segment_ids is not None:
            allowed &= segment_mask(segment_ids)
            if self.window is not None:  # a packed sequence's distance is its positions' (shared prompts)
                allowed &= positions[:, None, :] > positions[:, :, None] - self.window

        if kv is None and self.attention_impl != "xla":  # fused kernels (models/attention.py); no cache
            if self.attention_impl == "chunked":
                out = fused.chunked_attention(
                    q, k, v, allowed, scale=self.scale, softcap=self.softcap, dtype=self.dtype, chunk=fused.CHUNK,
                    sinks=self._sinks(),
                )  # fmt: skip
            elif self.attention_impl == "cudnn":
                out = fused.dot_product_attention(
                    q, k, v, allowed, scale=self.scale, interpret=self.attention_interpret
                )
            else:
                ids = fused.padded_segment_ids(kv_mask) if segment_ids is None else segment_ids
                out = fused.splash_attention(
                    q,
                    k,
                    v,
                    ids,
                    scale=self.scale,
                    window=self.window,
                    softcap=self.softcap,
                    interpret=self.attention_interpret,
                )
                if segment_ids is not None:  # shared-prompt ids (chunk >= 1) need segment_mask: fail loudly
                    out = jnp.where(jnp.any(segment_ids >> SEGMENT_SUB_BITS > 0), jnp.nan, out)
            return self.o_proj(out), kv

        def attend(q, k_segs, v_segs, allowed):
            # Query heads of one kv head are folded into the row dim: [B, N, G*T, K] (head h = n * G + g).
            t, s = allowed.shape[1:]
            qg = q.reshape(b, t, n, g, self.head_dim).transpose(0, 2, 3, 1, 4).reshape(b, n, g * t, self.head_dim)
            # A cache wider than the compute dtype (float32 under bf16 compute, the CPU rollout default) is read
            # as it is: q and the probabilities are widened instead (exact), so no step copies the cache.
            att_dtype = jnp.promote_types(self.dtype, k_segs[0].dtype)
            qg = qg.astype(att_dtype)
            offsets = np.cumsum([0] + [seg.shape[-1] for seg in k_segs])
            visible = [jnp.any(allowed[:, :, lo:hi]) for lo, hi in zip(offsets[:-1], offsets[1:])]

            def skip_if_hidden(i, fn, shape, fill):
                if len(k_segs) == 1:
                    return fn()
                return jax.lax.cond(visible[i], fn, lambda: jnp.full(shape, fill, jnp.float32))

            scores = (
                jnp.concatenate(
                    [
                        skip_if_hidden(
                            i,
                            lambda kj=kj: jnp.einsum(
                                "BNQK,BNKS->BNQS", qg, kj.astype(att_dtype), preferred_element_type=jnp.float32
                            ),
                            (b, n, g * t, kj.shape[-1]),
                            _NEG,
                        )
                        for i, kj in enumerate(k_segs)
                    ],
                    axis=-1,
                )
                * self.scale
            )
            if self.softcap is not None:
                scores = jnp.tanh(scores / self.softcap) * self.softcap
            scores = scores.reshape(b, n, g, t, s)
            scores = jnp.where(allowed[:, None, None], scores, _NEG).reshape(b, n, g * t, s)
            sinks = self._sinks()  # [H] -> [1, N, G*T, 1], rows ordered (g, t) as qg's
            sinks = None if sinks is None else jnp.repeat(sinks.reshape(n, g), t, axis=1)[None, :, :, None]
            probs = fused.softmax_with_sinks(scores, sinks).astype(self.dtype).astype(att_dtype)
            out = None  # [B, N, G*T, K]
            for i, (vj, lo, hi) in enumerate(zip(v_segs, offsets[:-1], offsets[1:])):
                part = skip_if_hidden(
                    i,
                    lambda vj=vj, lo=lo, hi=hi: jnp.einsum(
                        "BNQS,BNSK->BNQK", probs[..., lo:hi], vj.astype(att_dtype), preferred_element_type=jnp.float32
                    ),
                    (b, n, g * t, self.head_dim),
                    0.0,
                )
                out = part if out is None else out + part
            out = out.astype(self.dtype).reshape(b, n, g, t, self.head_dim).transpose(0, 3, 1, 2, 4)
            return out

        # Training forwards (no cache) keep only q, k, v and the mask for the backward pass and recompute the
        # [B, N, G*T, S] scores / probabilities there (as flash attention does): a few % more FLOPs, and
        # ~3 score-sized float32 buffers per layer fewer (measured: 3.6 of 7.3 GB of a SmolLM2 update).
        if kv is None:
            attend = jax.checkpoint(attend)
        if kv is None and t > CAUSAL_BLOCK:
            # Causal blocks: query block [lo, hi) sees keys [0, hi) only (slot causality holds in every forward
            # without a cache, packed or padded), so the scores above the diagonal blocks are never made: ~5/8
            # of the dense scores at 4 blocks (exact: a hidden key's probability is exactly 0 in float32).
            c = -(-t // min(MAX_CAUSAL_BLOCKS, -(-t // CAUSAL_BLOCK)))
            parts = [
                attend(
                    q[:, lo : lo + c],
                    (keys[..., : lo + c],),
                    (values[:, :, : lo + c],),
                    allowed[:, lo : lo + c, : lo + c],
                )
                for lo in range(0, t, c)
            ]
            out = jnp.concatenate(parts, axis=1)
        else:
            out = attend(q, k_segs, v_segs, allowed)
        y = self.o_proj(out.reshape(b, t, self.num_heads, self.head_dim))
        return y, kv

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)


class Transformer(nnx.Module):
    """Decoder-only LM. `Transformer(config, *, rngs, dtype=None, param_dtype=None, remat=False, scan_layers=False)`.

    dtype: compute dtype (default config.dtype, float32); param_dtype: storage dtype (default
    config.param_dtype). remat: False, True (save nothing per layer) or the name of a
    `jax.checkpoint_policies` policy; applied per layer with `nnx.remat` (forward without a cache only).
    scan_layers: run the layers of a forward without a cache as a `lax.scan` over repeating groups
    (`block.scan_blocks`: traces one group instead of L layers); params stay one `Block` per layer, so
    checkpoints and HF/GGUF loading do not depend on it. The cached (rollout) path is unrolled. Off by
    default: measured on XLA:CPU (SmolLM2 shapes, 30 layers) the trace is ~6x faster but the XLA compile of
    fwd+bwd is ~1.7x slower, because the params are stacked inside the program on every call.
    attention_impl: 'xla' (dense) until `set_attention_impl`.
    """

    def __init__(
        self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=None, remat=False, scan_layers=False
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype or config.dtype)
        self.param_dtype = jnp.dtype(param_dtype or config.param_dtype)
        self.remat = remat
        self.scan_layers = scan_layers
        self.attention_impl = "xla"
        init = ParamInit(rngs.params(), self.param_dtype)  # one key; params salted by creation order
        self.embedding = init.normal((config.vocab_size, config.hidden_size), ("vocab", "embed"))
        layers, dt = [], self.dtype
        for i in range(config.num_layers):  # attention's params, then the MLP's (init salts follow creation order)
            layers.append(Block(config, i, Attention(config, i, dtype=dt, init=init), dtype=dt, init=init))
        self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, offset=config.norm_offset, names=("norm",), init=init
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else init.normal((config.hidden_size, config.vocab_size), ("embed", "vocab"))
        )

    def set_attention_impl(self, impl: str, *, interpret: bool = False) -> None:
        """Attention backend of forwards without a cache: 'xla' (dense, the default), 'cudnn', 'splash' or
        'chunked' (models/attention.py; pick one with `attention.resolve_attention_impl`). interpret: run the kernel's
        CPU-testable form ('cudnn': `jax.nn.dot_product_attention(implementation="xla")`, 'splash': Pallas
        interpret mode). Set before splitting the model (the choice is static, part of the graphdef).
        Raises ValueError: an unknown name, or 'cudnn' on a model with an attention logit soft-cap."""
        fused.check_kernel_supported(impl, softcap=self.config.attn_logit_softcap, sinks=self.config.attention_sinks)
        self.attention_impl = impl
        for block in self.layers:
            block.attn.attention_impl, block.attn.attention_interpret = impl, bool(interpret)

    # ------------------------------------------------------------------ cache
    def init_cache(self, batch_size: int, max_len: int, dtype=None, segment_len: int | None = None) -> KVCache:
        """Empty cache: per layer k zeros [B, N, K, S_j] and v zeros [B, N, S_j, K] segments (dtype default: the
        compute dtype), mask False [B, S=max_len], index the Python int 0.

        segment_len: slots per segment (the last one takes the remainder); None = one segment of S slots.
        Attention skips segments with no visible key, so for decoding ~S/8-slot segments make a step cost
        scale with the tokens written so far; one segment is best for a single full-length pass.
        Raises ValueError when segment_len < 1.
        """
        c = self.config
        b, n, k = batch_size, c.num_kv_heads, c.head_dim
        seg = max_len if segment_len is None else int(segment_len)
        if seg < 1:
            raise ValueError(f"segment_len must be >= 1, got {segment_len}")
        sizes = [seg] * (max_len // seg) + ([max_len % seg] if max_len % seg else [])
        dt = jnp.dtype(dtype or self.dtype)
        return KVCache(
            k=tuple(tuple(jnp.zeros((b, n, k, sj), dt) for sj in sizes) for _ in range(c.num_layers)),
            v=tuple(tuple(jnp.zeros((b, n, sj, k), dt) for sj in sizes) for _ in range(c.num_layers)),
            mask=jnp.zeros((b, max_len), bool),
            index=0,
        )

    # ---------------------------------------------------------------- forward
    def hidden_states(
        self,
        input_ids,
        attention_mask,
        positions=None,
        cache: KVCache | None = None,
        segment_ids=None,
        routed_experts=None,
        with_moe: bool = False,
    ):
        """Final-normed hidden states [B, T, D] (compute dtype); with a cache returns (hidden, new_cache).

        input_ids [B, T] int32; attention_mask [B, T] int/bool (1 = real token; left padding allowed);
        positions [B, T] int32 or None (derived per row from the mask and the cache's valid slots);
        segment_ids [B, T] int32 or None: packed rows (no cache only; `engine/packing.py`): several
        sequences per row, each a contiguous segment with its own positions, attention masked per segment
        (0 = padding; pass `attention_mask = segment_ids != 0`). Raises ValueError with a cache.
        routed_experts: forced MoE routes [B, T, M, k] int (M = len(config.moe_layers); routing replay,
        `models/moe.py`); raises ValueError on another shape. with_moe: also return the routing, as
        `(out, moe.MoEOutput)` (None for a dense model).
        """
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed rows) are only supported without a KV cache")
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.asarray(attention_mask).astype(bool)
        _b, t = input_ids.shape
        if cache is None:
            index, kv_mask, prior = 0, mask, 0
        else:
            index = cache.index
            s = cache.mask.shape[1]
            row = per_row_index(index)
            prior = jnp.sum(cache.mask & (jnp.arange(s)[None] < (index[:, None] if row else index)), axis=1)
            kv_mask = (write_slots_per_row if row else write_slots)((cache.mask,), mask, index, axis=1)[0]
            new_k, new_v = list(cache.k), list(cache.v)
        if positions is None:
            positions = positions_from_mask(mask, prior)
        positions = jnp.asarray(positions, jnp.int32)
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids, jnp.int32)

        x = jnp.take(self.embedding[...], input_ids, axis=0).astype(self.dtype)
        if self.config.embed_scale:
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype)
        x = _constrain(x, ("batch", None, None))

        run = run_block
        if self.remat and cache is None:
            policy = None if self.remat is True else getattr(jax.checkpoint_policies, self.remat)
            run = nnx.remat(run_block, policy=policy)
        routes = layer_routes(self.config, routed_experts, input_ids.shape)
        if cache is None and self.scan_layers:
            p = layer_period(self.config)
            x, stats = scan_blocks(self.layers, p, run, x, positions, kv_mask, index, segment_ids, mask, routes)
        else:
            stats = [None] * len(self.layers)
            for i, block in enumerate(self.layers):
                if cache is None:
                    x, stats[i] = run(block, x, positions, kv_mask, index, segment_ids, (mask, routes[i]))
                else:
                    kv, moe_in = (new_k[i], new_v[i]), (mask, routes[i])
                    x, (new_k[i], new_v[i]), stats[i] = block(x, positions, kv_mask, index, kv, moe_in=moe_in)
        h = self.final_norm(x)
        out = h if cache is None else (h, KVCache(k=tuple(new_k), v=tuple(new_v), mask=kv_mask, index=cache.index + t))
        if not with_moe:
            return out
        moe = [s for s in stats if s is not None]
        return out, (collect(moe, mask, self.config.num_experts) if moe else None)

    def logits_from_hidden(self, h: jax.Array) -> jax.Array:
        """[B, T, D] -> logits [B, T, V] float32 (tied or untied head, final soft-cap; `lm_head.model_logits`)."""
        return model_logits(self, h)

    def token_stats_from_hidden(self, h, labels, n_valid, temperature=1.0, entropy="metric", chunk=512, **kw):
        """(log-probs `[Q]`, entropy `[Q]` or None) float32 of `labels [Q]` from `h [Q, D]`, chunked; see
        `lm_head.model_token_stats` (keyword `in_loop_with`)."""
        return model_token_stats(self, h, labels, n_valid, temperature, entropy, chunk, **kw)

    def __call__(
        self,
        input_ids,
        attention_mask,
        positions=None,
        cache: KVCache | None = None,
        logits_to_keep: int | None = None,
        segment_ids=None,
        routed_experts=None,
        with_moe: bool = False,
    ):
        """Logits [B, T, V] float32 (or (logits, new_cache) when a cache is given).

        logits_to_keep: if set, only the last that many positions' logits are computed ([B, n, V]).
        segment_ids, routed_experts, with_moe: see `hidden_states` (with_moe: `(out, MoEOutput | None)`).
        """
        out = self.hidden_states(input_ids, attention_mask, positions, cache, segment_ids, routed_experts, with_moe)
        out, moe = out if with_moe else (out, None)
        h, new_cache = (out, None) if cache is None else out
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.logits_from_hidden(h)
        out = logits if cache is None else (logits, new_cache)
        return (out, moe) if with_moe else out
