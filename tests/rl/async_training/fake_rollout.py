"""A model-free stand-in for `RolloutRole` (tests of the asynchronous schedule): every response token of a
generation batch records the prompt's id, and the rollout's "weights" are its `version`, so the tests see which
prompt and which weights every trained row came from."""

from __future__ import annotations

import types

import numpy as np

from jaxrl_post.batch.protocol import DataProto

R = 3  # response length


def prompt_batches(batch: int, start: int = 0):
    """An endless loader of prompt batches: prompt ids start, start + 1, ... (`input_ids [batch, 2]`)."""
    i = start
    while True:
        ids = np.arange(i, i + batch, dtype=np.int32)
        yield DataProto.from_dict(
            {"input_ids": np.stack([ids, ids], 1), "attention_mask": np.ones((batch, 2), np.int32)},
            {"pid": ids.astype(object)},
        )
        i += batch


class FakeRollout:
    """`generate_and_score` as `RolloutRole`'s: `responses [B, R]` = the prompt id, `rollout_log_probs` = -seed
    fraction, `token_level_scores` = the weights' version; `version` is what `publish` would copy."""

    def __init__(self, n: int):
        self.n = n
        self.version = 0
        self.calls: list[tuple[list[int], int, int]] = []  # (prompt ids, seed, version) per generation batch

    def generate_and_score(self, prompts, seed, timing, reward_fn):
        pid = np.asarray(prompts.non_tensor_batch["pid"], np.int64)
        self.calls.append((pid.tolist(), int(seed), self.version))
        rows = np.repeat(pid, self.n)
        b = {
            "responses": np.repeat(rows[:, None], R, 1).astype(np.int32),
            "response_attention_mask": np.ones((len(rows), R), np.int32),
            "rollout_log_probs": np.full((len(rows), R), -(seed % 1000) / 1000.0, np.float32),
            "token_level_scores": np.full((len(rows), R), float(self.version), np.float32),
        }
        nt = {"pid": rows.astype(object), "uid": np.array([f"u{p}" for p in rows], dtype=object)}
        return b, nt, types.SimpleNamespace(metrics={"reward/version": float(self.version)})

    def close(self):
        """Nothing to release (`RolloutRole.close` stops the agent loop's tools)."""
