"""Export the actor of a jaxrl_post checkpoint as a Hugging Face directory (transformers-loadable).

Usage:
  python scripts/export_hf.py --checkpoint=runs/grpo --out=exported/
  python scripts/export_hf.py --checkpoint=runs/grpo/checkpoints/global_step_40 --out=exported/

`--checkpoint` is a run working directory, its `checkpoints/` directory (latest complete step) or one
`global_step_<N>` directory. Only the actor params are read (not the optimizer state); the architecture
and the tokenizer source come from the checkpoint's host metadata (`host['model']`, written by the
trainer). Writes config.json, generation_config.json, model.safetensors and the tokenizer files with
`jaxrl_post.models.save_pretrained` (all with the same file mode), then prints the step, the number of
parameters and the files. A reward-model run's checkpoint is written as an HF
`<Family>ForSequenceClassification` directory (`hf_io.save_reward_model`). `--out` must be a new or empty
directory unless `--overwrite` is given. `--quantization=mxfp4` (GPT-OSS) writes the experts as MXFP4
`_blocks` / `_scales` with config.json's `quantization_config`, as the released gpt-oss checkpoints.

A LoRA checkpoint holds the adapters only: the base weights are rebuilt from where the run took them
(`host['model']['base']`: its `model.path`, or the random init of `trainer.seed`). `--out` then gets the
merged weights (W + alpha/r A B, loadable by transformers alone) and `--out`/adapter/ the PEFT adapter
(`adapter_model.safetensors` + `adapter_config.json`, for `peft.PeftModel.from_pretrained(base, dir)`).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxrl_post.export import ADAPTER_SUBDIR, ExportError, check_out_dir, export, load_actor  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, or a global_step_<N> dir")
    ap.add_argument("--out", required=True, help="output HF directory (new or empty, unless --overwrite)")
    ap.add_argument(
        "--step",
        type=int,
        default=None,
        help="step to export (default: the one --checkpoint names, else the latest complete one)",
    )
    ap.add_argument("--overwrite", action="store_true", help="write into a non-empty --out directory")
    ap.add_argument(
        "--quantization",
        choices=["mxfp4"],
        default=None,
        help="GPT-OSS only: write the experts as MXFP4 blocks and scales, as the released gpt-oss checkpoints",
    )
    args = ap.parse_args(argv)
    from jaxrl_post.engine.run.checkpoint import CheckpointError
    from jaxrl_post.runtime.log_noise import quiet_startup_noise

    quiet_startup_noise()  # as the main job: known start-up noise off the console, real warnings kept

    try:
        export(
            args.checkpoint,
            args.out,
            step=args.step,
            overwrite=args.overwrite,
            say=print,
            quantization=args.quantization,
        )
    except (CheckpointError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
