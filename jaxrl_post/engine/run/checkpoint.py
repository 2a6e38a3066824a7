"""Checkpoints of a training run with orbax-checkpoint (sharded, async, atomic), and resume modes.

Layout (verl names its step directories the same way):

    <workdir>/checkpoints/global_step_<N>/
        actor.params/  actor.opt_state/  critic.params/  critic.opt_state/  ref.params/  rng/
                                            pytrees of arrays (orbax `StandardSave`, OCDBT + zarr3;
                                            every host writes its own shards; each restorable alone)
        host/                               JSON (`JsonSave`): global step, update counters, KL
                                            controller, data iterator position, reference pointer, ...
        commit_success.txt, _CHECKPOINT_METADATA

What a training state looks like (`RLTrainer.state_dict()`): a mapping whose `'host'` entry is a
JSON-able dict and whose every other entry is a pytree of arrays or None (absent item, e.g. no critic):

    {'actor': {'params': nnx.State, 'opt_state': optax state}, 'critic': {...} | None,
     'ref': {'params': ...} | None, 'rng': uint32 key data (jax.random.key_data), 'host': {...}}

The reference params are saved only when they differ from the initial actor params; otherwise the
trainer leaves `'ref'` None and records a pointer in `host['reference']` (see `reference_pointer`).

Atomicity: orbax writes a step into `global_step_<N>.orbax-checkpoint-tmp/` and renames it to
`global_step_<N>/` only after every item (and every host) finished; the manager lists only finalized
step directories, so a save interrupted by a crash, SIGKILL or full disk is never picked up by resume.
Left-over tmp directories are reported by the next run in one line naming the lost step
(`report_unfinished`) and removed.

Async: `save` returns once the arrays are copied to host memory (so the caller may donate them to the
next jitted update); writing happens in a background thread. Errors of a background write surface at
the next `save`, `check_for_errors`, `wait_until_finished` or `close` as a `CheckpointError` naming the
directory and the last complete step (which is left intact: old steps are only deleted after a newer one
is committed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_post.engine.run.checkpoint_layout import (  # noqa: F401  (re-exported: ckpt.find_resume_checkpoint, ...)
    CHECKPOINT_SUBDIR,
    HOST_ITEM,
    RESUME_MODES,
    STEP_PREFIX,
    CheckpointError,
    _unwrap,
    _wrap,
    checkpoint_dir,
    find_resume_checkpoint,
    flatten_items,
    json_safe,
    list_complete_steps,
    model_config_from_metadata,
    model_metadata,
    parse_step_dir,
    reference_pointer,
    report_unfinished,
    step_dir_name,
    unfinished_steps,
    unflatten_items,
)
from jaxrl_post.runtime.log_noise import quiet_orbax_info

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def abstract_like(tree: Any) -> Any:
    """`jax.ShapeDtypeStruct` (with `.sharding` when the leaf has one) for every array leaf of `tree`.

    Used as the restore target: orbax then reads each array directly into that sharding (each host
    reads only its shards). Leaves that already are `ShapeDtypeStruct` are kept.
    """

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(one, tree)


class Checkpointer:
    """A run's checkpoints: `save(step, state)`, `restore(step, like)`, `latest_step()`.

    Args:
      directory: the checkpoint root (`checkpoint_dir(workdir)`); created on the first save.
      max_to_keep: keep the newest k complete checkpoints (None = all; verl `max_actor_ckpt_to_keep`).
      async_save: write in a background thread (default); False blocks in `save` until committed.
      read_only: open an existing directory for restore only (export/evaluate scripts).

    Raises:
      CheckpointError: `directory` exists but is not a directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        import orbax.checkpoint as ocp

        quiet_orbax_info()
        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a directory")
        if max_to_keep is not None and int(max_to_keep) < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.max_to_keep = None if max_to_keep is None else int(max_to_keep)
        self.async_save = bool(async_save)
        self.read_only = bool(read_only)
        self._manager = None
        self._last_started: int | None = None  # the step of the last save started (see `pending_step`)
        if os.path.isdir(self.directory):
            self._open()

    # ------------------------------------------------------------------------------------ manager
    def _open(self):
        ocp = self._ocp
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                step_prefix=STEP_PREFIX,
                create=not self.read_only,
                cleanup_tmp_directories=not self.read_only,
                enable_async_checkpointing=self.async_save,
                read_only=self.read_only,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def _error(self, what: str, err: BaseException) -> CheckpointError:
        last = self._committed_steps()
        prev = (
            f"the last complete checkpoint {os.path.join(self.directory, step_dir_name(last[-1]))} is intact"
            if last
            else "no complete checkpoint exists yet"
        )
        msg = f"{what} to {self.directory} failed ({type(err).__name__}: {err}); {prev}."
        if isinstance(err, OSError) or "os_error_code" in str(err) or "No space" in str(err):
            msg += f" Check free disk space and write permission of {self.directory}."
        return CheckpointError(msg)

    def _committed_steps(self) -> list[int]:
        """Finalized steps on disk (re-read; the manager's in-memory list can be stale after a failure)."""
        if not os.path.isdir(self.directory):
            return []
        if self._manager is not None:
            try:
                self._manager.reload()
                return sorted(self._manager.all_steps())
            except Exception:  # the manager cannot list (e.g. a step directory half removed): read the directory
                log.debug("orbax could not list %s; reading the directory instead", self.directory, exc_info=True)
        return list_complete_steps(self.directory)

    # ------------------------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, ascending."""
        if self._manager is None:
            return list_complete_steps(self.directory)
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """Newest complete step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, step_dir_name(step))

    def pending_step(self) -> int | None:
        """The step whose save was started but is not committed on disk yet (re-read from the directory, so it
        is safe to call from a signal handler while a save runs), else None."""
        n = self._last_started
        return None if n is None or n in list_complete_steps(self.directory) else n

    # ------------------------------------------------------------------------------------ save
    def _probe_writable(self, step: int) -> None:
        """Fail fast, before any async work, when the directory cannot be created or written."""
        probe = os.path.join(self.directory, f".write_probe_{jax.process_index()}_{os.getpid()}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
        except OSError as e:
            raise self._error(f"saving checkpoint step {step}", e) from e

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = True) -> bool:
        """Start saving `state` as step `step`; returns True if a save was started.

        Args:
          step: the global step (directory `global_step_<step>`).
          state: `{'host': JSON-able dict, <item>: pytree of arrays | None, ...}` (see module docstring).
            None entries are not written; a plain-dict entry is stored as one item per key (`actor.params`,
            `actor.opt_state`; see `flatten_items`); `host['items']` records the items written.
          force: save even if a checkpoint of this step exists (it is then left as it is: False returned).

        Raises:
          CheckpointError: the directory is not writable, a previous async save failed, or orbax raised.
          ValueError: `state` has no `'host'` dict or a non-JSON-able host value.
        """
        if self.read_only:
            raise CheckpointError(f"checkpointer for {self.directory} was opened read-only")
        ocp = self._ocp
        host = state.get(HOST_ITEM)
        if not isinstance(host, Mapping):
            raise ValueError(f"state['{HOST_ITEM}'] must be a dict of JSON-able host state, got {type(host)}")
        items = flatten_items(state)
        host = dict(host, items=sorted(items), format_version=FORMAT_VERSION, step=int(step))
        _check_json(host)
        self._probe_writable(step)
        manager = self._open()
        try:
            manager.wait_until_finished()  # a previous async save's error surfaces here
        except Exception as e:  # pylint: disable=broad-except
            raise self._error(f"the previous asynchronous checkpoint save (before step {step})", e) from e
        if int(step) in manager.all_steps():
            return False
        args = {k: ocp.args.StandardSave(_wrap(v)) for k, v in items.items()}
        args[HOST_ITEM] = ocp.args.JsonSave(host)
        try:
            started = manager.save(int(step), args=ocp.args.Composite(**args), force=force)
            if started:
                self._last_started = int(step)
            if not self.async_save:
                manager.wait_until_finished()
        except Exception as e:  # pylint: disable=broad-except
            raise self._error(f"saving checkpoint step {step}", e) from e
        return bool(started)

    def check_for_errors(self) -> None:
        """Raise `CheckpointError` if a finished background save failed (non-blocking)."""
        if self._manager is None:
            return
        try:
            self._manager.check_for_errors()
        except Exception as e:  # pylint: disable=broad-except
            raise self._error("an asynchronous checkpoint save", e) from e

    def wait_until_finished(self) -> None:
        """Block until the pending async save is committed. Raises `CheckpointError` if it failed."""
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # pylint: disable=broad-except
            raise self._error("an asynchronous checkpoint save", e) from e

    def close(self) -> None:
        """Wait for pending saves, then release the manager (raises `CheckpointError` like `wait_until_finished`)."""
        if self._manager is None:
            return
        try:
            self.wait_until_finished()
        finally:
            try:
                self._manager.close()
            except Exception:  # the saves are finished (above); a failure to release the manager loses nothing
                log.warning("closing the checkpoint manager of %s failed", self.directory, exc_info=True)
            self._manager = None

    # ------------------------------------------------------------------------------------ restore
    def read_host(self, step: int | None = None) -> dict:
        """The JSON host state of `step` (default: latest). Raises `CheckpointError` if there is none."""
        step = self._resolve_step(step)
        ocp = self._ocp
        out = self._open().restore(step, args=ocp.args.Composite(**{HOST_ITEM: ocp.args.JsonRestore()}))
        return dict(out[HOST_ITEM])

    def restore(self, step: int | None = None, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Read step `step` (default: latest complete one).

        Args:
          like: restore targets shaped like the saved state (without `'host'`): live arrays or
            `jax.ShapeDtypeStruct`s (with shardings for a sharded restore; see `abstract_like`). The result
            has their tree structure, dtypes and shardings. Only what `like` names is read, so
            `{'actor': {'params': ...}}` reads the actor params and not the optimizer state. `like=None`
            reads only `host`.

        Returns:
          `{'host': dict, **like-shaped restored arrays}`.

        Raises:
          CheckpointError: no such step, or a part of `like` is missing from the checkpoint (named), or a
            shape/structure mismatch (orbax's message included).
        """
        step = self._resolve_step(step)
        ocp = self._ocp
        host = self.read_host(step)
        saved = set(host.get("items", []))
        want = flatten_items(dict(like or {}))
        missing = sorted(set(want) - saved)
        if missing:
            raise CheckpointError(
                f"checkpoint {self.step_path(step)} has no item(s) {missing} (it holds "
                f"{sorted(saved)}); the run config does not match the checkpointed run"
            )
        args = {k: ocp.args.StandardRestore(_wrap(abstract_like(v))) for k, v in want.items()}
        if not args:
            return {HOST_ITEM: host}
        try:
            out = self._open().restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # pylint: disable=broad-except
            raise CheckpointError(f"restoring {self.step_path(step)} failed ({type(e).__name__}: {e})") from e
        res = unflatten_items({k: _unwrap(out[k]) for k in args})
        res[HOST_ITEM] = host
        return res

    def restore_raw(self, item: str, step: int | None = None) -> Any:
        """One item (e.g. `'actor.params'`) as saved, as nested dicts of arrays, without a target structure,
        on one local device (any mesh or process count it was saved from)."""
        step = self._resolve_step(step)
        ocp = self._ocp
        target = None
        try:  # the saved shapes, placed on one device: a checkpoint of another topology restores too
            absl_log, level = logging.getLogger("absl"), logging.getLogger("absl").level
            absl_log.setLevel(logging.ERROR)  # "Metadata file does not exist" (the step's, not the item's)
            try:
                md = ocp.StandardCheckpointer().metadata(os.path.join(self.step_path(step), item)).item_metadata
            finally:
                absl_log.setLevel(level)
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            leaf = lambda m: hasattr(m, "shape") and hasattr(m, "dtype")
            sds = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one) if leaf(m) else m
            target = jax.tree.map(sds, getattr(md, "tree", md), is_leaf=leaf)
        except Exception:  # pylint: disable=broad-except  (no metadata: let orbax use the saved shardings)
            target = None
        out = self._open().restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(target)}))
        return _unwrap(out[item])

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory} (complete steps: {steps})"
            )
        return int(step)


def _check_json(host: Mapping[str, Any]) -> None:
    import json

    try:
        json.dumps(host)
    except (TypeError, ValueError) as e:
        raise ValueError(f"state['{HOST_ITEM}'] must be JSON-able: {e}") from e
