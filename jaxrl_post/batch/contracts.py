"""Stage contracts: which batch keys a pipeline stage reads and writes, checked where the stage starts and ends.

A training step passes one `DataProto` from stage to stage (rollout -> log-probs -> advantages -> updates). Each
stage declares a `StageContract` over the one table of batch keys (`batch/keys.py`); `checked_stage` enforces it:

* on entry: every key of the batch is in the table, and every key the stage `reads` is present;
* on exit: every key the stage `writes` is present, nothing else was added (`may_write` lists the keys a stage
  writes only in some configurations), no key was removed, and no array the stage did not declare as a write was
  replaced (checked by identity: a function cannot rewrite `old_log_probs` behind its caller's back), and every
  array still has the batch's leading dimension.

A broken contract is a bug in the pipeline, not bad user input: `StageContractError` names the stage and the
keys. The checks are dictionary operations on the host (microseconds per stage, no array is read).

Source: the stage / key bookkeeping verl's `RayPPOTrainer.fit()` does by convention on its `DataProto` (each
worker call `union`s the keys it produced); the explicit declaration and check are this project's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from jaxrl_post.batch.keys import BATCH_KEYS
from jaxrl_post.batch.protocol import DataProto


class StageContractError(RuntimeError):
    """A stage read a key that is not there, wrote one it did not declare, or replaced / removed one."""


@dataclass(frozen=True)
class StageContract:
    """The batch keys of one stage: `reads` must be present on entry; `may_read` are read when present; `writes`
    must be present on exit; `may_write` may appear (configuration-dependent outputs). Every name must be in
    `batch.keys.BATCH_KEYS` (checked at construction: raises KeyError naming the stage)."""

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    may_read: tuple[str, ...] = ()
    may_write: tuple[str, ...] = ()

    def __post_init__(self):
        for group in (self.reads, self.writes, self.may_read, self.may_write):
            unknown = [k for k in group if k not in BATCH_KEYS]
            if unknown:
                raise KeyError(f"stage {self.name!r} declares keys not in the batch-key table: {unknown}")


def check_entry(contract: StageContract, batch: dict) -> None:
    """Raises StageContractError when `batch` holds a key outside the table or lacks one of `contract.reads`."""
    unknown = sorted(k for k in batch if k not in BATCH_KEYS)
    if unknown:
        raise StageContractError(f"stage {contract.name!r}: batch keys not in the batch-key table: {unknown}")
    missing = [k for k in contract.reads if k not in batch]
    if missing:
        raise StageContractError(f"stage {contract.name!r} reads {missing}, missing from the batch")


def check_exit(contract: StageContract, before: dict, batch: dict) -> None:
    """Raises StageContractError when `batch` (after the stage) lacks a declared write, gained an undeclared key,
    lost a key, or had an undeclared key's array replaced, relative to `before` (a shallow copy taken on entry)."""
    name = contract.name
    allowed = set(contract.writes) | set(contract.may_write)
    missing = [k for k in contract.writes if k not in batch]
    if missing:
        raise StageContractError(f"stage {name!r} did not write {missing}")
    added = sorted(set(batch) - set(before) - allowed)
    if added:
        raise StageContractError(f"stage {name!r} wrote undeclared keys {added}")
    removed = sorted(set(before) - set(batch))
    if removed:
        raise StageContractError(f"stage {name!r} removed keys {removed}")
    replaced = sorted(k for k in before if k not in allowed and batch[k] is not before[k])
    if replaced:
        raise StageContractError(f"stage {name!r} replaced undeclared keys {replaced}")


class StagedBatch:
    """A `DataProto` that moves through contracted stages (`stage`); between two stages nobody may touch its
    arrays: the next `stage` (and `finish`) raise StageContractError naming the last stage when a key was added,
    removed or replaced outside a stage."""

    def __init__(self, data: DataProto | None = None):
        self.data = DataProto() if data is None else data
        self._last = "start"
        self._snapshot = dict(self.data.batch)

    def _check_untouched(self) -> None:
        batch = self.data.batch
        if batch.keys() != self._snapshot.keys() or any(batch[k] is not v for k, v in self._snapshot.items()):
            changed = sorted(
                set(batch) ^ set(self._snapshot) | {k for k in batch if batch[k] is not self._snapshot.get(k)}
            )
            raise StageContractError(f"batch keys {changed} changed outside a stage, after stage {self._last!r}")

    @contextlib.contextmanager
    def stage(self, contract: StageContract) -> Iterator[dict]:
        """Runs the body as stage `contract` over `data.batch` (yielded; the body writes its outputs into it):
        `check_entry` before, `check_exit` and the leading-dim check after (not when the body raises: its own
        error propagates)."""
        self._check_untouched()
        batch = self.data.batch
        check_entry(contract, batch)
        before = dict(batch)
        yield batch
        check_exit(contract, before, batch)
        try:
            self.data.check_consistency()
        except ValueError as e:
            raise StageContractError(f"stage {contract.name!r}: {e}") from e
        self._last, self._snapshot = contract.name, dict(batch)

    def finish(self) -> dict:
        """The batch after the last stage (checked untouched since)."""
        self._check_untouched()
        return self.data.batch
