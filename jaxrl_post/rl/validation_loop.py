"""The validation loop behind `RLTrainer.validate`: generate on the held-out set, score, aggregate.

Host-side orchestration (generation and reward calls); the metrics themselves are validation.py's.

Multi-process runs split validation like a training step: every process builds the same global batch
(cheap host copies of the loader's token ids), keeps its contiguous block of rows, generates only those
(`Generator.generate(process_local=True)`) and scores only its real rows; the per-row results of all
batches are gathered once at the end (`distributed.gather_objects`), so the metrics are computed from the same
rows, in the same order, as on one process.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np

from jaxrl_post.engine.progress import progress_bar
from jaxrl_post.rl.dynamic_sampling import score_everywhere
from jaxrl_post.rl.validation import extract_answer, process_validation_metrics
from jaxrl_post.runtime import distributed


def run_validation(
    config: Any,
    val_loader: Any,
    generator: Any,
    reward_fn: Any,
    sampling_params: Any,
    *,
    process_local: bool = False,
    dump_path: str | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Generate on every batch of `val_loader` (each prompt `rollout.val_kwargs.n` times, padded to a fixed
    shape), score with `reward_fn` and return the validation metrics described in `RLTrainer.validate`.

    Args:
      config: the job ConfigDict (`rollout.val_kwargs.n`, `trainer.progress_bar`).
      val_loader: the validation `DataLoader` (not None); it yields the same global batches on every process.
      generator: the rollout `Generator`; sampling_params: its `SamplingParams` for validation.
      reward_fn: the `RewardManager`.
      process_local: multi-process runs (every process calls this): each process generates and scores only
        its block of rows of every batch, and the results are gathered once (every process returns the
        same metrics). False: this process does everything.
      dump_path: verl's `trainer.validation_data_dir`: when set, process 0 writes every scored response to
        `<dump_path>/<step>.jsonl` (`write_generations`). step: the training step the file is named after.

    Raises:
      RewardFunctionError: see `RewardManager.compute` (with `process_local`, a failure on any process is
        raised on every process).
    """
    t0 = time.perf_counter()
    n = int(config.rollout.val_kwargs.n)
    nproc = jax.process_count() if process_local else 1
    # Fixed generate shape (one compile for every batch): a full batch of bs x n rows, rounded up to a
    # multiple of the process count so that every process holds an equal block. A short last batch is padded
    # with copies of its first rows (`pad_to_divisor`); padding rows are at the end, are generated (the shape
    # needs them) but never scored or counted: each process keeps only its rows below the real row count.
    rows = -(-val_loader.batch_size * n // nproc) * nproc
    pid = jax.process_index() if process_local else 0
    own = slice(pid * rows // nproc, (pid + 1) * rows // nproc)
    mine: list[dict[str, Any]] = []  # per batch: this process's scored (real) rows
    show = bool(config.trainer.progress_bar) and distributed.is_main()
    # mininterval=0: batches are few and slow, so draw every one (a fast, compiled batch would else skip "16/16")
    bar_kw = dict(total=val_loader.num_prompts, desc="validation", unit="prompt", leave=False, mininterval=0)
    with progress_bar(show, **bar_kw) as bar:
        for batch in iter(val_loader):
            if n > 1:
                batch = batch.repeat(n, interleave=True)
            real = len(batch)
            batch, _ = batch.pad_to_divisor(rows)
            if process_local:
                out = generator.generate(batch[own], sampling_params, process_local=True)
            else:
                out = generator.generate(batch, sampling_params)
            out = out[: max(0, min(real, own.stop) - own.start)] if process_local else out[:real]
            res = score_everywhere(reward_fn, out, process_local)  # None: no real rows here
            mine.append(_rows_of(out, res, reward_fn, n, dump=dump_path is not None))
            bar.update(real // n)
    # THE gather of validation: every process's list of per-batch results (process order = row order)
    parts = distributed.gather_objects(mine) if process_local else [mine]
    per_batch = [_merge([p[i] for p in parts]) for i in range(len(mine))]
    scores = np.concatenate([b["scores"] for b in per_batch])
    lengths = np.concatenate([b["lengths"] for b in per_batch])
    sources = np.concatenate([b["sources"] for b in per_batch])
    uids = np.concatenate([np.asarray([f"{i}/{u}" for u in b["uids"]]) for i, b in enumerate(per_batch)])
    preds = [p for b in per_batch for p in b["preds"]]
    infos = {"reward": scores}
    for k in sorted({k for b in per_batch for k in b["extras"]}):
        if k != "reward" and all(k in b["extras"] for b in per_batch):  # keys reported by every batch
            infos[k] = np.concatenate([b["extras"][k] for b in per_batch])
    out_m = process_validation_metrics(sources, uids, infos, preds if n > 1 else None)
    for ds in np.unique(sources):
        sel = sources == ds
        out_m[f"val-aux/{ds}/response_length/mean"] = float(lengths[sel].mean())
        out_m[f"val-aux/{ds}/num_samples"] = float(sel.sum())
    if dump_path is not None and distributed.is_main():
        write_generations(os.path.join(dump_path, f"{step}.jsonl"), per_batch, step)
    out_m["timing_s/testing"] = time.perf_counter() - t0
    return out_m


def write_generations(path: str, per_batch: list[dict[str, Any]], step: int) -> None:
    """Write one JSON line per scored validation response, verl's `_dump_generations` keys (`input`: the
    decoded prompt, `output`: the decoded response, `gts`: the ground truth, `score`, `step`) plus
    `data_source`, `uid` (`<batch>/<uid>`: the n responses of one prompt share it), `raw_prompt` (the chat
    messages) and the reward function's numeric extras (`acc`, ...; NaN as null). Written to `<path>.tmp`,
    then renamed, so a crash never leaves a partial file. Raises OSError when the file cannot be written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for i, b in enumerate(per_batch):
            for j, d in enumerate(b["dump"]):
                extras = {k: _json_float(v[j]) for k, v in sorted(b["extras"].items())}
                row = dict(d, score=float(b["scores"][j]), step=int(step), data_source=str(b["sources"][j]))
                row["uid"] = f"{i}/{b['uids'][j]}"
                f.write(json.dumps({**extras, **row}, ensure_ascii=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def write_rollout_generations(dump_dir: str, batch: Any, reward_fn: Any, step: int) -> None:
    """verl's `trainer.rollout_data_dir`: one JSON line per training response of step `step` to
    `<dump_dir>/<step>.jsonl`, the keys of `write_generations` with `score` = the row's summed
    `token_level_scores` (verl's dump of the training batch) plus `response_length` (the response's real tokens,
    the lengths a scheduler simulation replays: scripts/simulate_rollout.py --lengths). `batch`: the step's
    scored `DataProto` (every process holds all rows; process 0 writes). Raises OSError as `write_generations`."""
    if not distributed.is_main():
        return
    b, nt = batch.batch, batch.non_tensor_batch
    part = dict(
        dump=_dump_rows(batch, reward_fn),
        scores=np.asarray(b["token_level_scores"], np.float64).sum(-1),
        sources=np.asarray(nt["data_source"]),
        uids=list(nt["uid"]),
        extras={"response_length": np.asarray(b["response_attention_mask"]).sum(-1).astype(np.float64)},
    )
    write_generations(os.path.join(dump_dir, f"{step}.jsonl"), [part], step)


def _json_float(x: Any) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def _json_default(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def _rows_of(out, res, reward_fn, n: int, dump: bool = False) -> dict[str, Any]:
    """Host values of one batch's scored rows (`out`: this process's real rows; `res`: their RewardOutput
    or None when there are none): scores/lengths `[b]`, sources/uids `[b]` object, preds (n > 1), extras
    (float keys only, `[b]` float64 with NaN where a row did not report the key; multi-turn rollouts add
    `tool_calls`, `tool_call_rate` (1.0 where the trajectory called a tool) and `num_turns`, reported as
    `val-aux/{data_source}/{key}/mean@{n}`), and with `dump` the per-row texts of `write_generations`."""
    nt = out.non_tensor_batch
    if res is None:
        empty = np.zeros((0,), np.float64)
        return dict(scores=empty, lengths=empty, sources=np.zeros((0,), object), uids=[], preds=[], extras={}, dump=[])
    preds = []
    if n > 1:  # extracted final answers, for majority voting (maj@k)
        texts, _ = reward_fn.decode_responses(out)
        infos = nt["extra_info"] if "extra_info" in nt else [None] * len(texts)
        preds = [
            extract_answer(str(d), t, e if isinstance(e, dict) else None)
            for d, t, e in zip(nt["data_source"], texts, infos)
        ]
    extras = {k: np.asarray(v, np.float64) for k, v in res.extra_infos.items() if np.asarray(v).dtype.kind == "f"}
    if "tool_calls" in nt:  # multi-turn: tool calls per trajectory and the share of trajectories that call one
        calls = np.asarray(nt["tool_calls"], np.float64)
        extras.update(tool_calls=calls, tool_call_rate=(calls > 0).astype(np.float64))
        extras["num_turns"] = np.asarray(nt["num_turns"], np.float64)
    return dict(
        dump=_dump_rows(out, reward_fn) if dump else [],
        scores=np.asarray(res.scores, np.float64),
        lengths=np.asarray(out.batch["response_attention_mask"]).sum(-1),
        sources=np.asarray(nt["data_source"]),
        uids=list(nt["uid"]),
        preds=preds,
        extras=extras,
        objects={k for k, v in res.extra_infos.items() if np.asarray(v).dtype.kind != "f"},
    )


def _dump_rows(out, reward_fn) -> list[dict[str, Any]]:
    """input / output / gts / raw_prompt of each row of `out` (host objects, for `write_generations`)."""
    nt = out.non_tensor_batch
    outputs, _ = reward_fn.decode_responses(out)
    inputs = reward_fn.decode_prompts(out) or [""] * len(outputs)
    gts = reward_fn.ground_truths(out)
    raw = list(nt["raw_prompt"]) if "raw_prompt" in nt else [None] * len(outputs)
    return [dict(input=i, output=o, gts=g, raw_prompt=r) for i, o, g, r in zip(inputs, outputs, gts, raw)]


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch's rows from the processes' parts (process order). An extra key is a float key of the batch
    when some process's rows report it and none reports it as non-numbers (as one `RewardManager.compute`
    over the whole batch would decide); rows of a process without the key get NaN, as rows without it do."""
    parts = [p for p in parts if len(p["scores"])]
    keys = {k for p in parts for k in p["extras"]} - {k for p in parts for k in p.get("objects", ())}
    nan = lambda p: np.full(len(p["scores"]), np.nan)
    return dict(
        scores=np.concatenate([p["scores"] for p in parts]),
        lengths=np.concatenate([p["lengths"] for p in parts]),
        sources=np.concatenate([p["sources"] for p in parts]),
        uids=[u for p in parts for u in p["uids"]],
        dump=[d for p in parts for d in p.get("dump", [])],
        preds=[x for p in parts for x in p["preds"]],
        extras={k: np.concatenate([p["extras"].get(k, nan(p)) for p in parts]) for k in keys},
    )
