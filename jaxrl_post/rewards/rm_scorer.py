"""Reward-model scoring of rollout trajectories: verl's reward-model worker (`compute_rm_score`) as one
frozen role with a jitted forward.

`RewardModelScorer(data) -> rm_scores [B] float32`: the `RewardModel`'s score at each trajectory's last
real token (prompt + response, as the policy saw it). When the reward model reads another tokenizer than
the policy (a different vocabulary or chat template), every trajectory is decoded and re-rendered with
the RM tokenizer's chat template, as verl's `_switch_chat_template` does: the row's chat messages
(`raw_prompt`) plus one assistant message holding the decoded response (special tokens skipped). A
re-rendered sequence longer than `max_length` keeps its last `max_length` tokens (the end is the token the
RM reads; verl cuts on the right by default) and is counted in `reward_model/num_truncated`.

The forward runs on the mesh: params in the RM's own dtype, sharded by their logical names; rows padded
to a multiple of `micro_batch_size x` the data-parallel size and split over ('data', 'fsdp', 'expert'), micro-batches
of `micro_batch_size` rows per device run by `lax.map`. One compiled program per run (fixed `[N, T]`).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.models.reward_model import RewardModel
from jaxrl_post.runtime.sharding import InMesh, batch_shards, shard_batch, shard_params

log = logging.getLogger(__name__)

__all__ = ["RewardModelScorer", "same_tokenization"]


def same_tokenization(rm_tokenizer, policy_tokenizer) -> bool:
    """Whether the policy's token ids can be fed to the RM as they are: no RM tokenizer (None), or the
    same vocabulary and chat template."""
    if rm_tokenizer is None:
        return True
    return rm_tokenizer.get_vocab() == policy_tokenizer.get_vocab() and getattr(
        rm_tokenizer, "chat_template", None
    ) == getattr(policy_tokenizer, "chat_template", None)


class RewardModelScorer:
    """Frozen reward-model role (see the module docstring).

    Args:
      model: the `RewardModel` (params in the dtype it should run in; they are not trained).
      policy_tokenizer: decodes the policy's responses (re-rendering only).
      rm_tokenizer: the RM's tokenizer; None or `same_tokenization` -> the policy's ids are scored as they are.
      micro_batch_size: rows per device per forward micro-batch (verl: `micro_batch_size_per_gpu`).
      mesh: device mesh (None: one device).
      max_length: token budget of re-rendered sequences (None: the batch's `input_ids` width).
    Raises ValueError: micro_batch_size < 1; the policy's vocabulary is larger than the RM's while sharing
      token ids.
    """

    def __init__(
        self,
        model: RewardModel,
        policy_tokenizer: Any,
        *,
        rm_tokenizer: Any = None,
        micro_batch_size: int = 8,
        mesh=None,
        max_length: int | None = None,
    ):
        if int(micro_batch_size) < 1:
            raise ValueError(f"reward_model.micro_batch_size must be >= 1, got {micro_batch_size}")
        self.rerender = not same_tokenization(rm_tokenizer, policy_tokenizer)
        if not self.rerender and len(policy_tokenizer) > model.config.vocab_size:
            raise ValueError(
                f"reward model vocabulary ({model.config.vocab_size}) is smaller than the policy tokenizer's "
                f"({len(policy_tokenizer)}) and the RM has no tokenizer of its own to re-render with"
            )
        self.policy_tokenizer, self.rm_tokenizer = policy_tokenizer, rm_tokenizer
        self.max_length = max_length
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        dp = 1
        if self.mesh is not None:
            dp = batch_shards(self.mesh)
        self.micro, self.rows_multiple = int(micro_batch_size), int(micro_batch_size) * dp
        graphdef, params = nnx.split(model)
        if self.mesh is not None:
            params = shard_params(params, self.mesh)
        self.params = params
        self.trace_count = 0
        micro = self.micro * dp

        def forward(params, ids, mask):
            self.trace_count += 1
            rm = nnx.merge(graphdef, params)
            n = ids.shape[0] // micro
            split = lambda x: x.reshape(n, micro, *x.shape[1:])
            out = jax.lax.map(lambda a: rm(a[0], a[1]), (split(ids), split(mask)))
            return out.reshape(-1)

        self._forward = InMesh(jax.jit(forward), self.mesh)
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------
    def rm_inputs(self, data) -> tuple[np.ndarray, np.ndarray, int]:
        """`(input_ids [B, T] int32, attention_mask [B, T] int32, num_truncated)` the RM reads for `data`
        (a rollout DataProto: `input_ids`, `attention_mask`; re-rendering also `responses`,
        `response_attention_mask` and non-tensor `raw_prompt`). Raises KeyError when one is missing."""
        batch = data.batch
        if not self.rerender:
            return np.asarray(batch["input_ids"], np.int32), np.asarray(batch["attention_mask"], np.int32), 0
        if "raw_prompt" not in data.non_tensor_batch:
            raise KeyError("re-rendering for the reward model's tokenizer needs non_tensor_batch['raw_prompt']")
        responses = np.asarray(batch["responses"])
        exists = np.asarray(batch["response_attention_mask"]).astype(bool)
        texts = self.policy_tokenizer.batch_decode(
            [responses[i][exists[i]].tolist() for i in range(len(responses))], skip_special_tokens=True
        )
        width = int(self.max_length or np.asarray(batch["input_ids"]).shape[1])
        pad = self.rm_tokenizer.pad_token_id
        pad = 0 if pad is None else int(pad)
        ids = np.full((len(texts), width), pad, np.int32)
        mask = np.zeros((len(texts), width), np.int32)
        n_trunc = 0
        for i, (prompt, text) in enumerate(zip(data.non_tensor_batch["raw_prompt"], texts)):
            chat = [*list(prompt), {"role": "assistant", "content": text}]
            rendered = self.rm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
            toks = self.rm_tokenizer(rendered, add_special_tokens=False)["input_ids"]
            if len(toks) > width:
                toks, n_trunc = toks[-width:], n_trunc + 1
            ids[i, : len(toks)], mask[i, : len(toks)] = toks, 1  # right padding
        return ids, mask, n_trunc

    def __call__(self, data) -> np.ndarray:
        """`rm_scores [B] float32` for the rows of `data`; sets `last_metrics` (`reward_model/num_truncated`)."""
        ids, mask, n_trunc = self.rm_inputs(data)
        b = ids.shape[0]
        pad = (-b) % self.rows_multiple
        if pad:  # padding rows: copies of row 0, dropped below
            ids, mask = (
                np.concatenate([ids, np.repeat(ids[:1], pad, 0)]),
                np.concatenate([mask, np.repeat(mask[:1], pad, 0)]),
            )
        if self.mesh is not None:
            args = shard_batch({"ids": ids, "mask": mask}, self.mesh)
            ids_d, mask_d = args["ids"], args["mask"]
        else:
            ids_d, mask_d = jnp.asarray(ids), jnp.asarray(mask)
        out = np.asarray(jax.device_get(self._forward(self.params, ids_d, mask_d)), np.float32)[:b]
        self.last_metrics = {"reward_model/num_truncated": float(n_trunc)} if self.rerender else {}
        return out

    def compile_count(self) -> int:
        return self._forward._cache_size()
