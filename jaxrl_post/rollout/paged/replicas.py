"""Data-parallel replicas of the paged engine: one SPMD program runs every replica's dispatch; the host admits
prompts to replicas from a shared queue (`admission.py`).

On a rollout mesh ('data', 'fsdp', 'expert', 'tensor') = (D, 1, 1, tp) the engine holds D replicas (vLLM's data
parallelism: D engine instances of tp chips each). Every per-replica array has a leading replica dim `[D, ...]`
sharded over 'data' (the pool `[D, L, P, page_size, 2N, K]`, logits `[D, S, V]`, slot vectors `[D, S]`, page tables
`[D, S, pages_per_seq]`, a prefill chunk `[D, 1, T]`); the weights are replicated over 'data' and split over
'tensor'. `replica_map` runs a one-replica program body under `jax.shard_map` with 'data' manual, so each data
index runs its own replica with no communication across replicas; 'tensor' stays automatic (GSPMD partitions the
body over heads as on a tensor-only mesh), or, with tp = 1, every axis is manual (the body is a plain one-device
program, so a single-device kernel runs in it). Without a mesh, or with one replica, the body runs on the one
replica directly (no `shard_map`).

`assign_groups` places prompts before the first dispatch, the static baseline (`admission.ReplicaSchedulers(
queue="static")`; a prompt's `n` samples share its prompt pages, so they stay on one replica): balanced by count,
then by prompt tokens (vLLM's DP load balancer and verl's server manager balance by request counts).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxrl_post.runtime.sharding import constrain

REPLICA_AXIS = "data"


def num_replicas(mesh) -> int:
    """Replicas of an engine on `mesh`: its 'data' size (1 without a mesh)."""
    return 1 if mesh is None else int(dict(mesh.shape).get(REPLICA_AXIS, 1))


def replica_map(body, shared: tuple, mapped: tuple, out_names: tuple = ()):
    """`body(*shared, *mapped_r)` for every replica r, stacked: `mapped` are pytrees whose leaves have a leading
    replica dim `[D, ...]` (body sees `[...]`), `shared` the same for every replica (weights, sampling key). Returns
    body's outputs (a tuple of arrays) with a leading `[D]`, constrained under an ambient mesh to 'data' there and,
    within a replica, to the logical names `out_names[i]` of output i (`sharding.LOGICAL_AXIS_RULES`; outputs past
    them replicated within the replica), so the outputs keep their inputs' layout (compile once)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh is None or mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sizes.get(REPLICA_AXIS, 1) == 1:
        out = body(*shared, *jax.tree.map(lambda x: x[0], mapped))
        return _on_replicas(tuple(o[None] for o in out), out_names)
    if sizes.get("tensor", 1) > 1:
        manual = frozenset({REPLICA_AXIS})  # 'tensor' automatic: GSPMD splits the heads inside a replica
    else:
        manual = frozenset(mesh.axis_names)  # one device per replica: a plain single-device body

    def local(sh, mp):
        out = body(*sh, *jax.tree.map(lambda x: x[0], mp))
        return tuple(o[None] for o in out)

    # check_vma off: jnp.searchsorted (the XLA attention's query -> sequence map) fails its varying-axes check
    sm = jax.shard_map(
        local, in_specs=(P(), P(REPLICA_AXIS)), out_specs=P(REPLICA_AXIS), axis_names=manual, check_vma=False
    )
    return _on_replicas(sm(tuple(shared), tuple(mapped)), out_names)


def _on_replicas(outs: tuple, out_names: tuple) -> tuple:
    """`outs` (each `[D, ...]`) with the leading dim on 'data' and the rest as `out_names` (no-op without an
    ambient mesh)."""
    names = tuple(out_names) + (None,) * (len(outs) - len(out_names))
    return tuple(constrain(o, ("replica", *(n or (None,) * (o.ndim - 1)))) for o, n in zip(outs, names))


def assign_groups(group_tokens: list[int], replicas: int) -> list[int]:
    """The replica of each prompt group, in order: the one holding the fewest groups so far, ties to the fewest
    prompt tokens so far (`group_tokens [G]`: a group's prompt tokens x its samples), then the lowest index.
    Counts differ by at most one between replicas."""
    count, tokens, out = [0] * replicas, [0] * replicas, []
    for t in group_tokens:
        r = min(range(replicas), key=lambda i: (count[i], tokens[i], i))
        count[r] += 1
        tokens[r] += int(t)
        out.append(r)
    return out
