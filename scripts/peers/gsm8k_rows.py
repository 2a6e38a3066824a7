"""GSM8K rows for the SFT / DPO speed comparison (no third-party imports; both systems read the same files).

    python scripts/peers/gsm8k_rows.py OUT_DIR [--n 256]   # writes OUT_DIR/sft.jsonl and OUT_DIR/dpo.jsonl

`sft.jsonl`: TRL conversational prompt/completion rows (user = question, assistant = reference answer).
`dpo.jsonl`: TRL conversational prompt/chosen/rejected rows: chosen = the reference answer, rejected = the same
answer with the final `#### N` number changed to N + 1.
"""

import argparse
import json
import os
import re

GSM8K = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k"))
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def wrong_answer(answer: str) -> str:
    """`answer` with its final `#### N` replaced by `#### N+1`. Raises ValueError without a final number."""
    m = _FINAL.search(answer)
    if m is None:
        raise ValueError(f"no final '#### N' in answer {answer[-40:]!r}")
    n = float(m.group(1).replace(",", "")) + 1
    return answer[: m.start()] + f"#### {int(n) if n.is_integer() else n}"


def write_rows(out_dir: str, n: int, src: str = os.path.join(GSM8K, "train.jsonl")) -> dict[str, str]:
    """Writes the first `n` GSM8K train rows of `src` as `sft.jsonl` and `dpo.jsonl` in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{k}.jsonl") for k in ("sft", "dpo")}
    with open(src) as f, open(paths["sft"], "w") as fs, open(paths["dpo"], "w") as fd:
        for i, line in enumerate(f):
            if i >= n:
                break
            r = json.loads(line)
            prompt = [{"role": "user", "content": r["question"]}]
            fs.write(json.dumps({"prompt": prompt, "completion": [{"role": "assistant", "content": r["answer"]}]}))
            chosen = [{"role": "assistant", "content": r["answer"]}]
            rejected = [{"role": "assistant", "content": wrong_answer(r["answer"])}]
            fd.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
            fs.write("\n")
            fd.write("\n")
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--n", type=int, default=256)
    a = ap.parse_args()
    print(json.dumps(write_rows(a.out_dir, a.n)))
