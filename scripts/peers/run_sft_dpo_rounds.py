"""Driver: ours vs TRL, SFT (packing) and DPO on SmolLM2, alternated in one sitting; a table and JSON at the end.

    python scripts/peers/run_sft_dpo_rounds.py --model-dir $MODEL_DIR --out $PERF [--rounds 2] [--steps 3]
        [--only sft,dpo] [--rows 256]

Writes `$PERF/data/{sft,dpo}.jsonl` (gsm8k_rows.py), then per round runs ours SFT, TRL SFT, ours DPO, TRL DPO,
each a separate process under `/usr/bin/time -v` (peak RSS = its "Maximum resident set size"), recording the
1-minute load average at the start and end of each run. Every result goes to `$PERF/results.jsonl` as it
arrives (`RESULT` line of the run + rss_mb, load_start, load_end, wall_s, rc); the summary (median over rounds of
tokens/s and peak RSS per system, ratio ours / TRL) is printed as a table and as `SUMMARY {json}`.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
from gsm8k_rows import write_rows  # noqa: E402

SCRIPTS = {
    ("jaxrl_post", "sft"): [os.path.join(_REPO, "scripts", "bench_sft_dpo.py"), "--trainer", "sft"],
    ("trl", "sft"): [os.path.join(_HERE, "sft_trl.py")],
    ("jaxrl_post", "dpo"): [os.path.join(_REPO, "scripts", "bench_sft_dpo.py"), "--trainer", "dpo"],
    ("trl", "dpo"): [os.path.join(_HERE, "dpo_trl.py")],
}
# SFT, the same shape on both sides: 4 rows of 512 per step, the dataset packed once by best-fit decreasing (ours
# `data.packing_strategy='bfd'`, TRL `packing=True`), micro-batches of 2 rows. DPO: TRL 4 pairs per step in
# micro-batches of 2 pairs (each padded to the micro-batch's longest: about 1,040 token slots per micro-batch on
# these rows); ours the pairs packed once by BFD into rows of 2 x 512 (prompt | chosen | rejected, one prompt
# copy), 2 rows per step, micro-batches of 1 row (1,024 slots; about 6 pairs per step)
SHAPE = {
    ("jaxrl_post", "sft"): ["--batch", "4", "--micro", "2", "--packing-strategy", "bfd"],
    ("trl", "sft"): ["--batch", "4", "--micro", "2"],
    ("jaxrl_post", "dpo"): ["--batch", "2", "--micro", "1", "--packing-strategy", "bfd"],
    ("trl", "dpo"): ["--batch", "4", "--micro", "2"],
}
_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def run_one(system: str, trainer: str, a, data: dict) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, *SCRIPTS[(system, trainer)], *SHAPE[(system, trainer)]]
    cmd += ["--model-dir", a.model_dir, "--data", data[trainer], "--steps", str(a.steps), "--max-length", "512"]
    la0, t0 = os.getloadavg()[0], time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=_REPO)
    rec = {"system": system, "trainer": trainer, "cmd": " ".join(cmd[2:]), "rc": p.returncode}
    rec.update(
        load_start=round(la0, 2), load_end=round(os.getloadavg()[0], 2), wall_s=round(time.perf_counter() - t0, 1)
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            rec.update(json.loads(line[7:]))
    m = _RSS.search(p.stderr)
    rec["rss_mb"] = round(int(m.group(1)) / 1024, 1) if m else None
    if p.returncode:
        rec["stderr_tail"] = p.stderr[-2000:]
    return rec


def summarize(records: list[dict]) -> dict:
    """Median over rounds per (trainer, system) and ours / TRL ratios."""
    out = {}
    for trainer in sorted({r["trainer"] for r in records}):
        row = {}
        for system in ("jaxrl_post", "trl"):
            rs = [
                r for r in records if r["trainer"] == trainer and r["system"] == system and r.get("input_tokens_per_s")
            ]
            if rs:
                row[system] = {
                    k: statistics.median(r[k] for r in rs)
                    for k in ("input_tokens_per_s", "trained_tokens_per_s", "rss_mb")
                }
                row[system]["runs"] = len(rs)
        if len(row) == 2:
            o, t = row["jaxrl_post"], row["trl"]
            row["ratio"] = {k: round(o[k] / t[k], 3) for k in ("input_tokens_per_s", "trained_tokens_per_s", "rss_mb")}
        out[trainer] = row
    return out


def table(summary: dict) -> str:
    lines = [
        "| trainer | system | runs | input tokens/s | trained tokens/s | peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for trainer, row in summary.items():
        for system in ("jaxrl_post", "trl"):
            if system in row:
                s = row[system]
                lines.append(
                    f"| {trainer} | {system} | {s['runs']} | {s['input_tokens_per_s']:.1f} | "
                    f"{s['trained_tokens_per_s']:.1f} | {s['rss_mb']:.0f} |"
                )
        if "ratio" in row:
            r = row["ratio"]
            lines.append(
                f"| {trainer} | ours / TRL | | {r['input_tokens_per_s']:.2f}x | "
                f"{r['trained_tokens_per_s']:.2f}x | {r['rss_mb']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="sft,dpo")
    ap.add_argument("--rows", type=int, default=256)
    a = ap.parse_args()
    data = write_rows(os.path.join(a.out, "data"), a.rows)
    results = os.path.join(a.out, "results.jsonl")
    records = []
    for rnd in range(a.rounds):
        for trainer in a.only.split(","):
            for system in ("jaxrl_post", "trl"):
                rec = {"round": rnd, **run_one(system, trainer, a, data)}
                records.append(rec)
                with open(results, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
    s = summarize(records)
    print(table(s))
    print("SUMMARY " + json.dumps(s), flush=True)


if __name__ == "__main__":
    main()
