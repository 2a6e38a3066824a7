"""Shared parts of `sft_trl.py` / `dpo_trl.py`: arguments, per-step timing and token counting, the JSON result.

Timing: a callback from `on_step_begin` to `on_step_end` (one optimizer step); the first step is the warm-up
and is not counted. Tokens per step: counted in `compute_loss` on the batches TRL really trains on (input =
attention-mask tokens, or all tokens of a padding-free packed row; trained = completion-mask / label tokens).
"""

import argparse
import json
import os
import resource
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


def parse_args(doc: str, lr: float, batch: int, micro: int) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="float32 safetensors HF dir (convert_gguf_to_hf.py)")
    ap.add_argument("--data", required=True, help="jsonl from gsm8k_rows.py")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=batch, help="examples (SFT: packed rows) per optimizer step")
    ap.add_argument("--micro", type=int, default=micro, help="per-device micro-batch")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/trl_bench_run")
    return ap.parse_args()


def trainer_kwargs(a: argparse.Namespace) -> dict:
    """The TrainingArguments both peers share: AdamW, constant lr, no decay, clip 1.0, float32, CPU."""
    return dict(
        output_dir=a.workdir,
        per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.batch // a.micro,
        learning_rate=a.lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=a.steps + 1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        max_length=a.max_length,
    )


def load_model(a):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    return AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32), tok


def instrument(trainer, system: str, a) -> dict:
    """Counts tokens in `compute_loss` and times steps; returns the dict that `result` summarizes."""
    from transformers import TrainerCallback

    rec = {"steps": [], "cur": {"input": 0, "trained": 0}}
    orig = trainer.compute_loss

    def counted(model, inputs, *args, **kw):
        ids = inputs["input_ids"]
        am = inputs.get("attention_mask")
        rec["cur"]["input"] += int(am.sum()) if am is not None else int(ids.numel())
        if "completion_mask" in inputs:
            rec["cur"]["trained"] += int(inputs["completion_mask"].sum())
        else:
            rec["cur"]["trained"] += int((inputs["labels"] != -100).sum())
        return orig(model, inputs, *args, **kw)

    trainer.compute_loss = counted

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            rec["cur"] = {"input": 0, "trained": 0, "t0": time.perf_counter()}

        def on_step_end(self, args, state, control, **kw):
            c = rec["cur"]
            rec["steps"].append({"s": time.perf_counter() - c["t0"], "input": c["input"], "trained": c["trained"]})

    trainer.add_callback(Timer())
    return rec


def result(system: str, trainer_name: str, rec: dict, a, **extra) -> dict:
    """The JSON line every bench script prints (same keys as scripts/bench_sft_dpo.py)."""
    timed = rec["steps"][1:]
    secs = sum(s["s"] for s in timed)
    out = {
        "system": system,
        "trainer": trainer_name,
        "timed_steps": len(timed),
        "warmup_step_s": round(rec["steps"][0]["s"], 3) if rec["steps"] else None,
        "step_s": [round(s["s"], 3) for s in timed],
        "input_tokens_per_step": [s["input"] for s in timed],
        "trained_tokens_per_step": [s["trained"] for s in timed],
        "input_tokens_per_s": round(sum(s["input"] for s in timed) / secs, 2) if secs else None,
        "trained_tokens_per_s": round(sum(s["trained"] for s in timed) / secs, 2) if secs else None,
        "peak_rss_mb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "batch": a.batch,
        "micro": a.micro,
        "max_length": a.max_length,
        "lr": a.lr,
        **extra,
    }
    print("RESULT " + json.dumps(out), flush=True)
    return out
