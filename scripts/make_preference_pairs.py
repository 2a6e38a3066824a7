"""Preference pairs from the model's own scored samples (chosen: a right response, rejected: a wrong one).

Input: the JSON lines `trainer.validation_data_dir` writes (`<dir>/<step>.jsonl`: `raw_prompt`, `output`,
`score`, optional `acc`, and `uid`, shared by the n responses of one prompt), e.g. from sampling the base model
n times per prompt on the training task:

    python scripts/evaluate.py --config=configs/grpo.py --config.data.reasoning_gym.val_seed=1 \
      --config.data.reasoning_gym.val_size=320 --config.rollout.val_kwargs.n=8 \
      --config.rollout.val_kwargs.do_sample=True --config.rollout.val_kwargs.temperature=1.0 \
      --config.trainer.validation_data_dir=runs/samples
    python scripts/make_preference_pairs.py runs/samples/0.jsonl --out-dir runs/pairs \
      --exclude runs/grpo_val/0.jsonl

A response is right when its `acc` (else its `score`) is >= `--threshold`. Every prompt with at least one
right and one wrong response gives `--pairs-per-prompt` pairs (distinct responses, drawn with `--seed`);
prompts whose text is in an `--exclude` file (a held-out set's dump) are left out. The prompts are split
(not the pairs: no prompt is in both files) into `<out-dir>/train.jsonl` and `<out-dir>/val.jsonl`, TRL's
conversational preference rows: `{"prompt": [messages], "chosen": [{"role": "assistant", "content": ...}],
"rejected": [...]}`, read by configs/dpo.py and configs/reward_model.py. Prints a table and a JSON line.

Raises SystemExit with the file and line of a malformed row (invalid JSON, a missing key).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

NEEDED = ("raw_prompt", "output", "score", "uid")


def read_generations(paths: list[str]) -> list[dict]:
    """Rows of the generation files, each with `_group` = `<file index>/<uid>` (uids repeat across files)."""
    rows = []
    for fi, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{ln}: invalid JSON ({e.msg})") from None
                missing = [k for k in NEEDED if k not in row]
                if missing:
                    raise SystemExit(f"{path}:{ln}: missing key(s) {missing} (written by trainer.validation_data_dir?)")
                row["_group"] = f"{fi}/{row['uid']}"
                rows.append(row)
    return rows


def prompt_key(row: dict) -> str:
    return json.dumps(row["raw_prompt"], sort_keys=True, ensure_ascii=False)


def build_pairs(rows: list[dict], *, threshold: float, pairs_per_prompt: int, seed: int, exclude: set[str]):
    """[(prompt messages, chosen text, rejected text)] grouped by prompt, and counts."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["_group"], []).append(r)
    rng = random.Random(seed)
    by_prompt, stats = [], dict(prompts=len(groups), excluded=0, all_right=0, all_wrong=0, with_pairs=0, pairs=0)
    for _, resp in sorted(groups.items()):
        if prompt_key(resp[0]) in exclude:
            stats["excluded"] += 1
            continue
        ok = lambda r: float(r["acc"] if r.get("acc") is not None else r["score"]) >= threshold
        right = sorted({r["output"] for r in resp if ok(r)})
        wrong = sorted({r["output"] for r in resp if not ok(r)} - set(right))
        if not wrong:
            stats["all_right"] += 1
            continue
        if not right:
            stats["all_wrong"] += 1
            continue
        k = min(pairs_per_prompt, len(right) * len(wrong))
        combos = rng.sample([(c, w) for c in right for w in wrong], k)
        by_prompt.append([(resp[0]["raw_prompt"], c, w) for c, w in combos])
        stats["with_pairs"] += 1
        stats["pairs"] += k
    return by_prompt, stats


def write_rows(path: str, groups: list[list[tuple]]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for group in groups:
            for prompt, chosen, rejected in group:
                row = {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
    return n


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("generations", nargs="+", help="<validation_data_dir>/<step>.jsonl file(s)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--val-fraction", type=float, default=0.15, help="share of the prompts held out (val.jsonl)")
    p.add_argument("--pairs-per-prompt", type=int, default=1)
    p.add_argument("--threshold", type=float, default=1.0, help="a response is right when acc (else score) >= this")
    p.add_argument("--exclude", action="append", default=[], help="generation file(s) whose prompts to leave out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 0.0 <= a.val_fraction < 1.0:
        raise SystemExit(f"--val-fraction={a.val_fraction}: must be in [0, 1)")
    if a.pairs_per_prompt < 1:
        raise SystemExit(f"--pairs-per-prompt={a.pairs_per_prompt}: must be >= 1")
    exclude = {prompt_key(r) for r in read_generations(a.exclude)} if a.exclude else set()
    groups, stats = build_pairs(
        read_generations(a.generations),
        threshold=a.threshold,
        pairs_per_prompt=a.pairs_per_prompt,
        seed=a.seed,
        exclude=exclude,
    )
    if not groups:
        raise SystemExit(f"no prompt has both a right and a wrong response ({stats}): nothing to write")
    random.Random(a.seed).shuffle(groups)
    n_val = round(len(groups) * a.val_fraction)
    os.makedirs(a.out_dir, exist_ok=True)
    stats["train_pairs"] = write_rows(os.path.join(a.out_dir, "train.jsonl"), groups[n_val:])
    stats["val_pairs"] = write_rows(os.path.join(a.out_dir, "val.jsonl"), groups[:n_val])
    print("| " + " | ".join(stats) + " |")
    print("|" + "---|" * len(stats))
    print("| " + " | ".join(str(v) for v in stats.values()) + " |")
    print(json.dumps(stats))
    print(f"wrote {a.out_dir}/train.jsonl and {a.out_dir}/val.jsonl", file=sys.stderr)
    return stats


if __name__ == "__main__":
    main()
