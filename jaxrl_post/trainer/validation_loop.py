"""The validation loop behind `RLTrainer.validate`: generate on the held-out set, score, aggregate.

Host-side orchestration (generation and reward calls); the metrics themselves are validation.py's.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxrl_post.trainer.progress import progress_bar
from jaxrl_post.trainer.validation import extract_answer, process_validation_metrics


def run_validation(
    config: Any, val_loader: Any, generator: Any, reward_fn: Any, sampling_params: Any
) -> dict[str, float]:
    """Generate on every batch of `val_loader` (each prompt `rollout.val_kwargs.n` times, padded to a fixed
    shape), score with `reward_fn` and return the validation metrics described in `RLTrainer.validate`.

    Args:
      config: the job ConfigDict (`rollout.val_kwargs.n`, `trainer.progress_bar`).
      val_loader: the validation `DataLoader` (not None).
      generator: the rollout `Generator`; sampling_params: its `SamplingParams` for validation.
      reward_fn: the `RewardManager`.

    Raises:
      RewardFunctionError: see `RewardManager.compute`.
    """
    t0 = time.perf_counter()
    n = int(config.rollout.val_kwargs.n)
    sources, scores, lengths, uids, preds = [], [], [], [], []
    extras: dict[str, list[np.ndarray]] = {}
    bs = val_loader.batch_size
    # mininterval=0: batches are few and slow, so draw every one (a fast, compiled batch would else skip "16/16")
    bar_kw = dict(total=val_loader.num_prompts, desc="validation", unit="prompt", leave=False, mininterval=0)
    with progress_bar(bool(config.trainer.progress_bar), **bar_kw) as bar:
        for i, batch in enumerate(iter(val_loader)):
            if n > 1:
                batch = batch.repeat(n, interleave=True)
            batch, pad = batch.pad_to_divisor(bs * n)  # fixed generate shape: one compile for every batch
            out = generator.generate(batch, sampling_params)
            out = out.unpad(pad) if pad else out
            res = reward_fn.compute(out)
            if n > 1:  # extracted final answers, for majority voting (maj@k)
                texts, _ = reward_fn.decode_responses(out)
                nt = out.non_tensor_batch
                infos = nt["extra_info"] if "extra_info" in nt else [None] * len(texts)
                preds += [
                    extract_answer(str(d), t, e if isinstance(e, dict) else None)
                    for d, t, e in zip(nt["data_source"], texts, infos)
                ]
            scores.append(np.asarray(res.scores, np.float64))
            lengths.append(np.asarray(out.batch["response_mask"]).sum(-1))
            sources.append(np.asarray(out.non_tensor_batch["data_source"]))
            uids.append(np.asarray([f"{i}/{u}" for u in out.non_tensor_batch["uid"]]))
            for k, v in res.extra_infos.items():
                if np.asarray(v).dtype.kind == "f":
                    extras.setdefault(k, []).append(np.asarray(v, np.float64))
            bar.update(len(res.scores) // n)
    scores, lengths = np.concatenate(scores), np.concatenate(lengths)
    sources, uids = np.concatenate(sources), np.concatenate(uids)
    infos = {"reward": scores}
    for k, v in extras.items():
        v = np.concatenate(v)
        if k != "reward" and v.size == scores.size:  # keys reported by every batch
            infos[k] = v
    out_m = process_validation_metrics(sources, uids, infos, preds if n > 1 else None)
    for ds in np.unique(sources):
        sel = sources == ds
        out_m[f"val-aux/{ds}/response_length/mean"] = float(lengths[sel].mean())
        out_m[f"val-aux/{ds}/num_samples"] = float(sel.sum())
    out_m["timing_s/testing"] = time.perf_counter() - t0
    return out_m
