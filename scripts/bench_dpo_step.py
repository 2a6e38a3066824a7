"""Benchmark: seconds per DPO step, padded vs shared-prompt packed, reference log-probs per step vs precomputed.

    python scripts/bench_dpo_step.py [--pairs 64] [--steps 6] [--hidden 256] [--layers 4] [--max-length 256]
        [--prompt-range 150-200] [--completion-range 10-40] [--batch 16] [--micro 4]

A random llama (`--hidden`, `--layers`, character tokenizer) trained by `DPOTrainer` on `--pairs` random letter
pairs (prompt and completion lengths uniform in the given ranges, in characters = tokens) for `--steps` steps
of `--batch` pairs, once per variant: `model.use_remove_padding` False / True x `dpo.precompute_ref_log_probs`
False / True. Reported per variant: the first step (compile included), the median of the other steps, the
one-time reference pass (compile included; 0 when per step) and the last loss (the variants must agree: same
data order, same math). Run files go to a temporary directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))


def _pairs(path: str, n: int, prompt_range: tuple[int, int], completion_range: tuple[int, int]) -> None:
    rng = random.Random(0)
    text = lambda lo_hi: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(*lo_hi)))
    with open(path, "w") as f:
        for _ in range(n):
            row = {"prompt": text(prompt_range), "chosen": text(completion_range), "rejected": text(completion_range)}
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--prompt-range", default="150-200")
    ap.add_argument("--completion-range", default="10-40")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    a = ap.parse_args()
    rng_of = lambda s: tuple(int(x) for x in s.split("-"))

    import time

    from jaxrl_post.sft.dpo import DPOTrainer

    spec = importlib.util.spec_from_file_location("dpo_cfg", os.path.join(os.path.dirname(_HERE), "configs", "dpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tmp = tempfile.mkdtemp(prefix="bench_dpo_")
    data = os.path.join(tmp, "pairs.jsonl")
    _pairs(data, a.pairs, rng_of(a.prompt_range), rng_of(a.completion_range))
    results = {}
    for pack in (False, True):
        for pre in (False, True):
            cfg = mod.get_config("tiny")
            arch = cfg.model.arch
            arch.hidden_size, arch.intermediate_size, arch.num_layers = a.hidden, 3 * a.hidden, a.layers
            arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, a.hidden // 4
            cfg.data.train_files, cfg.data.val_files = data, None
            cfg.data.max_length, cfg.data.train_batch_size, cfg.data.micro_batch_size = a.max_length, a.batch, a.micro
            cfg.model.use_remove_padding, cfg.dpo.precompute_ref_log_probs = pack, pre
            cfg.trainer.total_training_steps, cfg.trainer.save_freq, cfg.trainer.export_hf = a.steps, -1, False
            cfg.trainer.val_before_train, cfg.trainer.resume_mode = False, "disable"
            cfg.trainer.default_local_dir, cfg.trainer.logger = os.path.join(tmp, f"run_{pack}_{pre}"), ("jsonl",)
            t = DPOTrainer(cfg, console_write=lambda s: None)
            t0 = time.perf_counter()
            if pre:
                t.reference_logps("train")
            ref_s = time.perf_counter() - t0
            out = t.fit()
            t.close()
            steps = [m["timing_s/step"] for m in out["history"]]
            rest = sorted(steps[1:])
            results[f"packed={pack} precompute={pre}"] = {
                "first_step_s": round(steps[0], 2),
                "median_step_s": round(rest[len(rest) // 2], 3),
                "reference_pass_s": round(ref_s, 2),
                "last_loss": out["last"]["loss"],
            }
            print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main()
