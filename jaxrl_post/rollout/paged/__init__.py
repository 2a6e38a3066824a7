"""Paged, continuously batched rollout engine (issue 56), built in layers: a host-side page allocator with
reference-counted prompt pages shared by a prompt's `n` samples (`allocator`), a per-layer KV page pool stacked
over layers and attention over it (`kv_pool`, `attention`: an exact XLA gather for CPU/GPU/tests, the Pallas
`ragged_paged_attention` kernel on TPU), a host-side scheduler that admits waiting sequences into a fixed slot
batch as pages allow and retires finished ones (`scheduler`), and the engine that runs the project's decoder over
the pool with `K` decode steps per dispatch (`engine`). Today's dense `rollout.generate.Generator` stays the
default and the exactness reference (docs/paged_rollout.md says what is done and what is not).
"""
