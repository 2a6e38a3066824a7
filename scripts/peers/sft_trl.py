"""TRL `SFTTrainer` speed on SmolLM2-135M-Instruct: packing on, completion-only loss, float32, torch threads 2.

    python scripts/peers/sft_trl.py --model-dir $MODEL_DIR --data $PERF/sft.jsonl [--steps 3] [--batch 4]
        [--micro 2] [--max-length 512]

`--batch` packed rows of `--max-length` tokens per AdamW step (TRL's BFD packing, padding-free rows), in
micro-batches of `--micro`. Prints `RESULT {json}` (trl_common.result).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_common


def main() -> None:
    a = trl_common.parse_args(__doc__, lr=1e-5, batch=4, micro=2)
    import trl
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    model, tok = trl_common.load_model(a)
    ds = load_dataset("json", data_files=a.data, split="train")
    cfg = SFTConfig(packing=True, completion_only_loss=True, shuffle_dataset=False, **trl_common.trainer_kwargs(a))
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    rec = trl_common.instrument(trainer, "trl", a)
    trainer.train()
    trl_common.result("trl", "sft", rec, a, trl=trl.__version__, packing=True)


if __name__ == "__main__":
    main()
