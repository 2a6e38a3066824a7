"""Reward model: the decoder backbone plus a scalar `score` head read at each sequence's last real token.

The same model as transformers' `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification` /
... with `num_labels=1`: `score = Linear(D, 1, bias=False)` on the final-normed hidden states, pooled at the
last non-pad token: the rightmost token with `attention_mask == 1` and `input_ids != pad_token_id`
(transformers' rule; with the common pad = eos choice a final eos is skipped, as in transformers, so scores
match an RM trained or used there). Packed rows (`segment_ids`) give one score per segment, at its last
token. HF checkpoints load/save through `models/hf_io.py` (`load_reward_model`,
`save_reward_model`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.decoder import SEGMENT_SUB_BITS, Transformer
from jaxrl_post.models.scalar_head import head_param, headless_backbone, scalar_head

# family -> HF sequence-classification class (written into config.json `architectures`)
HF_SEQ_CLS_ARCH = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3": "Gemma3TextForSequenceClassification",
}


def last_token_index(attention_mask: jax.Array) -> jax.Array:
    """`[B] int32`: index of each row's rightmost real token (`attention_mask [B, T]` != 0; works for left
    and right padding, as transformers' `*ForSequenceClassification` pooling); 0 for a row with none."""
    m = jnp.asarray(attention_mask) != 0
    t = m.shape[1]
    return jnp.max(jnp.where(m, jnp.arange(t)[None, :], 0), axis=1).astype(jnp.int32)


def segment_end_mask(segment_ids: jax.Array) -> jax.Array:
    """`[B, T] bool`: True at the last token of each packed sequence (`segment_ids [B, T] int32`, 0 =
    padding; `engine/packing.py` ids). A shared prompt's segment (sub id 0 of chunk >= 1) ends no sequence:
    its responses' ends are the scored tokens."""
    s = jnp.asarray(segment_ids, jnp.int32)
    nxt = jnp.concatenate([s[:, 1:], jnp.zeros_like(s[:, :1])], axis=1)
    sub = s & ((1 << SEGMENT_SUB_BITS) - 1)
    return (s != 0) & (nxt != s) & (sub != 0)


class RewardModel(nnx.Module):
    """`Transformer` backbone (final-normed hidden states; no LM head) -> `score` `[D, 1]` float32, no bias.

    `RewardModel(config, *, rngs, dtype=None, param_dtype=None, remat=False, backbone=None)`;
    `pad_token_id` (default `config.pad_token_id`; None: only the mask counts) is the id the pooling skips. The head is
    initialised normal(0, 0.02), transformers' default `initializer_range` (`backbone`: reuse a
    `Transformer`, e.g. a policy's params, whose LM head is dropped). Raises ValueError with neither a
    config nor a backbone.
    """

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=None,
        remat=False,
        backbone: Transformer | None = None,
    ):
        backbone = headless_backbone(
            "RewardModel", config, backbone, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat
        )
        self.backbone = backbone
        self.config = backbone.config
        self.score = head_param(backbone.config.hidden_size, stddev=0.02, key=rngs.params())
        self.pad_token_id = backbone.config.pad_token_id

    @classmethod
    def from_backbone(cls, model: Transformer, rngs: nnx.Rngs | None = None) -> RewardModel:
        """Reward model whose backbone is a copy of `model`'s params (`model` is left untouched)."""
        return cls(rngs=rngs or nnx.Rngs(0), backbone=nnx.clone(model))

    def train_score_with_adapters(self) -> None:
        """LoRA: make the `score` head trainable beside the adapters (PEFT `modules_to_save=["score"]`, as TRL
        trains reward models): it becomes an `nnx.LoRAParam`, so `nnx.state(model, nnx.LoRAParam)` holds it."""
        self.score = nnx.LoRAParam(self.score.get_value(), out_sharding=("embed", None), eager_sharding=False)

    def token_scores(self, input_ids, attention_mask, positions=None, segment_ids=None) -> jax.Array:
        """The head at every token: `[B, T] float32` (inputs as `Transformer.hidden_states`)."""
        h = self.backbone.hidden_states(input_ids, attention_mask, positions, segment_ids=segment_ids)
        return scalar_head(h, self.score[...])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, positions=None) -> jax.Array:
        """Rewards `[B] float32`: the score at each row's last real non-pad token (`pad_token_id`).

        input_ids `[B, T] int32`; attention_mask `[B, T]` (1 = real token; left or right padding);
        positions `[B, T] int32` or None (from the mask: `decoder.positions_from_mask`)."""
        scores = self.token_scores(input_ids, attention_mask, positions)
        valid = jnp.asarray(attention_mask) != 0
        if self.pad_token_id is not None:
            valid &= jnp.asarray(input_ids) != self.pad_token_id
        idx = last_token_index(valid)
        return jnp.take_along_axis(scores, idx[:, None], axis=1)[:, 0]
