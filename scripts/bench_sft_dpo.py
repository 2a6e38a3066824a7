"""Benchmark: tokens/s and peak RSS of our SFT (packing on) or DPO trainer on SmolLM2, the shape of the TRL peers.

    python scripts/bench_sft_dpo.py --trainer sft|dpo --model-dir $MODEL_DIR --data $PERF/sft.jsonl [--steps 3]
        [--batch 8] [--micro 2] [--max-length 512] [--lr ...] [--packing-strategy per_step|bfd]

Runs `configs/sft.py:gsm8k` (`model.use_remove_padding=True`: packing) or `configs/dpo.py:smollm2` through the real
trainer (`SFTTrainer` / `DPOTrainer` `.fit()`) on `--data` (rows from `scripts/peers/gsm8k_rows.py`), float32,
AdamW (weight decay 0, clip 1.0, constant lr), the host defaults of `python -m jaxrl_post.main`
(`platform_defaults.apply_host_defaults`: the CPU XLA scheduler flag and glibc malloc settings), no validation, no
checkpoints, for one warm-up step (compile) + `--steps` timed steps. Prints `RESULT {json}` with the keys of
`scripts/peers/trl_common.result`: input tokens/s (tokens through the policy: DPO counts the prompt once per
completion, as TRL's padded batch) and trained tokens/s (SFT: loss tokens; DPO: chosen + rejected tokens).
Defaults: SFT 8 examples per step in micro-batches of 2 rows of 512 tokens, lr 1e-5 (`--packing-strategy bfd`: the
dataset packed once into rows of 512, TRL's BFD, and `--batch` / `--micro` count packed rows, as TRL's); DPO 4
pairs per step, micro-batches of 2, lr 5e-7 (`--packing-strategy bfd`: the pairs packed once into rows of 2 x 512,
`--batch` / `--micro` count those rows).
Driver against TRL: `scripts/peers/run_sft_dpo_rounds.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import tempfile
from collections.abc import Callable, Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

DEFAULTS = {"sft": dict(batch=8, micro=2, lr=1e-5), "dpo": dict(batch=4, micro=2, lr=5e-7)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", choices=("sft", "dpo"), required=True)
    ap.add_argument("--model-dir", required=True, help="HF dir / .gguf / alias (model.path)")
    ap.add_argument("--data", required=True, help="jsonl from scripts/peers/gsm8k_rows.py")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=None, help="examples (DPO: pairs) per optimizer step")
    ap.add_argument("--micro", type=int, default=None, help="rows (DPO: pairs) per micro-batch")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--packing-strategy", choices=("per_step", "bfd"), default="per_step")
    a = ap.parse_args(argv)
    for k, v in DEFAULTS[a.trainer].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    return a


def make_config(a: argparse.Namespace, workdir: str):
    """The trainer config of `a` (configs/sft.py:gsm8k or configs/dpo.py:smollm2 with the benchmark's overrides)."""
    name, variant = ("sft", "gsm8k") if a.trainer == "sft" else ("dpo", "smollm2")
    spec = importlib.util.spec_from_file_location(f"{name}_cfg", os.path.join(_REPO, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config(variant)
    cfg.model.path, cfg.model.dtype, cfg.model.use_remove_padding = a.model_dir, "float32", True
    d = cfg.data
    d.train_files, d.val_files = a.data, None
    d.max_length, d.train_batch_size, d.micro_batch_size, d.shuffle = a.max_length, a.batch, a.micro, False
    if a.trainer == "sft":
        d.format = "prompt_completion"
        d.prompt_key, d.response_key = "prompt", "completion"
    d.packing_strategy = a.packing_strategy
    o = cfg.optim
    o.lr, o.weight_decay, o.clip_grad, o.warmup_style = a.lr, 0.0, 1.0, "constant"
    o.lr_warmup_steps, o.lr_warmup_steps_ratio = 0, 0.0
    t = cfg.trainer
    t.total_training_steps, t.total_epochs, t.save_freq, t.test_freq, t.export_hf = a.steps + 1, 1000, -1, -1, False
    t.val_before_train, t.resume_mode, t.progress_bar = False, "disable", False
    t.default_local_dir, t.logger = workdir, ("jsonl",)
    return cfg


class _Counting:
    """Wraps the trainer's train loader: records the tokens of every batch it hands out."""

    def __init__(self, inner, count):
        self.inner, self.count, self.per_step = inner, count, []

    def __iter__(self):
        return self

    def __next__(self):
        idx = next(self.inner)
        self.per_step.append(self.count(idx))
        return idx

    def __getattr__(self, k):
        return getattr(self.inner, k)


def summarize(a: argparse.Namespace, step_s: list[float], tokens: list[tuple[int, int]], **extra) -> dict:
    """The result dict: step 0 is the warm-up; tokens[i] = (input, trained) of step i."""
    secs = sum(step_s[1:])
    timed = tokens[1 : len(step_s)]
    return {
        "system": "jaxrl_post",
        "trainer": a.trainer,
        "timed_steps": len(step_s) - 1,
        "warmup_step_s": round(step_s[0], 3),
        "step_s": [round(s, 3) for s in step_s[1:]],
        "input_tokens_per_step": [x for x, _ in timed],
        "trained_tokens_per_step": [y for _, y in timed],
        "input_tokens_per_s": round(sum(x for x, _ in timed) / secs, 2) if secs else None,
        "trained_tokens_per_s": round(sum(y for _, y in timed) / secs, 2) if secs else None,
        "peak_rss_mb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "batch": a.batch,
        "micro": a.micro,
        "max_length": a.max_length,
        "lr": a.lr,
        "packing_strategy": a.packing_strategy,
        **extra,
    }


def token_counter(trainer: str, data) -> Callable[[Sequence[int]], tuple[int, int]]:
    """(input, trained) tokens of the batch the train loader hands out as `idx`: example / pair indices, or packed
    row indices under bfd (`data.packed_rows`; `data`: the trainer's `SupervisedData`). DPO counts each pair as TRL
    does: `prompt + chosen` and `prompt + rejected` are input, the two responses trained."""
    rows = data.packed_rows
    examples = lambda idx: idx if rows is None else [i for r in idx for i in rows[r]]
    if trainer == "sft":
        d = data.train
        return lambda idx: (
            sum(len(d.input_ids[i]) for i in examples(idx)),
            sum(int(d.loss_mask[i].sum()) for i in examples(idx)),
        )
    p = data.train.pairs
    return lambda idx: (
        sum(2 * len(p[i].prompt_ids) + len(p[i].chosen_ids) + len(p[i].rejected_ids) for i in examples(idx)),
        sum(len(p[i].chosen_ids) + len(p[i].rejected_ids) for i in examples(idx)),
    )


def main(argv=None) -> dict:
    a = parse_args(argv)
    from jaxrl_post.runtime.platform_defaults import apply_host_defaults

    apply_host_defaults()  # as `python -m jaxrl_post.main` does: CPU XLA flags and glibc malloc, before JAX starts
    cfg = make_config(a, tempfile.mkdtemp(prefix=f"bench_{a.trainer}_"))
    if a.trainer == "sft":
        from jaxrl_post.sft.trainer import SFTTrainer as Trainer
    else:
        from jaxrl_post.sft.dpo import DPOTrainer as Trainer
    t = Trainer(cfg, console_write=lambda s: None)
    t.data.loader = _Counting(t.data.loader, token_counter(a.trainer, t.data))
    out = t.fit()
    compiles = dict(t.compile_counts())  # traces per jitted function: > 1 means a step recompiled
    t.close()
    steps = [m["timing_s/step"] for m in out["history"]]
    res = summarize(a, steps, t.data.loader.per_step, last_loss=out["last"].get("loss"), compile_counts=compiles)
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
