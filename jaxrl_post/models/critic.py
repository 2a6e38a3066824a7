"""verl's critic: the decoder backbone plus a scalar value head per token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.decoder import Transformer
from jaxrl_post.models.scalar_head import head_param, headless_backbone, scalar_head


class CriticModel(nnx.Module):
    """Value model: `Transformer` backbone (final-normed hidden states) -> Linear(D, 1) in float32.

    `critic(input_ids [B, T] int32, attention_mask [B, T], positions=None) -> values [B, T] float32`.
    The head is zero-initialized (values start at 0; its gradient is the hidden state, so it learns).
    An untied LM head is dropped from the backbone (unused by the critic).
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
            "CriticModel", config, backbone, rngs=rngs, dtype=dtype, param_dtype=param_dtype, remat=remat
        )
        self.backbone = backbone
        self.config = backbone.config
        d = backbone.config.hidden_size
        self.value_head = head_param(d)
        self.value_bias = nnx.Param(jnp.zeros((1,), jnp.float32), out_sharding=(None,), eager_sharding=False)

    @classmethod
    def from_actor(cls, model: Transformer, rngs: nnx.Rngs | None = None) -> CriticModel:
        """Critic whose backbone is a copy of the actor's params (the actor is left untouched)."""
        return cls(rngs=rngs or nnx.Rngs(0), backbone=nnx.clone(model))

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, positions=None, segment_ids=None) -> jax.Array:
        """values [B, T] float32; `segment_ids` [B, T] int32: packed rows (see `Transformer.hidden_states`)."""
        h = self.backbone.hidden_states(input_ids, attention_mask, positions, segment_ids=segment_ids)
        return scalar_head(h, self.value_head[...], self.value_bias[...])
