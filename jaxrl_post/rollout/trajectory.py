"""A multi-turn trajectory while it is rolled out (`_Traj`), the rollout's output batch (`assemble`) and its
step metrics (`rollout_metrics`); see `agent_loop`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.data.pipeline import compute_position_ids, left_pad


@dataclasses.dataclass
class _Traj:
    env: Any
    messages: list[dict]
    text: str
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    loss: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    done: bool = False
    cached: int = 0  # prefix caching: tokens of prompt_ids + ids in the turn cache
    truncated: bool = False
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    turn_scores: list[float] = dataclasses.field(default_factory=list)
    tool_rewards: list[float] = dataclasses.field(default_factory=list)


def assemble(rows: DataProto, trajs: list[_Traj], p: int, r: int, params) -> DataProto:
    """The rollout's output (`AgentLoop.generate`'s keys and shapes): prompts left-padded to `p`, each
    trajectory's tokens right-padded to `r`, and its counts in the non-tensor batch and `extra_info`."""

    b = len(trajs)
    prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajs], p, params.pad_token_id)
    resp = np.full((b, r), params.pad_token_id, np.int32)
    exists = np.zeros((b, r), np.int32)
    loss = np.zeros((b, r), np.int32)
    logp = np.zeros((b, r), np.float32)
    for i, t in enumerate(trajs):
        k = len(t.ids)
        resp[i, :k], exists[i, :k], loss[i, :k], logp[i, :k] = t.ids, 1, t.loss, t.logp
    ppos = compute_position_ids(prompt_mask)
    rpos = ppos[:, -1:] + np.arange(1, r + 1, dtype=np.int32)[None]
    batch = {
        "prompts": prompt_ids,
        "responses": resp,
        "input_ids": np.concatenate([prompt_ids, resp], axis=1),
        "attention_mask": np.concatenate([prompt_mask, exists], axis=1),
        "position_ids": np.concatenate([ppos, rpos], axis=1),
        "response_attention_mask": exists,
        "loss_mask": loss,
        "rollout_log_probs": logp,
        "sampling_logit_threshold": np.full((b, r), -np.inf, np.float32),
        "truncated": np.asarray([t.truncated for t in trajs], bool),
    }
    nt = dict(rows.non_tensor_batch)
    nt["num_turns"] = np.asarray([t.assistant_turns + t.user_turns for t in trajs], np.int32)
    nt["tool_calls"] = np.asarray([t.tool_calls for t in trajs], np.int32)
    nt["tool_errors"] = np.asarray([t.tool_errors for t in trajs], np.int32)
    nt["turn_scores"] = _object_array([list(t.turn_scores) for t in trajs])
    nt["tool_rewards"] = _object_array([list(t.tool_rewards) for t in trajs])
    infos = list(nt["extra_info"]) if "extra_info" in nt else [None] * b
    new_infos = []
    for info, t in zip(infos, trajs):
        d = dict(info) if isinstance(info, Mapping) else {}
        d.update(turn_scores=list(t.turn_scores), tool_rewards=list(t.tool_rewards))
        d.update(num_turns=t.assistant_turns + t.user_turns, tool_calls=t.tool_calls)
        new_infos.append(d)
    nt["extra_info"] = _object_array(new_infos)
    return DataProto(batch, nt, dict(rows.meta_info))


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty((len(values),), object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def rollout_metrics(out: DataProto, stats: Mapping[str, float]) -> dict[str, float]:
    """Step metrics of a multi-turn rollout: `num_turns/{mean,min,max}` (verl), `tool_calls/mean` (per
    trajectory), `tool/errors`, `tool/format_errors`, `tool/timeouts` (counts in the step), and
    `response/observation_fraction` (observation tokens / existing response tokens)."""
    turns = np.asarray(out.non_tensor_batch["num_turns"], np.float64)
    exists = np.asarray(out.batch["response_attention_mask"]).astype(bool)
    loss = np.asarray(out.batch["loss_mask"]).astype(bool)
    return {
        "num_turns/mean": float(turns.mean()),
        "num_turns/min": float(turns.min()),
        "num_turns/max": float(turns.max()),
        "tool_calls/mean": float(np.mean(np.asarray(out.non_tensor_batch["tool_calls"], np.float64))),
        "tool/errors": float(stats.get("tool_errors", 0)),
        "tool/format_errors": float(stats.get("tool_format_errors", 0)),
        "tool/timeouts": float(stats.get("tool_timeouts", 0)),
        "response/observation_fraction": float((exists & ~loss).sum() / max(1, exists.sum())),
    }
