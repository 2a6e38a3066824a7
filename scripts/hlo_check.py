"""Lower and inspect the main programs for accelerators without one: TPU / CUDA lowering, FSDP all-gathers, LM head.

    python scripts/hlo_check.py [--json /tmp/hlo_check.json]

On 8 fake host devices (`--xla_force_host_platform_device_count=8`, set here before jax is imported) and a
tiny random model on a (data 1, fsdp 4, tensor 2) mesh, builds the trainer's jitted programs as the trainer
builds them (`placement.Placement.jit_update` / `put_packed` / `commit`, the packed steps of `packed_steps.py`,
the rollout's `_prefill` / `_decode` recorded from a real `Generator.generate` call):

* generate (prefill + decode), old log-prob (packed forward), actor update, critic update;
* each is lowered for `tpu` and `cuda` (`jit(...).trace(...).lower(lowering_platforms=(p,))`): a failure
  there (a host callback, a CPU-only op) is reported with its error;
* each is compiled for the CPU mesh and its HLO inspected: all-gathers in the entry computation (outside
  every loop: a weight gathered there stays whole on every device for the whole program) vs inside
  loops / called computations; and for the update and forward the shapes of the LM head's `dot`s whose
  output has the per-device vocab size: their slot dimension is `slots / fsdp` when the head's slots are
  sharded with their rows, `slots` when every fsdp device computes all of them.

Both layer layouts are checked: unrolled (`model.scan_layers` off) and scanned. Prints one JSON object
(`programs` -> per-program record); `tests/scripts/test_hlo_checks.py` runs this in a subprocess and asserts on it.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported (not when a test imports this file's helpers)
    os.environ["JAX_PLATFORMS"] = "cpu"
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import argparse
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_post.engine import packed_steps, packing, steps, update_core
from jaxrl_post.engine.placement import Placement
from jaxrl_post.models import CriticModel, ModelConfig, init_model
from jaxrl_post.rl import ppo_update
from jaxrl_post.runtime.sharding import make_mesh

MESH = dict(data=1, fsdp=4, tensor=2)
# distinctive sizes, so the LM head's dots are found by shape: vocab / tensor = 192, hidden 96 (24 per fsdp)
TINY = ModelConfig(
    family="llama",
    vocab_size=384,
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=24,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
M, P_LEN, R_LEN, MICRO = 16, 8, 8, 8  # mini-batch, prompt, response, rows per packed micro-batch


def _Placer(mesh) -> Placement:
    """The trainer's placement and jit helpers (`placement.Placement`) on a bare mesh."""
    return Placement(mesh, n_devices=mesh.size)


def all_gathers(hlo: str) -> dict:
    """Counts of all-gather ops in the ENTRY computation and in every other computation of an HLO module text."""
    entry = other = 0
    in_entry = False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
        elif line and not line.startswith(" ") and line.rstrip().endswith("{"):
            in_entry = False
        n = len(re.findall(r"\ball-gather(?:-start)?\(", line))
        if in_entry:
            entry += n
        else:
            other += n
    return {"entry": entry, "in_loops_or_called": other, "total": entry + other}


def head_slot_dims(hlo: str, vocab_local: int, exclude: set[int]) -> list[int]:
    """Sizes of the non-vocab dim of rank-2 `dot` outputs that have a `vocab_local` dim (the LM head's logits
    and their gradients), excluding the hidden sizes in `exclude`."""
    out = set()
    for m in re.finditer(r"= f32\[(\d+),(\d+)\]\{[^}]*\} dot\(", hlo):
        a, b = int(m.group(1)), int(m.group(2))
        for x, y in ((a, b), (b, a)):
            if y == vocab_local and x not in exclude:
                out.add(x)
    return sorted(out)


def lowers_for(jitted, args, kwargs=None) -> dict:
    """{'tpu': 'ok' | error, 'cuda': 'ok' | error} of lowering `jitted(*args)` for each platform."""
    res = {}
    for plat in ("tpu", "cuda"):
        try:
            jitted.trace(*args, **(kwargs or {})).lower(lowering_platforms=(plat,))
            res[plat] = "ok"
        except Exception as e:  # reported, the test asserts 'ok'
            res[plat] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def inspect(name, jitted, args, mesh, kwargs=None, head=False) -> dict:
    with jax.set_mesh(mesh):
        rec = {"lowers": lowers_for(jitted, args, kwargs)}
        hlo = jitted.trace(*args, **(kwargs or {})).lower().compile().as_text()
    rec["all_gathers"] = all_gathers(hlo)
    if head:
        tp, fsdp = MESH["tensor"], MESH["fsdp"]
        rec["head_slot_dims"] = head_slot_dims(hlo, TINY.vocab_size // tp, {TINY.hidden_size, TINY.hidden_size // fsdp})
    return rec


def fake_batch(rng: np.random.Generator) -> dict:
    """A GRPO-shaped mini-batch: left-padded prompts of 5-8 tokens, responses of 3-8 tokens."""
    p_len = rng.integers(5, P_LEN + 1, M)
    r_len = rng.integers(3, R_LEN + 1, M)
    am = np.concatenate([np.arange(P_LEN)[None] >= P_LEN - p_len[:, None], np.arange(R_LEN)[None] < r_len[:, None]], 1)
    ids = (rng.integers(3, TINY.vocab_size, (M, P_LEN + R_LEN)) * am).astype(np.int32)
    rmask = am[:, P_LEN:].astype(np.int32)
    return dict(
        input_ids=ids,
        attention_mask=am.astype(np.int32),
        position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
        responses=ids[:, P_LEN:].copy(),
        loss_mask=rmask,
        response_attention_mask=rmask,
        advantages=(rng.normal(size=(M, 1)) * rmask).astype(np.float32),
        old_log_probs=np.zeros((M, R_LEN), np.float32),
        values=np.zeros((M, R_LEN), np.float32),
        returns=(rng.normal(size=(M, R_LEN)) * rmask).astype(np.float32),
    )


def trainer_programs(mesh, scan: bool) -> dict:
    """Old log-prob, actor update and critic update (packed), placed and jitted as the trainer does."""
    placer = _Placer(mesh)
    model = init_model(TINY, seed=0, mesh=mesh)
    model.scan_layers = scan
    graphdef, params, rest = steps.split_model(model)
    params = placer.commit(params)
    tx = steps.make_optimizer(steps.OptimConfig(lr=1e-6))
    from jaxrl_post.runtime.sharding import init_opt_state

    opt = placer.commit(init_opt_state(tx, params, mesh))
    rows, row_len = packing.micro_geometry(
        micro_batch_size=MICRO,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=None,
        seq_len=P_LEN + R_LEN,
        seqs_per_row=1,
        dp=MESH["data"] * MESH["fsdp"],
        n_seqs=M,
    )
    # slots in per-shard blocks over data * fsdp, as `placement.pack_spec` makes them
    spec = packing.make_pack_spec(M, rows, P_LEN, R_LEN, row_len=row_len, shards=MESH["data"] * MESH["fsdp"])
    batch = placer.put_packed(placer.pack(fake_batch(np.random.default_rng(0)), spec))
    out = {"slots": spec.slots, "slot_shards": spec.shards}
    lp = jax.jit(update_core.make_log_prob_fn(packed_steps.PACKED, graphdef, rest, temperature=1.0, with_entropy=False))
    out["old_log_prob"] = inspect("old_log_prob", lp, (params, batch), mesh, head=True)
    loss_cfg = ppo_update.ActorLossConfig()
    upd = placer.jit_update(
        ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, loss_cfg), params, opt
    )
    out["update_actor"] = inspect("update_actor", upd._fn, (params, opt, batch), mesh, head=True)
    critic = CriticModel.from_actor(model, nnx.Rngs(1))
    cg, cp, cr = steps.split_model(critic)
    from jaxrl_post.runtime.sharding import shard_params

    cp = placer.commit(shard_params(cp, mesh))
    copt = placer.commit(init_opt_state(tx, cp, mesh))
    closs = ppo_update.CriticLossConfig(0.5, "token-mean")
    cupd = placer.jit_update(ppo_update.make_critic_update(packed_steps.PACKED, cg, cr, tx, closs), cp, copt)
    out["update_critic"] = inspect("update_critic", cupd._fn, (cp, copt, batch), mesh)
    return out


def generate_programs(mesh) -> dict:
    """Prefill and decode as a real `Generator.generate` call runs them (arguments recorded, then lowered)."""
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rollout import Generator, SamplingParams
    from jaxrl_post.rollout import generate as gen_mod

    model = init_model(TINY, seed=0, mesh=mesh)
    seen = {}

    def recorder(name, fn):
        def call(*args, **kwargs):
            seen[name] = (args, kwargs)
            return fn(*args, **kwargs)

        return call

    orig = {"prefill": gen_mod._prefill, "decode": gen_mod._decode}
    gen_mod._prefill, gen_mod._decode = recorder("prefill", orig["prefill"]), recorder("decode", orig["decode"])
    try:
        ids = np.random.default_rng(1).integers(3, TINY.vocab_size, (4, 6)).astype(np.int32)
        prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": np.ones_like(ids)})
        sp = SamplingParams(max_new_tokens=8, temperature=1.0, eos_token_ids=(2,), pad_token_id=0)
        Generator(model, mesh=mesh).generate(prompts, sp, n=2)
    finally:
        gen_mod._prefill, gen_mod._decode = orig["prefill"], orig["decode"]
    out = {}
    for name, fn in orig.items():
        args, kwargs = seen[name]
        if name == "decode":  # its cache / logits were donated by the call: fresh buffers of the same shapes
            fresh = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), args[2:4])
            args = args[:2] + fresh + args[4:]
        out[name] = inspect(name, fn, args, mesh, kwargs)
    return out


def run() -> dict:
    mesh = make_mesh(**MESH)
    rec = {"mesh": MESH, "model": {k: getattr(TINY, k) for k in ("vocab_size", "hidden_size", "num_layers")}}
    rec["unrolled"] = trainer_programs(mesh, scan=False)
    rec["scanned"] = trainer_programs(mesh, scan=True)
    rec["generate"] = generate_programs(mesh)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rec = run()
    text = json.dumps(rec)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
