"""Per-device memory of the actor update at Qwen2.5-1.5B / 7B and Qwen3-30B-A3B shapes, from XLA's own buffer
assignment.

    python scripts/memory_plan.py [--plans lora_7b_v5e8,full_1p5b_gpu80] [--json /tmp/memory_plan.json]
        [--layers N]   # fewer layers: a quick look only (the table says so)
    python scripts/memory_plan.py --rollout   # the paged rollout's KV pages and resident sequences per chip

No weights and no accelerator: the model is built abstractly (`nnx.eval_shape`), the REAL packed update
(`packed_steps.make_packed_actor_update`, the trainer's `update` boundary, with the shardings of
`placement.Placement.jit_update` / `put_packed` and `sharding.init_opt_state`) is lowered with `jax.ShapeDtypeStruct`
arguments on a fake mesh of host devices (`--xla_force_host_platform_device_count=64`, set here before jax
is imported; a plan uses its first `devices`) and compiled by XLA:CPU; `compiled.memory_analysis()` gives
per-device bytes of arguments, outputs, aliased (donated) buffers and temporaries. Total = arguments + outputs -
aliased + temporaries.

Resident beyond the update's arguments (computed from the abstract shapes and shardings, not compiled): the
reference copy in the compute dtype (a KL term on; never with LoRA: the reference is the base with its
adapters off) and the rollout copy (`rollout.dtype` != the params' dtype; a LoRA rollout copy holds the
merged kernels). "Update peak" = update total + those. The rollout's KV cache (`rollout KV`, per device,
from the shapes) lives during generation, when the update's temporaries do not.

Attention (`--attention`): the fused kernels these platforms default to (splash on TPU, cuDNN flash attention
on GPU in bf16) cannot compile on XLA:CPU, so by default the plans compile the 'chunked' backend
(models/attention.py: exact attention in query blocks of 512, one block's float32 scores live), the stand-in
for a flash kernel's memory (a kernel holds less: no block of scores at all). `--attention xla` compiles the
dense path instead: its `[rows, heads, T, T]` float32 scores are in the temps (the `attn dense` column gives
one layer's per device).

MoE plans (Qwen3-30B-A3B) split the experts over an `expert` mesh axis (`models/moe_ep.py`). Two XLA:CPU
limits are replaced by memory stand-ins for the duration of the compile (`moe_memory_standins`): JAX lowers
`jax.lax.ragged_dot` on CPU to a dense masked matmul holding a `[G, M, K]` copy of the rows per group (17 GB
per call at 30B-A3B shapes; TPU / GPU lower it natively), so it becomes a plain `[M, K] @ [K, N]` dot of the
same shapes; XLA:CPU cannot compile `ragged_all_to_all`, so the exchange becomes a local write of the operand
into the `[ep*N*k, D]` receive buffer (the buffers the ragged collective holds, no communication). The plan's
program is then not the one that runs, only its buffers are.

What this does NOT measure: XLA:CPU's fusion and buffer assignment differ from XLA:TPU / XLA:GPU (temps are
an estimate of theirs), and the kernels themselves.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported (not when a test imports this file's helpers)
    os.environ["JAX_PLATFORMS"] = "cpu"
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=64").strip()

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_post.engine import packed_steps, packing, steps
from jaxrl_post.models import get_preset, moe_ep
from jaxrl_post.models.decoder import Transformer
from jaxrl_post.models.lora import LoRAConfig, apply_lora
from jaxrl_post.rl import ppo_update
from jaxrl_post.rollout.paged import plan as paged_plan
from jaxrl_post.runtime.sharding import LOGICAL_AXIS_RULES, InMesh, make_mesh, param_shardings

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
    """One memory target: model preset, mesh, dtypes, batch geometry and the per-device budget (GB)."""

    name: str
    preset: str
    devices: int  # mesh (data 1, fsdp devices / expert, expert, tensor 1)
    budget_gb: float
    target: str
    lora_rank: int = 0  # 0: full fine-tuning
    param_dtype: str = "float32"  # master weights (LoRA: the frozen base's storage dtype)
    dtype: str = "bfloat16"  # compute dtype
    rollout_dtype: str = "bfloat16"
    use_kl: bool = True
    prompt_len: int = 512
    response_len: int = 3584  # 4k tokens per sample
    n_prompts: int = 8
    n: int = 16  # samples per prompt (rollout.n); mini-batch = n_prompts * n
    rows_per_device: int = 1  # packed rows of prompt_len + response_len tokens per device per micro-batch
    remat: bool = True
    scan_layers: bool = True
    expert: int = 1  # expert-parallel axis size (MoE presets)


def _moe_plans():
    """Qwen3-30B-A3B (30.5B parameters, 128 experts, top-8): LoRA and full fine-tuning on v5p-8, v5p-64 (95 GB
    of HBM per chip) and 8 x H100 (80 GB), experts split 8 ways (expert=8: 16 experts per device)."""
    out = []
    for where, devices, budget in (("v5p8", 8, 95.0), ("v5p64", 64, 95.0), ("h100x8", 8, 80.0)):
        for lora in (True, False):
            out.append(
                Plan(
                    name=f"{'lora' if lora else 'full'}_30b_a3b_{where}",
                    preset="qwen3_30b_a3b",
                    devices=devices,
                    budget_gb=budget,
                    target=f"{'LoRA r=32' if lora else 'full'} Qwen3-30B-A3B GRPO on {where} (expert=8)",
                    lora_rank=32 if lora else 0,
                    param_dtype="bfloat16" if lora else "float32",
                    expert=8,
                )
            )
    return out


PLANS = {
    p.name: p
    for p in (
        Plan(
            name="lora_7b_v5e8",
            preset="qwen2_5_7b",
            devices=8,
            budget_gb=16.0,
            target="LoRA 7B GRPO fits 16 GB per chip on v5e-8 (mesh fsdp=8)",
            lora_rank=32,
            param_dtype="bfloat16",
        ),
        Plan(
            name="full_1p5b_gpu80",
            preset="qwen2_5_1_5b",
            devices=1,
            budget_gb=80.0,
            target="full fine-tuning of 1.5B fits one 80 GB GPU at 8 x 16 samples of 4k tokens",
            rows_per_device=2,
        ),
        Plan(  # the plan of tests/scripts/test_memory_plan.py (--layers 2): compiles in seconds
            name="smoke_135m",
            preset="smollm2_135m",
            devices=8,
            budget_gb=16.0,
            target="(smoke test) SmolLM2-135M shapes, short rows",
            prompt_len=64,
            response_len=64,
            n_prompts=1,
            n=8,
            use_kl=False,
        ),
        Plan(
            name="full_7b_v5e8",
            preset="qwen2_5_7b",
            devices=8,
            budget_gb=16.0,
            target="(not a target) full fine-tuning of 7B on v5e-8: f32 masters + Adam alone are 11.4 GB/chip",
        ),
        *_moe_plans(),
    )
}


def _gmm_standin(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, **_):
    """Memory stand-in for a native grouped matmul: lhs `[M, K]` @ rhs[0] `[K, N]` (same output, no copies)."""
    del group_sizes, precision
    return jnp.dot(lhs, rhs[0].astype(lhs.dtype), preferred_element_type=preferred_element_type)


def _exchange_standin(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """Memory stand-in for `ragged_all_to_all`: the operand written into the output buffer, no communication."""
    del input_offsets, send_sizes, output_offsets, recv_sizes, axis_name
    n = min(operand.shape[0], output.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(output, operand[:n], 0, axis=0)


@contextlib.contextmanager
def moe_memory_standins():
    """Within: `jax.lax.ragged_dot` -> `_gmm_standin`, the CPU exchange of `moe_ep` -> `_exchange_standin`."""
    saved = jax.lax.ragged_dot, moe_ep.padded_ragged_all_to_all
    jax.lax.ragged_dot, moe_ep.padded_ragged_all_to_all = _gmm_standin, _exchange_standin
    try:
        yield
    finally:
        jax.lax.ragged_dot, moe_ep.padded_ragged_all_to_all = saved


def _bytes(tree) -> int:
    """Per-device bytes of a tree of ShapeDtypeStructs / arrays with NamedShardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def build(plan: Plan, layers: int | None, attention: str = "chunked"):
    """Abstract model -> (graphdef, params, frozen | None, rest, model config) with shardings on the mesh;
    `attention`: the backend of the update's forwards ('chunked' or 'xla')."""
    cfg = get_preset(plan.preset)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    fsdp = plan.devices // plan.expert
    mesh = make_mesh(data=1, fsdp=fsdp, expert=plan.expert, tensor=1, devices=jax.devices()[: plan.devices])

    def make():
        m = Transformer(
            cfg,
            rngs=nnx.Rngs(0),
            dtype=jnp.dtype(plan.dtype),
            param_dtype=jnp.dtype(plan.param_dtype),
            remat=plan.remat,
            scan_layers=plan.scan_layers,
        )
        if plan.lora_rank:
            apply_lora(m, LoRAConfig(plan.lora_rank, 2.0 * plan.lora_rank))
        m.set_attention_impl(attention)
        return m

    model = nnx.eval_shape(make)
    if plan.lora_rank:
        graphdef, params, frozen, rest = steps.split_lora_model(model)
    else:
        (graphdef, params, rest), frozen = steps.split_model(model), None
    shard = lambda st: _abstract(st, jax.tree.map(lambda v: v, param_shardings(st, mesh)))
    params = shard(params)
    frozen = None if frozen is None else shard(frozen)
    return mesh, cfg, graphdef, params, frozen, rest


def packed_inputs(plan: Plan, mesh, vocab: int) -> dict:
    """Abstract packed mini-batch (shapes of `packing.pack_batch` + the `[M, R]` fields), placed as
    `placement.Placement.put_packed` places it."""
    m = plan.n_prompts * plan.n
    t = plan.prompt_len + plan.response_len
    rows, row_len = packing.micro_geometry(
        micro_batch_size=plan.rows_per_device * plan.devices,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=None,
        seq_len=t,
        seqs_per_row=1,
        dp=plan.devices,
        n_seqs=m,
    )
    # slots in per-shard blocks over the batch axes, as `placement.pack_spec` makes them
    spec = packing.make_pack_spec(m, rows, plan.prompt_len, plan.response_len, row_len=row_len, shards=plan.devices)
    n, q, s, r = spec.n_micro, spec.slots, spec.seqs, plan.response_len
    rows_sh = NamedSharding(mesh, P(None, LOGICAL_AXIS_RULES["batch"], None))
    rep = NamedSharding(mesh, P())
    bat = lambda nd: NamedSharding(mesh, P(LOGICAL_AXIS_RULES["batch"], *([None] * (nd - 1))))
    sds = jax.ShapeDtypeStruct
    batch = {k: sds((n, rows, row_len), jnp.int32, sharding=rows_sh) for k in ("input_ids", "segment_ids", "positions")}
    if spec.shards > 1:  # shard-local `slot_pos [n, shards, Q / shards]`, sharded with the rows
        batch["slot_pos"] = sds((n, spec.shards, spec.block_slots), jnp.int32, sharding=rows_sh)
    else:
        batch["slot_pos"] = sds((n, q), jnp.int32, sharding=rep)
    batch["slot_tokens"] = sds((n, q), jnp.int32, sharding=rep)
    batch.update(seq_slot=sds((n, s, r), jnp.int32, sharding=rep), seq_index=sds((n, s), jnp.int32, sharding=rep))
    for k, dt in (("responses", jnp.int32), ("loss_mask", jnp.int32), ("advantages", jnp.float32)):
        batch[k] = sds((m, r), dt, sharding=bat(2))
    batch["old_log_probs"] = sds((m, r), jnp.float32, sharding=bat(2))
    if plan.use_kl and True:
        batch["ref_log_prob"] = sds((m, r), jnp.float32, sharding=bat(2))
    return batch, spec


def run_plan(plan: Plan, layers: int | None, attention: str = "chunked") -> dict:
    t0 = time.perf_counter()
    mesh, cfg, graphdef, params, frozen, rest = build(plan, layers, attention)
    tx = steps.make_optimizer(steps.OptimConfig(lr=1e-6))
    import optax

    rep = NamedSharding(mesh, P())
    opt_abs = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_map_params(
        tx, lambda _, sh: sh, opt_abs, jax.tree.map(lambda x: x.sharding, params), transform_non_params=lambda _: rep
    )
    opt_state = _abstract(opt_abs, opt_sh)
    use_kl_loss = plan.use_kl
    loss_cfg = ppo_update.ActorLossConfig(use_kl_loss=use_kl_loss)
    batch, spec = packed_inputs(plan, mesh, cfg.vocab_size)
    fn = ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, loss_cfg)
    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
    jitted = jax.jit(fn, donate_argnums=(0, 1), out_shardings=(shard(params), shard(opt_state), None))
    extra = () if frozen is None else (frozen,)
    standins = moe_memory_standins() if cfg.num_experts else contextlib.nullcontext()
    with jax.set_mesh(mesh), standins:
        lowered = InMesh(jitted, mesh).lower(params, opt_state, batch, *extra)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    arg, out, alias, temp = (
        ma.argument_size_in_bytes,
        ma.output_size_in_bytes,
        ma.alias_size_in_bytes,
        ma.temp_size_in_bytes,
    )
    total = arg + out - alias + temp
    # resident outside the update's arguments (from shapes): reference copy and rollout copy
    cdt, rdt = jnp.dtype(plan.dtype), jnp.dtype(plan.rollout_dtype)
    base = frozen if frozen is not None else params
    cast = lambda dt: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dt if x.ndim >= 2 else x.dtype, sharding=x.sharding), base
    )
    ref_b = _bytes(cast(cdt)) if plan.use_kl and frozen is None else 0
    rollout_copy = not (rdt == cdt == jnp.dtype(plan.param_dtype))
    rollout_b = _bytes(cast(rdt)) if rollout_copy else 0
    seqs = plan.n_prompts * plan.n
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * rdt.itemsize
    kv_b = per_token * seqs * (plan.prompt_len + plan.response_len) // plan.devices
    rows_dev = spec.rows // plan.devices
    attn_b = rows_dev * cfg.num_heads * spec.row_len**2 * 4
    peak = total + ref_b + rollout_b
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(base))
    rec = dict(
        plan=plan.name,
        target=plan.target,
        model=plan.preset,
        layers=cfg.num_layers,
        layers_note="all layers" if not layers else f"REDUCED to {layers} layers: not the model's numbers",
        params_b=round(n_params / 1e9, 3),
        mode=f"LoRA r={plan.lora_rank}" if plan.lora_rank else "full",
        mesh=f"fsdp={plan.devices // plan.expert}" + (f" x expert={plan.expert}" if plan.expert > 1 else ""),
        param_dtype=plan.param_dtype,
        compute_dtype=plan.dtype,
        remat=plan.remat,
        scan_layers=plan.scan_layers,
        attention=attention,
        mini_batch=f"{plan.n_prompts} x {plan.n} samples of {plan.prompt_len}+{plan.response_len} tokens",
        micro_batch=f"{spec.rows} rows x {spec.row_len} tokens ({rows_dev} per device), {spec.n_micro} micro-batches",
        arguments_gb=arg / GB,
        outputs_gb=out / GB,
        aliased_gb=alias / GB,
        temps_gb=temp / GB,
        update_total_gb=total / GB,
        reference_gb=ref_b / GB,
        rollout_copy_gb=rollout_b / GB,
        update_peak_gb=peak / GB,
        rollout_kv_gb=kv_b / GB,
        attn_dense_scores_per_layer_gb=attn_b / GB,
        budget_gb=plan.budget_gb,
        fits=bool(peak / GB <= plan.budget_gb),
        bytes=dict(arguments=arg, outputs=out, aliased=alias, temps=temp, reference=ref_b, rollout_copy=rollout_b),
        trace_lower_s=round(t1 - t0, 1),
        compile_s=round(t2 - t1, 1),
    )
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}


COLS = (
    ("plan", "plan", "{}"),
    ("mode", "mode", "{}"),
    ("mesh", "mesh", "{}"),
    ("attention", "attention", "{}"),
    ("arguments_gb", "args", "{:.2f}"),
    ("outputs_gb", "outs", "{:.2f}"),
    ("aliased_gb", "alias", "{:.2f}"),
    ("temps_gb", "temps", "{:.2f}"),
    ("update_total_gb", "update", "{:.2f}"),
    ("reference_gb", "ref", "{:.2f}"),
    ("rollout_copy_gb", "rollout copy", "{:.2f}"),
    ("update_peak_gb", "peak", "{:.2f}"),
    ("budget_gb", "budget", "{:.0f}"),
    ("fits", "fits", "{}"),
    ("rollout_kv_gb", "rollout KV", "{:.2f}"),
    ("attn_dense_scores_per_layer_gb", "attn dense", "{:.2f}"),
)


def table(rows: list[dict]) -> str:
    """Markdown table of the records (GB per device)."""
    head = "| " + " | ".join(h for _, h, _ in COLS) + " |"
    sep = "|" + "---|" * len(COLS)
    body = ["| " + " | ".join(f.format(r[k]) for k, _, f in COLS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="lora_7b_v5e8,full_1p5b_gpu80", help=f"comma list of {sorted(PLANS)}")
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (quick look; not the real numbers)")
    ap.add_argument("--response-len", type=int, default=None, help="override every plan's response length")
    ap.add_argument("--attention", default="chunked", choices=("chunked", "xla"), help="update's attention backend")
    ap.add_argument("--json", default=None, help="also write the records here")
    ap.add_argument("--rollout", action="store_true", help="the paged rollout's rows instead (rollout/paged/plan.py)")
    args = ap.parse_args(argv)
    if args.rollout:  # arithmetic on the shapes: KV pages, resident sequences, bytes per chip
        rows = paged_plan.rollout_rows()
        print(paged_plan.rollout_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return rows
    rows = []
    for name in args.plans.split(","):
        if name not in PLANS:
            ap.error(f"--plans: unknown plan {name!r}; valid: {sorted(PLANS)}")
        plan = PLANS[name]
        if args.response_len:
            plan = dataclasses.replace(plan, response_len=args.response_len)
        rec = run_plan(plan, args.layers, args.attention)
        print(f"{name}: compiled in {rec['compile_s']} s (trace + lower {rec['trace_lower_s']} s)", flush=True)
        rows.append(rec)
    print(table(rows))
    for r in rows:
        print(f"{r['plan']}: {r['target']} -> {'MET' if r['fits'] else 'NOT MET'} ({r['layers_note']})")
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
