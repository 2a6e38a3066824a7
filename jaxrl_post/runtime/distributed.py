"""Multi-process (multi-host) runs: `jax.distributed` start-up and the host-side data conventions.

One JAX process per host (TPU pod worker, SLURM task, or several processes on one machine), all running
the same program; the mesh spans every device of every process.

Conventions of the host loop (trainer/):
- **Prompts are process-local.** Each process loads only its share of every global prompt batch: the rows
  its devices hold of a batch-sharded array (`local_rows`); the training loader slices its global batch
  (`PromptDataLoader.shard`) and the sampler builds the global arrays from the process-local rows
  (`global_from_local`, i.e. `jax.make_array_from_process_local_data`) and returns this process's rows.
- **Rewards are scored on local rows**, then the rollout is gathered with the ONE helper, `gather_rows`
  (`multihost_utils.process_allgather`), so that every process holds the same global host batch (the
  advantages, mini-batch shuffles and metrics are then computed identically everywhere).
- **Or the rows stay local** (`trainer.distributed.process_local_rows`, rl/local_rows.py): each process keeps its
  scored rows; forwards and updates get global arrays from them (`global_from_local`, `Placement.process_local_rows`)
  and return its rows; each process splits its own rows into its share of every mini-batch; metrics and reward
  counts are combined from per-process moments (`row_stats`). Only statistics cross processes.
- **Bytes received** through the host-side gathers here are counted (`received_bytes`: the step's
  `perf/host_gather_bytes`).
- **Validation is process-local too** (`rl/validation_loop.py`): each process generates and scores its
  block of rows of every held-out batch; the per-row results are gathered once (`gather_objects`).
- **Host numpy given to `sharding.shard_batch` is the global batch** (the same on every process); each
  process places its own slice (`jax.device_put` of a host value onto a global sharding); process-local rows go
  through `global_from_local`.
- **Device outputs come back with `to_host`**, which gathers a global array onto every process.
- Process 0 alone writes logs, metrics files, plots and HF exports (`is_main`); orbax checkpoints are
  written by all processes together.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import numpy as np

from jaxrl_post.runtime.sharding import batch_sharding

log = logging.getLogger(__name__)

# jax cluster environments auto-detected (as `jax.distributed.initialize()` does); MPI (mpi4py) and
# Kubernetes are opt-in in jax too: pass the keys explicitly there.
_AUTO_CLUSTERS = ("OmpiCluster", "SlurmCluster", "GceTpuCluster", "GkeTpuCluster")


class DistributedConfigError(ValueError):
    """Inconsistent `trainer.distributed.*` keys."""


def detect_cluster() -> str | None:
    """Name of the cluster environment `jax.distributed.initialize()` would auto-detect here, or None."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - private module moved: no auto-detection
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if env.__name__ not in _AUTO_CLUSTERS:
            continue
        try:
            if env.is_env_present():
                return env.__name__
        except Exception:  # a probe that cannot run (e.g. no metadata server) means: not this cluster
            log.debug("cluster probe %s failed: not this cluster", env.__name__, exc_info=True)
    return None


def check_keys(coordinator_address, num_processes, process_id) -> None:
    """Raises DistributedConfigError for keys that cannot describe a run (see `initialize`)."""
    if num_processes is not None and int(num_processes) < 1:
        raise DistributedConfigError(f"config.trainer.distributed.num_processes must be >= 1, got {num_processes}")
    if process_id is not None and int(process_id) < 0:
        raise DistributedConfigError(f"config.trainer.distributed.process_id must be >= 0, got {process_id}")
    if num_processes is not None and process_id is not None and int(process_id) >= int(num_processes):
        raise DistributedConfigError(
            f"config.trainer.distributed.process_id={process_id} must be < num_processes={num_processes}"
        )
    if coordinator_address is not None:
        host, _, port = str(coordinator_address).rpartition(":")
        if not host or not port.isdigit():
            raise DistributedConfigError(
                f"config.trainer.distributed.coordinator_address must be 'host:port', got {coordinator_address!r}"
            )
    explicit = [k is not None for k in (coordinator_address, num_processes, process_id)]
    single = coordinator_address is None and num_processes is not None and int(num_processes) == 1
    if any(explicit) and not all(explicit) and not single and detect_cluster() is None:
        raise DistributedConfigError(
            "config.trainer.distributed: set coordinator_address, num_processes and process_id together "
            "(or none of them, to auto-detect a TPU pod / SLURM / Open MPI cluster); got "
            f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, process_id={process_id!r}"
        )


def config_errors(cfg) -> list[str]:
    """Problems of the job config's `trainer.distributed.*` keys and of the per-process prompt share, as
    `config.<key>...: <problem>` lines (`runtime/config_checks.check_distributed` reports them with the others)."""
    import jax

    d, out = cfg.trainer.get("distributed"), []
    if d is None:  # a job config without the block: auto-detection only
        return out
    types = {"coordinator_address": (str, "None or 'host:port'"), "num_processes": (int, "None or an int >= 1")}
    types["process_id"] = (int, "None or an int >= 0")
    bad = False
    for key, (typ, what) in types.items():
        v = d[key]
        if v is not None and (not isinstance(v, typ) or isinstance(v, bool)):
            out.append(f"config.trainer.distributed.{key}={v!r}: must be {what}")
            bad = True
    if not bad:
        try:
            check_keys(d.coordinator_address, d.num_processes, d.process_id)
        except DistributedConfigError as e:
            out.append(str(e))
    n, b = jax.process_count(), cfg.data.train_batch_size
    if n > 1 and isinstance(b, int) and b % n:
        out.append(f"config.data.train_batch_size={b}: must be a multiple of the process count ({n})")
    return out


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> bool:
    """Start `jax.distributed` once, before any other JAX call; returns whether it was started.

    All three keys None: auto-detect a cluster (TPU pod slice, SLURM, Open MPI) as
    `jax.distributed.initialize()` does; nothing found -> a single-process run (nothing is called).
    `num_processes=1` with no address is a single-process run too. CPU processes get gloo collectives.

    Raises: DistributedConfigError (see `check_keys`).
    """
    check_keys(coordinator_address, num_processes, process_id)
    keys = (coordinator_address, num_processes, process_id)
    if all(k is None for k in keys) and detect_cluster() is None:
        return False
    if coordinator_address is None and num_processes is not None and int(num_processes) == 1:
        return False
    import jax

    if jax.distributed.is_initialized():
        return True
    try:  # CPU multi-process collectives (harmless on TPU/GPU, whose backends bring their own)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # pragma: no cover - option removed: the backend's own collectives are used
        log.debug("jax_cpu_collectives_implementation=gloo not available", exc_info=True)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=None if num_processes is None else int(num_processes),
        process_id=None if process_id is None else int(process_id),
    )
    log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())
    return True


def initialize_from_config(cfg) -> bool:
    """`initialize` with the job config's `trainer.distributed.*` keys (absent block = auto-detect)."""
    d = cfg.trainer.get("distributed") if hasattr(cfg.trainer, "get") else None
    if d is None:
        return initialize()
    return initialize(d.coordinator_address, d.num_processes, d.process_id)


def is_main() -> bool:
    """Whether this is process 0 (the one that logs, writes metrics files and exports)."""
    import jax

    return jax.process_index() == 0


def multi_process() -> bool:
    import jax

    return jax.process_count() > 1


# ------------------------------------------------------------------------------------------- rows
def local_rows(mesh, n: int) -> slice:
    """The rows of a `[n, ...]` batch-sharded array (leading dim over ('data', 'fsdp', 'expert')) that this process's
    devices hold, as one contiguous slice (all rows on a single process).

    Raises ValueError when they are not one contiguous block or `n` does not divide the batch axes."""

    sh = batch_sharding(mesh, 1)
    spans = set()
    for idx in sh.addressable_devices_indices_map((int(n),)).values():
        s = idx[0]
        spans.add((s.start or 0, n if s.stop is None else s.stop))
    spans = sorted(spans)
    lo, hi = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    if covered != hi - lo:
        raise ValueError(f"process {_pid()}: its rows of a batch of {n} are not one contiguous block: {spans}")
    return slice(lo, hi)


def _pid() -> int:
    import jax

    return jax.process_index()


def global_from_local(x: np.ndarray, mesh):
    """A global batch-sharded jax.Array from this process's rows (`jax.make_array_from_process_local_data`)."""
    import jax

    return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), np.asarray(x))


def local_part(x) -> np.ndarray:
    """This process's rows of a batch-sharded global jax.Array, in order (replicated copies counted once)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    by_start = {}
    for s in x.addressable_shards:
        by_start.setdefault(s.index[0].start or 0, s)
    return np.concatenate([np.asarray(by_start[k].data) for k in sorted(by_start)], axis=0)


def to_host(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-process) jax.Array as one host numpy array on every process."""
    import jax

    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    out = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    _count(out.nbytes - sum(s.data.nbytes for s in _unique_shards(x)))
    return out


def _unique_shards(x):
    seen, out = set(), []
    for s in x.addressable_shards:
        key = tuple((i.start, i.stop) for i in s.index)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


# bytes this process received through the host-side gathers below (`gather_rows`, `gather_objects`, `to_host`):
# each all-gather's result less this process's own part. Collectives inside jitted programs are not counted.
_RECEIVED = [0]


def _count(n: int) -> None:
    _RECEIVED[0] += max(int(n), 0)


def received_bytes() -> int:
    """Bytes this process has received through host-side gathers since the last `reset_received_bytes` (the
    `perf/host_gather_bytes` metric of a multi-process step)."""
    return _RECEIVED[0]


def reset_received_bytes() -> None:
    _RECEIVED[0] = 0


def gather_rows(tree: Any) -> Any:
    """THE gather of the host loop: every leaf holds this process's rows (leading dim); returns the leaves
    concatenated over processes in process order (numbers via `process_allgather`, objects pickled).
    Single process: returned as is. Every process must call it with the same tree structure and row count."""
    import jax

    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    def one(x):
        x = np.asarray(x)
        if x.dtype.kind in "biuf":
            out = np.asarray(multihost_utils.process_allgather(x, tiled=True))
            _count(out.nbytes - x.nbytes)
            return out
        return _gather_objects(x)

    return jax.tree.map(one, tree)


def _gather_objects(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    blob = np.frombuffer(pickle.dumps(x), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int64), tiled=True))
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[: blob.size] = blob
    allb = np.asarray(multihost_utils.process_allgather(padded[None], tiled=True))
    _count(sizes.nbytes - 8 + allb.nbytes - padded.nbytes)
    parts = [pickle.loads(allb[i, : int(sizes[i])].tobytes()) for i in range(len(sizes))]
    return np.concatenate(parts, axis=0)


def shard_loader(loader, mesh, n: int) -> bool:
    """Multi-process: make `loader` build only this process's prompts of each global batch (the prompts whose
    `n` responses this process's devices hold); returns whether it did (False on one process).

    Raises ValueError when the shares are not equal prompt-aligned blocks (a group would straddle processes)."""
    import jax

    if jax.process_count() == 1:
        return False
    b = int(loader.batch_size)
    own = local_rows(mesh, b * n)
    size = own.stop - own.start
    if own.start % n or size % n or size * jax.process_count() != b * n:
        raise ValueError(
            f"data.train_batch_size={b} x rollout.n={n} responses cannot be split into {jax.process_count()} equal "
            f"per-process blocks of whole prompt groups (process {jax.process_index()} holds rows {own}); make "
            "train_batch_size a multiple of the process count"
        )
    loader.shard(own.start // n, own.stop // n)
    return True


def gather_reward(res):
    """A `RewardOutput` of this process's rows -> the global one (every process): per-row fields gathered,
    error counts summed, `reward/extra/<k>/mean` recomputed over all rows, error messages concatenated."""
    import dataclasses

    import jax

    if jax.process_count() == 1:
        return res
    rows = {"tls": res.token_level_scores, "scores": res.scores}
    if res.function_scores is not None:
        rows["fs"] = res.function_scores
    g = gather_rows(rows)
    # per-process python values (extra keys may differ between processes: a key no row of a process returned)
    mine = {"extra": res.extra_infos, "errors": res.errors, "metrics": res.metrics, "n": len(res.scores)}
    parts = gather_objects(mine)
    extra: dict[str, np.ndarray] = {}
    for k in sorted({k for p in parts for k in p["extra"]}):
        vals = [np.asarray(p["extra"][k]) if k in p["extra"] else np.full((p["n"],), np.nan, np.float32) for p in parts]
        extra[k] = (
            np.concatenate(vals)
            if all(v.dtype.kind == "f" for v in vals)
            else np.concatenate([v.astype(object) for v in vals])
        )
    metrics = {
        k: float(sum(p["metrics"].get(k, 0.0) for p in parts)) for k in ("reward/num_errors", "reward/num_timeouts")
    }
    for k, v in extra.items():
        if v.dtype.kind == "f" and np.isfinite(v).any():
            metrics[f"reward/extra/{k}/mean"] = float(np.nanmean(v))
    return dataclasses.replace(
        res,
        token_level_scores=g["tls"],
        scores=g["scores"],
        metrics=metrics,
        extra_infos=extra,
        errors=[e for p in parts for e in p["errors"]][:8],
        function_scores=g.get("fs"),
    )


def gather_objects(x: Any) -> list[Any]:
    """Every process's Python value `x` (picklable), in process order; `[x]` on one process. Every process
    must call it (like `gather_rows`, of which it is the one-object-per-process case)."""
    import jax

    if jax.process_count() == 1:
        return [x]
    return list(_gather_objects(_one(x)))


def _one(x) -> np.ndarray:
    out = np.empty((1,), object)
    out[0] = x
    return out


class NullTracker:
    """The metrics tracker of processes other than 0: logs nothing (process 0 writes console + files)."""

    def log(self, data, step: int) -> None:
        del data, step

    def close(self) -> None:
        pass
