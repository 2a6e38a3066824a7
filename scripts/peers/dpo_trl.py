"""TRL `DPOTrainer` speed on SmolLM2-135M-Instruct: sigmoid loss, beta 0.1, reference = a frozen copy (log-probs
per step), float32, torch threads 2.

    python scripts/peers/dpo_trl.py --model-dir $MODEL_DIR --data $PERF/dpo.jsonl [--steps 3] [--batch 4]
        [--micro 2] [--max-length 512]

`--batch` pairs per AdamW step in micro-batches of `--micro` pairs (TRL pads chosen and rejected, each with its
own prompt copy). Prints `RESULT {json}` (trl_common.result).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_common


def main() -> None:
    a = trl_common.parse_args(__doc__, lr=5e-7, batch=4, micro=2)
    import trl
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    model, tok = trl_common.load_model(a)
    ds = load_dataset("json", data_files=a.data, split="train")
    cfg = DPOConfig(beta=0.1, loss_type="sigmoid", **trl_common.trainer_kwargs(a))
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    rec = trl_common.instrument(trainer, "trl", a)
    trainer.train()
    trl_common.result("trl", "dpo", rec, a, trl=trl.__version__, beta=0.1)


if __name__ == "__main__":
    main()
