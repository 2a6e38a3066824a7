"""The one table of batch keys: every array a training step's host batch carries, with its shape, dtype and meaning.

Shape letters: B rows (prompts x rollout.n), P prompt length, R response length, T = P + R, K
`distillation.distillation_loss.topk`, M MoE layers and k experts per token (`num_experts_per_tok`). Response
fields are
right-aligned with `responses`: position t of a `[B, R]` field belongs to response token t.

The key tuples below (which keys each jit boundary takes) are the only lists of batch keys in the package: the
forward, the actor and critic updates, padded and packed, select their inputs with them.

Two masks, two meanings (verl's agent loop keeps them apart too):
  * `response_attention_mask`: the response tokens that exist (attention, positions, decoding, lengths);
  * `loss_mask`: the tokens the policy wrote and is trained on (verl's agent-loop `response_mask`): 0 for
    tool / observation / template tokens and padding. Losses, KL (in reward and in loss), entropy, GAE and
    returns, rollout correction and advantage statistics read it. In a single-turn rollout both are equal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchKey:
    """One batch field: `name`, `shape` (shape letters), `dtype`, who writes it (`source`) and what it means."""

    name: str
    shape: str
    dtype: str
    source: str
    meaning: str


BATCH_KEYS: dict[str, BatchKey] = {
    k.name: k
    for k in (
        BatchKey("prompts", "[B, P]", "int32", "rollout", "prompt token ids, left-padded"),
        BatchKey("responses", "[B, R]", "int32", "rollout", "response token ids (model and tool tokens), pad after"),
        BatchKey("input_ids", "[B, T]", "int32", "rollout", "prompts ++ responses"),
        BatchKey("attention_mask", "[B, T]", "int32", "rollout", "1 = a real token, prompt or response"),
        BatchKey("position_ids", "[B, T]", "int32", "rollout", "positions; responses continue the prompt's"),
        BatchKey("response_attention_mask", "[B, R]", "int32", "rollout", "1 = the response token exists"),
        BatchKey("loss_mask", "[B, R]", "int32", "rollout", "1 = a token the policy wrote, trained on"),
        BatchKey("rollout_log_probs", "[B, R]", "float32", "rollout", "sampler's log-probs of the model tokens"),
        BatchKey("sampling_logit_threshold", "[B, R]", "float32", "rollout", "top-k/p cut of each step (replay)"),
        BatchKey("truncated", "[B]", "bool", "rollout", "no EOS within R"),
        BatchKey("rollout_versions", "[B, R]", "int32", "async queue", "policy version that sampled each token"),
        BatchKey(
            "routed_experts",
            "[B, T, M, k] | [n, rows, L, M, k]",
            "uint8 | int16",
            "rollout (R3) / old-log-prob forward (R2)",
            "experts of each token per MoE layer, forced in the actor's forwards (actor.router_replay); packed: "
            "aligned with the packed input_ids",
        ),
        BatchKey("token_level_scores", "[B, R]", "float32", "reward", "score on the last model token"),
        BatchKey("reward_baselines", "[B]", "float32", "reward", "ReMax greedy baseline score"),
        BatchKey("old_log_probs", "[B, R]", "float32", "actor forward", "behaviour policy log-probs"),
        BatchKey("ref_log_prob", "[B, R]", "float32", "reference forward", "reference policy log-probs"),
        BatchKey("teacher_log_prob", "[B, R]", "float32", "teacher forward", "distillation teacher's log-probs"),
        BatchKey("teacher_topk_log_probs", "[B, R, K]", "float32", "teacher forward", "teacher's top-k log-probs"),
        BatchKey("teacher_topk_ids", "[B, R, K]", "int32", "teacher forward", "ids of the teacher's top-k tokens"),
        BatchKey("values", "[B, R]", "float32", "critic forward", "critic values at rollout time"),
        BatchKey("rollout_is_weights", "[B, R]", "float32", "rollout correction", "truncated IS weights"),
        BatchKey("token_level_rewards", "[B, R]", "float32", "advantage", "scores minus KL penalty (KL in reward)"),
        BatchKey("advantages", "[B, R]", "float32", "advantage", "per-token advantages (0 outside loss_mask)"),
        BatchKey("returns", "[B, R]", "float32", "advantage", "value targets (0 outside loss_mask)"),
        # the packed layout (engine/packing.py; n micro-batches, S sequence / Q response slots, L row length);
        # its `input_ids` are `[n, rows, L]` rows of real tokens
        BatchKey("segment_ids", "[n, rows, L]", "int32", "packer", "1, 2, ... per sequence in a row; 0 = padding"),
        BatchKey("positions", "[n, rows, L]", "int32", "packer", "position of each token within its sequence"),
        BatchKey(
            "slot_pos",
            "[n, Q] | [n, G, Q/G]",
            "int32",
            "packer",
            "flat row index of the state predicting a response token (G > 1: per row shard, shard-local)",
        ),
        BatchKey("slot_tokens", "[n, Q]", "int32", "packer", "the response token of each slot"),
        BatchKey("seq_slot", "[n, S, R]", "int32", "packer", "slot of each sequence's response token (-1 = none)"),
        BatchKey("seq_index", "[n, S]", "int32", "packer", "mini-batch row of each sequence slot (-1 = empty)"),
        BatchKey("slot_threshold", "[n, Q]", "float32", "packer", "sampling_logit_threshold per slot (replay)"),
    )
}

# [B, T] token fields: the packer (engine/packing.py) replaces them by packed rows.
TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids")
# the forward (log-probs of actor / reference, critic values)
FORWARD_KEYS = (*TOKEN_KEYS, "responses", "sampling_logit_threshold")
# per-token routing replay inputs of the actor's forwards only (actor.router_replay; never the reference, teacher or
# critic: other models); the packer packs them like input_ids
REPLAY_KEYS = ("routed_experts",)
# [B, R] per-response fields of the actor / critic update (packed: gathered on device by sequence index)
ACTOR_RESPONSE_KEYS = (
    "loss_mask",
    "advantages",
    "old_log_probs",
    "ref_log_prob",
    "teacher_log_prob",
    "teacher_topk_log_probs",
    "teacher_topk_ids",
    "rollout_log_probs",
    "rollout_is_weights",
)
CRITIC_RESPONSE_KEYS = ("loss_mask", "values", "returns")
# the packed layout's token fields (replace TOKEN_KEYS), and its optional ones (rollout.sampling_mask_replay)
PACK_KEYS = ("input_ids", "segment_ids", "positions", "slot_pos", "slot_tokens", "seq_slot", "seq_index")
OPTIONAL_PACK_KEYS = ("slot_threshold",)
# the padded updates' inputs
ACTOR_UPDATE_KEYS = (*FORWARD_KEYS, *REPLAY_KEYS, *ACTOR_RESPONSE_KEYS)
CRITIC_UPDATE_KEYS = (*TOKEN_KEYS, "responses", *CRITIC_RESPONSE_KEYS)


def describe(name: str) -> BatchKey:
    """The table entry of `name`. Raises KeyError listing the known keys."""
    if name not in BATCH_KEYS:
        raise KeyError(f"unknown batch key {name!r}; known: {sorted(BATCH_KEYS)}")
    return BATCH_KEYS[name]


def _check_table() -> None:
    for group in (FORWARD_KEYS, REPLAY_KEYS, ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, PACK_KEYS, OPTIONAL_PACK_KEYS):
        for k in group:
            describe(k)


_check_table()
