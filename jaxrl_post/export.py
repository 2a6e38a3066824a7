"""Load a checkpoint's actor and export it as a Hugging Face directory (the library half of
`scripts/export_hf.py`; see `jaxrl_post.api`).

A checkpoint path is a run working directory, its `checkpoints/` directory (latest complete step) or one
`global_step_<N>` directory. Only the actor params are read (not the optimizer state); the architecture and the
tokenizer source come from the checkpoint's host metadata (`host['model']`, written by the trainer). A LoRA
checkpoint holds the adapters only: the base weights are rebuilt from where the run took them
(`host['model']['base']`: its `model.path`, or the random init of `trainer.seed`); the export then holds the
merged weights (W + alpha/r A B) and `<out>/adapter/` the PEFT adapter. A reward-model run's checkpoint
(`host['trainer_type'] == 'reward_model'`) is a `models.RewardModel` and exports as an HF
`<Family>ForSequenceClassification` directory; it cannot be chatted with (no LM head).
"""

from __future__ import annotations

import os

from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.checkpoint import CheckpointError
from jaxrl_post.models import init_model, load_pretrained, save_pretrained
from jaxrl_post.models.hf_io import save_reward_model
from jaxrl_post.models.lora import LoRAConfig, apply_lora, lora_config_of, save_peft_adapter
from jaxrl_post.models.reward_model import RewardModel
from jaxrl_post.rl.builders import load_tokenizer


def load_actor(checkpoint: str, *, step: int | None = None, mesh=None):
    """(Transformer with the checkpoint's actor params, tokenizer or None, step) from a checkpoint path; a
    LoRA checkpoint's model is the rebuilt base with the adapters attached.

    Raises:
      CheckpointError: nothing complete at `checkpoint`, a checkpoint without model metadata, or a reward
        model's checkpoint (a `RewardModel` has no LM head: export it, or score with it as
        `reward_model.model.path`).
    """
    model, tokenizer, step, meta = _load_actor(checkpoint, step=step, mesh=mesh)
    if meta.get("trainer_type") == "reward_model":
        raise CheckpointError(
            f"{checkpoint} is a reward model's checkpoint (trainer_type reward_model): it scores text, it does not "
            "generate; export it (scripts/export_hf.py) or score with it (--config.reward_model.enable=True "
            f"--config.reward_model.model.path={checkpoint})"
        )
    return model, tokenizer, step


def _load_actor(checkpoint: str, *, step: int | None = None, mesh=None):
    """`load_actor` plus the checkpoint's `host['model']` metadata (with `trainer_type` from the host state);
    a reward model's checkpoint gives a `RewardModel` (built as `RewardModelTrainer` builds it)."""
    from flax import nnx

    root, found = ckpt.find_resume_checkpoint("resume_path", ".", checkpoint, what="--checkpoint")
    step = found if step is None else int(step)
    c = ckpt.Checkpointer(root, read_only=True)
    host = c.read_host(step)
    meta = host.get("model")
    if not meta:
        raise ckpt.CheckpointError(
            f'{c.step_path(step)} has no model metadata (host["model"]); it was not written by a jaxrl_post trainer'
        )
    meta = {**meta, "trainer_type": host.get("trainer_type")}
    mcfg = ckpt.model_config_from_metadata(meta)
    if meta["trainer_type"] == "reward_model":
        model, params = _reward_model_like(meta, mcfg, mesh)
    elif meta.get("lora"):  # adapters only: rebuild the base the run started from, then attach them
        model = _base_model(meta, mcfg, mesh)
        lo = meta["lora"]
        apply_lora(model, LoRAConfig(int(lo["rank"]), float(lo["alpha"]), tuple(lo["target_modules"])))
        params = nnx.state(model, nnx.LoRAParam)
    else:
        model = init_model(mcfg, seed=0, dtype=mcfg.dtype, param_dtype=mcfg.param_dtype, mesh=mesh)
        params = nnx.state(model, nnx.Param)
    got = c.restore(step, like={"actor": {"params": params}})
    nnx.update(model, got["actor"]["params"])
    tokenizer = None
    if meta.get("tokenizer"):
        tokenizer = load_tokenizer(meta["tokenizer"])
    if meta["trainer_type"] == "reward_model" and tokenizer is not None:
        model.pad_token_id = tokenizer.pad_token_id  # pooled as the trainer did (`RewardModelTask.build_model`)
    c.close()
    return model, tokenizer, step, meta


def _base_model(meta, mcfg, mesh):
    """The model a LoRA run started from (`host['model']['base']`): `model.path`, or the seeded random init."""

    base = meta.get("base") or {}
    if base.get("random_init"):
        return init_model(mcfg, seed=int(base.get("seed") or 0), dtype=mcfg.dtype, mesh=mesh)
    return load_pretrained(base["model_path"], dtype=mcfg.dtype, mesh=mesh)[0]


def _reward_model_like(meta, mcfg, mesh):
    """(RewardModel shaped like a reward-model run's, its trained params) to restore into: LoRA -> the base
    backbone with the adapters and a LoRA `score` head (PEFT `modules_to_save`), else all `nnx.Param`."""
    from flax import nnx

    if not meta.get("lora"):
        backbone = init_model(mcfg, seed=0, dtype=mcfg.dtype, param_dtype=mcfg.param_dtype, mesh=mesh)
        rm = RewardModel(rngs=nnx.Rngs(0), backbone=backbone)
        return rm, nnx.state(rm, nnx.Param)

    backbone, lo = _base_model(meta, mcfg, mesh), meta["lora"]
    apply_lora(backbone, LoRAConfig(int(lo["rank"]), float(lo["alpha"]), tuple(lo["target_modules"])))
    rm = RewardModel(rngs=nnx.Rngs(0), backbone=backbone)
    rm.train_score_with_adapters()  # as RewardModelTrainer built it
    return rm, nnx.state(rm, nnx.LoRAParam)


ADAPTER_SUBDIR = "adapter"  # PEFT adapter of a LoRA checkpoint (not next to config.json: transformers would load it)


class ExportError(Exception):
    """The output directory cannot be used (not empty without --overwrite, or a file)."""


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Raises ExportError when `out_dir` is a file, or a non-empty directory and not `overwrite`."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"--out={out_dir} is a file, not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(
            f"--out={out_dir} is not empty ({len(os.listdir(out_dir))} entries); choose a new directory, or pass "
            "--overwrite to write over the files there"
        )


def _fix_file_modes(out_dir: str) -> None:
    """safetensors writes its files with mode 0600; give them the mode of the other files (0666 & ~umask)."""
    mask = os.umask(0)
    os.umask(mask)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(out_dir, name), 0o666 & ~mask)


def export(
    checkpoint: str,
    out_dir: str,
    *,
    step: int | None = None,
    overwrite: bool = False,
    say=None,
    quantization: str | None = None,
) -> str:
    """Write the HF directory for `checkpoint` into `out_dir`; returns `out_dir`. `say(line)`, when given,
    receives a summary: the step, the number of parameters and the files written (with sizes).
    `quantization='mxfp4'`: a GPT-OSS actor's experts written as MXFP4, as the released gpt-oss checkpoints
    (`hf_io.save_pretrained`).

    Raises:
      ExportError: `out_dir` is a file, or a non-empty directory and not `overwrite` (checked first); a
        quantization the model cannot be written in (another family, a reward model, a non-finite expert weight).
      CheckpointError: nothing complete at `checkpoint` (see `load_actor`).
    """
    import jax
    from flax import nnx

    check_out_dir(out_dir, overwrite)

    model, tokenizer, step, meta = _load_actor(checkpoint, step=step)
    adapter_dir = os.path.join(out_dir, ADAPTER_SUBDIR)
    if meta["trainer_type"] == "reward_model":  # <Family>ForSequenceClassification (LoRA: merged weights)
        if quantization is not None:
            raise ExportError(f"quantization {quantization!r}: a reward model is exported in its own dtype only")
        save_reward_model(model, tokenizer, out_dir)
    else:
        try:
            save_pretrained(model, tokenizer, out_dir, quantization=quantization)  # LoRA: merged weights
        except ValueError as e:  # the quantization's own checks (mxfp4.check_export, quantize_mxfp4)
            if quantization is None:
                raise
            raise ExportError(str(e)) from None
        if lora_config_of(model) is not None:
            base_path = (meta.get("base") or {}).get("model_path")
            save_peft_adapter(model, adapter_dir, base_model_name_or_path=base_path)
            _fix_file_modes(adapter_dir)
    _fix_file_modes(out_dir)
    if say is not None:
        n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        say(f"exported step {step} of {checkpoint} ({n_params:,} parameters) to {out_dir}:")
        for root in (out_dir, adapter_dir):
            for name in sorted(os.listdir(root)) if os.path.isdir(root) else ():
                path = os.path.join(root, name)
                if os.path.isfile(path):
                    say(f"  {os.path.relpath(path, out_dir)} ({os.path.getsize(path):,} bytes)")
    return out_dir
