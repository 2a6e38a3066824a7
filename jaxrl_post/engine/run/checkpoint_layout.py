"""What a run's checkpoints are called, which one a run resumes from, and the host-JSON model entries.

No orbax here: `<workdir>/checkpoints/global_step_<N>/` directories (verl's names), which of them are
complete (orbax writes `_CHECKPOINT_METADATA` only into a finalized step), the resume modes (verl
`trainer.resume_mode`), and the JSON entries that describe the model (`host['model']`, `host['reference']`)
so a checkpoint can be exported without its run config; how a training state maps to orbax items
(`flatten_items`); the cleanup of saves that never finished (`report_unfinished`). `engine.run.checkpoint`
re-exports every public name.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_post.models import ModelConfig

CHECKPOINT_SUBDIR = "checkpoints"
STEP_PREFIX = "global_step"
RESUME_MODES = ("auto", "disable", "resume_path")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (message names the path and the last good step)."""


def checkpoint_dir(workdir: str | os.PathLike) -> str:
    """`<workdir>/checkpoints`: where a run's step directories live."""
    return os.path.join(os.fspath(workdir), CHECKPOINT_SUBDIR)


def step_dir_name(step: int) -> str:
    """`global_step_<step>` (the directory name of one checkpoint)."""
    return f"{STEP_PREFIX}_{int(step)}"


def _step_of(name: str) -> int | None:
    """`global_step_7` -> 7; any other name (e.g. orbax's `global_step_7.orbax-checkpoint-tmp`) -> None."""
    head, _, tail = name.rpartition("_")
    return int(tail) if head == STEP_PREFIX and tail.isdigit() else None


def list_complete_steps(directory: str | os.PathLike) -> list[int]:
    """Finalized `global_step_<N>` directories under `directory` (ascending), without opening a manager.

    A directory counts when its name is exactly `global_step_<int>` (orbax's in-progress directories
    carry a `.orbax-checkpoint-tmp` suffix) and it holds orbax's `_CHECKPOINT_METADATA`.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    complete = lambda name: os.path.exists(os.path.join(directory, name, "_CHECKPOINT_METADATA"))
    return sorted(_step_of(n) for n in os.listdir(directory) if _step_of(n) is not None and complete(n))


_TMP_RE = re.compile(rf"^{STEP_PREFIX}_(\d+)\.orbax-checkpoint-tmp.*$")


def unfinished_steps(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """`(step, path)` of orbax's in-progress `global_step_<N>.orbax-checkpoint-tmp[-<stamp>]` directories
    under `directory`, ascending: saves that never finished (a second Ctrl-C, SIGKILL or crash while writing).
    Only meaningful when no save is running (the run holds the directory's lock)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in os.listdir(directory) if (m := _TMP_RE.match(n))]
    return sorted(found)


def parse_step_dir(path: str | os.PathLike) -> tuple[str, int | None]:
    """`.../checkpoints/global_step_7` -> (`.../checkpoints`, 7); `.../checkpoints` -> (same, None)."""
    path = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    step = _step_of(os.path.basename(path))
    return (path, None) if step is None else (os.path.dirname(path), step)


def find_resume_checkpoint(
    mode: str,
    workdir: str | os.PathLike,
    resume_from_path: str | None = None,
    *,
    what: str = "trainer.resume_from_path",
) -> tuple[str, int] | None:
    """Which checkpoint a run resumes from (verl `trainer.resume_mode`).

    Args:
      mode: 'disable' (start fresh: None); 'auto' (latest complete step in `checkpoint_dir(workdir)`, or
        None when there is none); 'resume_path' (`resume_from_path`: a `global_step_<N>` directory, or a
        checkpoints directory / working directory whose latest complete step is used).
      what: how error messages name `resume_from_path` (scripts pass `'--checkpoint'`).

    Returns:
      `(checkpoint root directory, step)` or None.

    Raises:
      ValueError: unknown mode, or 'resume_path' without a path.
      CheckpointError: 'resume_path' points at nothing complete (e.g. an unfinished `.orbax-checkpoint-tmp`
        directory or a step that was never committed); the message names `what` and what to pass instead.
    """
    if mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode must be one of {RESUME_MODES}, got {mode!r}")
    if mode == "disable":
        return None
    if mode == "auto":
        root = checkpoint_dir(workdir)
        steps = list_complete_steps(root)
        return (root, steps[-1]) if steps else None
    if not resume_from_path:
        raise ValueError(f"trainer.resume_mode='resume_path' needs {what}")
    path = os.fspath(resume_from_path)
    hint = (
        f"pass a run directory (trainer.default_local_dir, e.g. {what}=runs/grpo), its checkpoints/ directory, "
        f"or one checkpoints/{STEP_PREFIX}_<N> directory"
    )
    if not os.path.exists(path):
        raise CheckpointError(f"{what}={path} does not exist; {hint}")
    root, step = parse_step_dir(path)
    if step is None:
        for cand in (root, checkpoint_dir(root)):
            steps = list_complete_steps(cand)
            if steps:
                return cand, steps[-1]
        raise CheckpointError(
            f"{what}={path}: no complete {STEP_PREFIX}_<N> checkpoint in {root} or {checkpoint_dir(root)} "
            f"(a run writes them every trainer.save_freq steps and when stopped with Ctrl-C); {hint}"
        )
    if step not in list_complete_steps(root):
        raise CheckpointError(
            f"{what}={path} is not a complete checkpoint (complete steps in {root}: {list_complete_steps(root)})"
        )
    return root, step


def reference_pointer(*, model_path: str | None, random_init: bool = False, seed: int | None = None) -> dict:
    """`host['reference']` entry for a reference policy that equals the initial actor (not saved).

    On restore the trainer rebuilds the reference the same way it built it the first time (load
    `model_path`, or random init with `seed`) instead of reading a copy from the checkpoint.
    """
    return {
        "source": "initial_actor",
        "model_path": model_path,
        "random_init": bool(random_init),
        "seed": None if seed is None else int(seed),
    }


def model_metadata(
    model_config: Any, tokenizer_source: str | None, lora: dict | None = None, base: dict | None = None
) -> dict:
    """`host['model']` entry: the actor's `ModelConfig` fields (JSON) and where its tokenizer comes from,
    so a checkpoint can be exported / evaluated without the run config (scripts/export_hf.py). A LoRA
    checkpoint (its actor params are the adapters only) adds `lora` (`LoRAConfig.to_dict()`) and `base`
    (`reference_pointer`: how to rebuild the frozen base weights)."""
    import dataclasses

    out = {"config": json_safe(dataclasses.asdict(model_config)), "tokenizer": tokenizer_source}
    if lora is not None:
        out.update(lora=json_safe(lora), base=json_safe(base))
    return out


def model_config_from_metadata(meta: Mapping[str, Any]):
    """Inverse of `model_metadata` -> `jaxrl_post.models.ModelConfig` (lists back to tuples)."""
    import dataclasses

    def freeze(x):
        return tuple(freeze(v) for v in x) if isinstance(x, list) else x

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: freeze(v) for k, v in meta["config"].items() if k in names})


def json_safe(x: Any) -> Any:
    """Tuples -> lists, numpy scalars -> Python scalars, other objects -> str (recursively)."""
    if isinstance(x, Mapping):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


HOST_ITEM = "host"  # the JSON entry of a training state (`Checkpointer.save`)


_LEAF_KEY = "__leaf__"


def _wrap(tree: Any) -> Any:
    """orbax's StandardSave needs a container: a bare array item is stored as `{'__leaf__': x}`."""
    return {_LEAF_KEY: tree} if jax.tree_util.treedef_is_leaf(jax.tree.structure(tree)) else tree


def _unwrap(tree: Any) -> Any:
    return tree[_LEAF_KEY] if isinstance(tree, dict) and set(tree) == {_LEAF_KEY} else tree


def flatten_items(state: Mapping[str, Any]) -> dict[str, Any]:
    """Array entries of a state -> orbax items: a plain-dict entry is split one level (`'actor.params'`,
    `'actor.opt_state'`) so each part can be restored alone; None entries/parts are dropped."""
    items = {}
    for k, v in state.items():
        if k == HOST_ITEM or v is None:
            continue
        if "." in k:
            raise ValueError(f'state entry names must not contain ".": {k!r}')
        if type(v) is dict:  # pylint: disable=unidiomatic-typecheck  (nnx.State etc. stay whole)
            for sub, x in v.items():
                if x is not None:
                    items[f"{k}.{sub}"] = x
        else:
            items[k] = v
    return items


def unflatten_items(items: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten_items`."""
    out: dict[str, Any] = {}
    for name, v in items.items():
        if "." in name:
            k, sub = name.split(".", 1)
            out.setdefault(k, {})[sub] = v
        else:
            out[name] = v
    return out


def report_unfinished(directory: str | os.PathLike, resume_step: int | None) -> str | None:
    """Remove the unfinished saves (`unfinished_steps`) in `directory` and return one line naming the lost
    step(s) and what the run resumes from (`resume_step`, None: from scratch), or None when there are none.
    Call with the run directory's lock held (no save can be running).

    Raises:
      OSError: a leftover could not be removed (it is then left in place; orbax skips it).
    """
    left = unfinished_steps(directory)
    if not left:
        return None
    for _, path in left:
        shutil.rmtree(path)
    steps = sorted({s for s, _ in left})
    what = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    then = f"resuming from step {resume_step}" if resume_step is not None else "no complete checkpoint to resume from"
    names = ", ".join(os.path.basename(p) for _, p in left)
    return (
        f"the checkpoint of {what} was never finished (its save was interrupted: a second Ctrl-C, a kill or a "
        f"crash while writing); {what} is lost and its partial directory was removed ({names} in {directory}); "
        f"{then}"
    )
