"""Keep `<workdir>/metrics.jsonl` to one run: move an earlier run's file aside, truncate on resume.

A from-scratch run in a working directory that already holds a `metrics.jsonl` moves that file to
`metrics.<YYYYmmdd-HHMMSS>.jsonl` (the old file's last-write time) and says so in one line. We move it
rather than refuse: rerunning a command with `trainer.resume_mode=disable` (or after deleting the
checkpoints) is how verl/TRL users start over, and they expect the run to start, not to be asked to
clean up by hand; nothing is deleted, and TensorBoard users are used to one event file per run.

A resumed run (from step N) drops the lines logged after step N by the interrupted run, because the
resumed run logs those steps again; the file is rewritten atomically (temp file + `os.replace`), so a
crash during the rewrite leaves the old file intact.

The same holds for `<workdir>/checkpoints` of an earlier run that a run does not resume from (e.g.
`trainer.resume_mode=disable`): it is moved to `checkpoints.<YYYYmmdd-HHMMSS>` (`move_aside_old_checkpoints`).

`<workdir>/config.json` always describes the latest start of the run; when a start rewrites it with a
different config, the previous file is kept as `config.<YYYYmmdd-HHMMSS>.json` (`keep_previous_config`)
rather than appended to, so every file stays one loadable config. A resumed run whose config differs
from the checkpointed run's prints one warning listing the changed keys (`resume_config_warning`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import time
from typing import Any

from jaxrl_post.engine.run.tracking import parse_logger_names

METRICS_FILE = "metrics.jsonl"


def _aside_name(path: str) -> str:
    stem, ext = os.path.splitext(path)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(path)))
    cand, i = f"{stem}.{stamp}{ext}", 1
    while os.path.exists(cand):
        cand, i = f"{stem}.{stamp}-{i}{ext}", i + 1
    return cand


def _step_of(line: str) -> int | None:
    try:
        row = json.loads(line)
        return int(row["step"])
    except (ValueError, TypeError, KeyError):
        return None


def truncate_after(path: str, step: int) -> int:
    """Drop the lines of `path` logged after `step` (rewritten atomically); returns how many were dropped.

    A line that is not JSON is kept, except a partial last line (a run killed mid-write), which is dropped.

    Raises:
      OSError: the file cannot be read or rewritten (the original is then left as it was).
    """
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    keep, dropped = [], 0
    for i, line in enumerate(lines):
        s = _step_of(line)
        partial_last = i == len(lines) - 1 and not line.endswith("\n") and s is None
        if partial_last or (s is not None and s > step):
            dropped += 1
        else:
            keep.append(line)
    fix_end = bool(keep) and not keep[-1].endswith("\n")  # the next run's lines must start on a new line
    if fix_end:
        keep[-1] += "\n"
    if dropped or fix_end:
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return dropped


def is_lead_process() -> bool:
    """True on process 0 (the only one that moves or rewrites run files; the others wait in `sync`)."""
    import jax

    return jax.process_index() == 0


def sync(tag: str) -> None:
    """Barrier across processes (no-op in a single-process run), after process 0 moved run files."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jaxrl_post.run_files.{tag}")


def move_aside_old_checkpoints(checkpoint_root: str, resume_root: str | None, steps: list[int]) -> str | None:
    """Move `checkpoint_root` to `<checkpoint_root>.<YYYYmmdd-HHMMSS>` when it holds complete checkpoints
    (`steps`) of an earlier run that this run does not resume from (`resume_root` is another directory or
    None): otherwise this run's saves would be skipped where a step of the old run exists (orbax keeps the
    existing step), and a later resume would mix the two runs.

    Returns:
      A one-line notice when something was moved, else None; it gives the moved directory's size on disk
      and the `rm -r` command to delete it (nothing is ever deleted here).

    Raises:
      OSError: the directory cannot be renamed (it is then left where it was).
    """
    if not steps or (resume_root is not None and os.path.abspath(resume_root) == os.path.abspath(checkpoint_root)):
        return None
    aside = _aside_name(checkpoint_root)
    os.rename(checkpoint_root, aside)
    return (
        f"{checkpoint_root} holds checkpoints of an earlier run (steps {steps}) that this run does not resume "
        f"from; moved to {aside} ({_human_size(_disk_usage(aside))} on disk; if you do not need them: "
        f"rm -r {shlex.quote(aside)})"
    )


def _disk_usage(path: str) -> int:
    """Bytes of the regular files under `path` (files that vanish meanwhile are not counted)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _human_size(n: int) -> str:
    """1234567 -> '1.2 MB' (powers of 1000, as `du --si`)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def has_metrics(workdir: str, filename: str = METRICS_FILE) -> bool:
    """Whether a run has logged metrics in `workdir`: a non-empty `<filename>` or one an earlier run's start moved
    aside (`<stem>.<stamp><ext>`, `prepare_metrics_file`)."""
    stem, ext = os.path.splitext(filename)
    paths = [os.path.join(workdir, filename), *glob.glob(os.path.join(glob.escape(workdir), f"{stem}.*{ext}"))]
    return any(os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths)


def prepare_metrics_file(workdir: str, resumed_step: int | None, filename: str = METRICS_FILE) -> str | None:
    """Make `<workdir>/<filename>` hold only this run's lines, before the run logs anything.

    Args:
      workdir: the run's working directory.
      resumed_step: the step this run resumed from, or None for a run from scratch.

    Returns:
      A one-line notice to print when an earlier run's file was moved aside, else None.

    Raises:
      OSError: the file cannot be moved or rewritten (nothing is lost: the old file stays where it was).
    """
    path = os.path.join(workdir, filename)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    if resumed_step is not None:
        truncate_after(path, int(resumed_step))
        return None
    aside = _aside_name(path)
    os.rename(path, aside)
    return f"{path} of an earlier run (this run starts from scratch) moved to {aside}"


def first_validation(workdir: str, filename: str = METRICS_FILE) -> dict[str, float] | None:
    """The `val-*` metrics of the first line at step 0 of `<workdir>/<filename>` that has any (the run's
    validation before training), or None (no file, no such line). Non-numeric values are skipped."""
    try:
        with open(os.path.join(workdir, filename), encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(row, dict) or row.get("step") != 0:
                    continue
                val = {}
                for k, v in row.items():
                    if k.startswith("val-"):
                        with contextlib.suppress(TypeError, ValueError):
                            val[k] = float(v)
                if val:
                    return val
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------- config.json
CONFIG_FILE = "config.json"
# changed on resume as a matter of course (extending a run, saying how to resume): never listed as suspicious
EXPECTED_ON_RESUME = (
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.resume_mode",
    "trainer.resume_from_path",
)
_ABSENT = "<absent>"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """`(dotted key, old value, new value)` for every leaf that differs, sorted by key (a key missing on
    one side has the value `'<absent>'`). Both are plain JSON dicts (`config_to_dict` below)."""
    a, b = _flatten(old), _flatten(new)
    return [
        (k, a.get(k, _ABSENT), b.get(k, _ABSENT))
        for k in sorted(set(a) | set(b))
        if a.get(k, _ABSENT) != b.get(k, _ABSENT)
    ]


def read_run_config(run_dir: str) -> dict | None:
    """`<run_dir>/config.json` as a dict, or None when it is missing or unreadable (then nothing is compared)."""
    try:
        with open(os.path.join(run_dir, CONFIG_FILE), encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def resume_config_warning(
    old: dict, new: dict, checkpoint: str, max_keys: int = 10, source: str = "the run's config.json"
) -> str | None:
    """The warning printed when a run resumes with a config that differs from the one the checkpoint was
    trained with (`old`, read from `source`): one header line and `  key: old -> new` for at most
    `max_keys` keys (and a count of the rest). Keys in `EXPECTED_ON_RESUME` (e.g. a larger
    `total_training_steps` to extend the run) are not listed. None when nothing else differs."""
    diffs = [d for d in config_diff(old, new) if d[0] not in EXPECTED_ON_RESUME]
    if not diffs:
        return None
    lines = [
        f"warning: resuming from {checkpoint} with a config that differs from {source} in {len(diffs)} "
        "key(s) (the steps so far were trained with the old values):"
    ]
    lines += [f"  {k}: {json.dumps(o)} -> {json.dumps(n)}" for k, o, n in diffs[:max_keys]]
    if len(diffs) > max_keys:
        lines.append(f"  ... and {len(diffs) - max_keys} more")
    return "\n".join(lines)


def keep_previous_config(workdir: str, new: dict) -> str | None:
    """Before `<workdir>/config.json` is rewritten with `new`: when it exists and differs, move it to
    `config.<YYYYmmdd-HHMMSS>.json` (its last-write time, like `metrics.jsonl`), so every config a run in
    this directory used is kept; returns that path, else None (same config, or none yet).

    Raises:
      OSError: the file cannot be renamed (it is then left where it was).
    """
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    old = read_run_config(workdir)
    if old is not None and not config_diff(old, new):
        return None
    aside = _aside_name(path)
    os.rename(path, aside)
    return aside


def config_to_dict(config: Any) -> dict[str, Any]:
    """A ConfigDict (or mapping) as plain JSON-able dicts (tuples -> lists, other objects -> str).

    `trainer.logger` is stored as its list of names (`tracking.parse_logger_names`: "console,tensorboard"
    -> ["console", "tensorboard"]); a value that does not parse is kept as given.
    """
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    d = json.loads(json.dumps(config, default=str))
    trainer = d.get("trainer") if isinstance(d, dict) else None
    if isinstance(trainer, dict) and "logger" in trainer:
        with contextlib.suppress(ValueError):
            trainer["logger"] = list(parse_logger_names(trainer["logger"]))
    return d


def save_run_config(config: Any, workdir: str) -> list[str]:
    """Write the run config to `<workdir>/config.json` and `<workdir>/config.yaml`; returns the paths."""
    os.makedirs(workdir, exist_ok=True)
    d = config_to_dict(config)
    paths = [os.path.join(workdir, "config.json"), os.path.join(workdir, "config.yaml")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")
    import yaml  # PyYAML (a dependency of transformers)

    with open(paths[1], "w", encoding="utf-8") as f:
        yaml.safe_dump(d, f, sort_keys=True, default_flow_style=False)
    return paths
