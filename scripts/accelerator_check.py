"""One-shot accelerator check (GPU or TPU host): compile, bf16 rollout and update speed, MFU, memory, parity.

    bash scripts/accelerator_check.sh            # the full check (< 8 minutes on one GPU / TPU host)
    python scripts/accelerator_check.py --tiny   # the same code on a tiny random model (CPU, tests)

For each model (full: SmolLM2-135M-Instruct, loaded if the package is installed, else its shapes with random
weights, and a random Llama-3.2-1B-shaped model; --tiny: a 2-layer toy), with the platform's defaults
(`platform_defaults.py`: bf16 compute on accelerators, remat, scanned layers, the fused attention kernel):

* rollout: `Generator.generate` of `prompts x n` samples, bf16 weights; compile (first call) and the
  timed second call, generated tokens/s;
* actor update: the packed update (`packed_steps.make_packed_actor_update`, f32 masters, bf16 compute),
  `lower` + `compile` timed apart, then the timed second call; MFU = training FLOPs of the real tokens
  (`metrics.transformer_flops_per_sequence`, verl's convention) / time / the device's bf16 peak (a table of
  datasheet peaks by `device_kind`, else the measured bf16 matmul peak);
* peak device memory (`device.memory_stats()['peak_bytes_in_use']`, None on CPU);
* fused attention kernel vs the dense path (first model; `kernel_parity`): log-probs and gradients of one
  packed micro-batch with shared prompts, in the compute dtype, each against a float32 dense reference;
* greedy parity: float32 greedy decoding (matmul precision 'highest') of the same weights and prompts on the
  default device and on the CPU; rows whose tokens are all equal, and the mean fraction of tokens equal
  before the first difference.

A stage that raises leaves `<stage>_error` in its record and the others still run (an update whose fused
kernel fails is re-run with the dense path). Prints a table and, last, one JSON line; `--json` is rewritten
after every stage.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)  # bench_forward

from jaxrl_post.batch.protocol import DataProto  # noqa: E402
from jaxrl_post.engine import packed_steps, packing, steps  # noqa: E402
from jaxrl_post.models import PRESETS, ModelConfig, init_model  # noqa: E402
from jaxrl_post.models.attention import resolve_attention_impl  # noqa: E402
from jaxrl_post.models.decoder import SEGMENT_SUB_BITS  # noqa: E402
from jaxrl_post.rl import metrics as metrics_lib  # noqa: E402
from jaxrl_post.rl import ppo_update  # noqa: E402
from jaxrl_post.rollout import Generator, SamplingParams  # noqa: E402
from jaxrl_post.runtime import platform_defaults  # noqa: E402

# datasheet dense bf16 peaks (FLOP/s), matched as substrings of `device.device_kind`
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
}
TINY = ModelConfig(
    family="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    prompts: int
    n: int
    prompt_len: int
    response_len: int
    micro: int  # responses per packed micro-batch of the update


FULL = Shapes(prompts=16, n=8, prompt_len=128, response_len=256, micro=16)
PARITY_PROMPTS, PARITY_TOKENS = 4, 64
KERNEL_PARITY_LAYERS = 4
SMALL = Shapes(prompts=2, n=2, prompt_len=8, response_len=8, micro=2)


def peak_flops(device) -> tuple[float, str]:
    """(bf16 peak FLOP/s, its source) of `device`: the datasheet table, else a measured bf16 matmul."""
    for key, value in PEAK_BF16.items():
        if key.lower() in device.device_kind.lower():
            return value, f"datasheet ({key})"
    from bench_forward import matmul_peak

    n = 4096 if device.platform != "cpu" else 512
    return matmul_peak(n=n, steps=3, dtype=jnp.bfloat16), "measured bf16 matmul"


def greedy_parity(a: np.ndarray, b: np.ndarray) -> dict:
    """Rows of `a`, `b` `[B, R]` (tokens) that are equal, and the mean fraction of each row's tokens equal
    before its first difference (1.0 = identical)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"token arrays differ in shape: {a.shape} vs {b.shape}")
    diff = a != b
    first = np.where(diff.any(1), diff.argmax(1), a.shape[1])
    return {
        "rows_equal": f"{int((first == a.shape[1]).sum())}/{a.shape[0]}",
        "prefix_equal": float(first.mean() / a.shape[1]),
    }


def prompts(shapes: Shapes, vocab: int, seed: int = 0) -> DataProto:
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(1, shapes.prompt_len // 2), shapes.prompt_len + 1, shapes.prompts)
    mask = (np.arange(shapes.prompt_len)[None] >= shapes.prompt_len - lens[:, None]).astype(np.int32)
    ids = (rng.integers(3, vocab, mask.shape) * mask).astype(np.int32)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


def update_batch(shapes: Shapes, vocab: int, seed: int = 1) -> dict[str, np.ndarray]:
    """A GRPO-shaped mini-batch of `prompts * n` sequences (random tokens, responses of 1/4..all of R)."""
    rng = np.random.default_rng(seed)
    m, p, r = shapes.prompts * shapes.n, shapes.prompt_len, shapes.response_len
    p_len = np.repeat(rng.integers(max(1, p // 2), p + 1, shapes.prompts), shapes.n)
    r_len = rng.integers(max(1, r // 4), r + 1, m)
    am = np.concatenate([np.arange(p)[None] >= p - p_len[:, None], np.arange(r)[None] < r_len[:, None]], 1)
    ids = rng.integers(3, vocab, (m, p + r))
    ids[:, :p] = np.repeat(ids[:: shapes.n, :p], shapes.n, axis=0)  # the n samples of a prompt share it
    ids = (ids * am).astype(np.int32)
    rmask = am[:, p:].astype(np.int32)
    return dict(
        input_ids=ids,
        attention_mask=am.astype(np.int32),
        position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
        responses=ids[:, p:].copy(),
        loss_mask=rmask,
        advantages=(rng.normal(size=(m, 1)) * rmask).astype(np.float32),
    )


def kernel_parity(name: str, cfg: ModelConfig, shapes: Shapes) -> dict:
    """The platform's fused attention kernel against the dense path, in the compute dtype, on one packed
    micro-batch with shared prompts (`segment_ids` chunk << SUB_BITS | sub): next-token log-probs and the
    gradients of their masked sum. Both are measured against a float32 dense reference of the same weights:
    `kernel_lp_err` / `dense_lp_err` = max |log-prob - reference| over real tokens, `kernel_grad_err` /
    `dense_grad_err` = ||grad - reference|| / ||reference|| over all params. `kernel_ok`: the kernel's errors
    at most twice the dense path's (+ 1e-3: both are rounding of the same compute dtype). On CPU (`--tiny`)
    the kernel is 'cudnn' in its interpret form (jax's XLA implementation of the same call). Runs the model's
    shapes with KERNEL_PARITY_LAYERS layers and random weights (seed 0): three unrolled forward + backward
    compiles of all 30 of SmolLM2's layers took longer than the whole check's budget on an H200."""
    cfg = dataclasses.replace(cfg, num_layers=min(cfg.num_layers, KERNEL_PARITY_LAYERS))
    host_state = host_weights(cfg)[1]
    plat = platform_defaults.platform_name()
    dtype = platform_defaults.default("model.dtype", plat)
    impl = resolve_attention_impl("auto", plat, dtype=dtype, softcap=cfg.attn_logit_softcap)
    interpret = plat == "cpu"
    if interpret:
        impl = "cudnn"
    rec = {"model": f"{name}, {cfg.num_layers} layers, random", "kernel": impl, "dtype": dtype}
    if impl == "xla":
        return rec | {"kernel_ok": None, "skipped": "no fused kernel for this platform / dtype / model"}
    batch = update_batch(shapes, cfg.vocab_size)
    m = batch["responses"].shape[0]
    spec = packing.make_pack_spec(m, shapes.micro, shapes.prompt_len, shapes.response_len, share_prompts=True)
    packed = packing.pack_batch(batch, spec)
    ids, seg, pos = (jnp.asarray(packed[k][0]) for k in ("input_ids", "segment_ids", "positions"))
    sub = (1 << SEGMENT_SUB_BITS) - 1
    rec["shared_prompt_segments"] = bool((np.asarray(packed["segment_ids"][0]) & sub).any())
    mask = seg != 0
    targets = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], 1)
    # next tokens of the same sequence: the same segment, or a response's first token after its shared prompt
    nxt = jnp.roll(seg, -1, 1)
    same = (nxt == seg) | (((seg & sub) == 0) & (nxt >> SEGMENT_SUB_BITS == seg >> SEGMENT_SUB_BITS))
    weight = (mask & (nxt != 0) & same).at[:, -1].set(False)

    def run(compute_dtype, attention):
        model = init_model(cfg, seed=0, dtype=compute_dtype, param_dtype="float32")
        nnx.update(model, jax.tree.map(jnp.asarray, host_state))
        model.set_attention_impl(attention, interpret=interpret and attention != "xla")
        graphdef, state = nnx.split(model)

        def loss(st):
            logits = nnx.merge(graphdef, st)(ids, mask, positions=pos, segment_ids=seg).astype(jnp.float32)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
            return jnp.sum(lp * weight), lp

        (_, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        return np.asarray(lp), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]

    with jax.default_matmul_precision("highest"):
        lp_ref, g_ref = run("float32", "xla")
    ref_norm = np.sqrt(sum(float((g**2).sum()) for g in g_ref))
    w = np.asarray(weight)
    for label, attention in (("dense", "xla"), ("kernel", impl)):
        lp, g = run(dtype, attention)
        rec[f"{label}_lp_err"] = float(np.abs(lp - lp_ref)[w].max())
        rec[f"{label}_grad_err"] = float(np.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(g, g_ref))) / ref_norm)
    rec["kernel_ok"] = bool(
        rec["kernel_lp_err"] <= 2 * rec["dense_lp_err"] + 1e-3
        and rec["kernel_grad_err"] <= 2 * rec["dense_grad_err"] + 1e-3
    )
    return rec


def _timed(fn, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t


def _guarded(rec: dict, stage: str, fn) -> None:
    """Runs stage `fn()`; an exception is recorded as `rec[stage + "_error"]` (and printed), so the other
    stages still run and report (a one-shot device run keeps every number it got)."""
    try:
        fn()
    except Exception as e:  # reported, not hidden
        rec[f"{stage}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()


def host_weights(cfg: ModelConfig, weights=None):
    """(graphdef, float32 host state) of the model: `weights` (an nnx.State) or a random init (seed 0)."""
    with jax.default_device(jax.devices("cpu")[0]):  # the reference weights live on the host
        base = init_model(cfg, seed=0)
        if weights is not None:
            nnx.update(base, weights)
        graphdef, state = nnx.split(base)
        return graphdef, jax.device_get(state)


def check_model(name: str, cfg: ModelConfig, shapes: Shapes, weights=None) -> dict:
    """Rollout, update and parity of one model. weights: an nnx.State of float32 params (loaded), or None
    (random init, seed 0). A failing stage leaves `<stage>_error` in the record; the others still run."""
    dev = jax.devices()[0]
    plat = platform_defaults.platform_name()
    dtype = platform_defaults.default("model.dtype", plat)
    rec = {"model": name, "params_b": None, "platform": plat, "device_kind": dev.device_kind, "dtype": dtype}
    graphdef, host_state = host_weights(cfg, weights)
    rec["params_b"] = round(sum(x.size for x in jax.tree.leaves(host_state)) / 1e9, 3)

    def rollout():  # in the platform's dtype
        model = init_model(cfg, seed=0, dtype=dtype, param_dtype=dtype)
        nnx.update(model, jax.tree.map(lambda x: jnp.asarray(x, dtype if x.ndim >= 2 else x.dtype), host_state))
        gen = Generator(model, cache_segment_len=platform_defaults.cache_segment_len(plat))
        sp = SamplingParams(max_new_tokens=shapes.response_len, temperature=1.0, eos_token_ids=(), seed=0)
        pr = prompts(shapes, cfg.vocab_size)
        _, first = _timed(lambda: gen.generate(pr, sp, n=shapes.n))
        out, t = _timed(lambda: gen.generate(pr, sp, n=shapes.n))
        toks = int(np.asarray(out.batch["response_attention_mask"]).sum())
        rec.update(rollout_first_call_s=round(first, 2), rollout_s=round(t, 3), rollout_tokens_per_s=round(toks / t, 1))

    def update(attention: str):  # f32 masters, platform compute dtype, remat / scan / attention by platform
        model = init_model(cfg, seed=0, dtype=dtype, param_dtype="float32")
        nnx.update(model, jax.tree.map(jnp.asarray, host_state))
        model.remat = platform_defaults.default("model.remat", plat)
        model.scan_layers = platform_defaults.default("model.scan_layers", plat)
        model.set_attention_impl(attention)
        rec["attention"] = attention
        g, params, rest = steps.split_model(model)
        tx = steps.make_optimizer(steps.OptimConfig(lr=1e-6, weight_decay=0.0))
        opt = jax.jit(tx.init)(params)
        batch = update_batch(shapes, cfg.vocab_size)
        m, p, r = batch["responses"].shape[0], shapes.prompt_len, shapes.response_len
        spec = packing.make_pack_spec(m, shapes.micro, p, r)
        packed = {k: batch[k] for k in ("loss_mask", "advantages", "responses")} | packing.pack_batch(batch, spec)
        packed = jax.tree.map(jnp.asarray, packed)
        loss_cfg = ppo_update.ActorLossConfig(on_policy=True)
        fn = jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, g, rest, tx, loss_cfg), donate_argnums=(0, 1))
        t0 = time.perf_counter()
        lowered = fn.lower(params, opt, packed)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        params, opt, aux = compiled(params, opt, packed)
        jax.block_until_ready(params)
        (params, opt, aux), t = _timed(compiled, params, opt, packed)
        real = batch["attention_mask"].sum(1)
        flops = sum(metrics_lib.transformer_flops_per_sequence(cfg, int(n), training=True) for n in real)
        peak, peak_src = peak_flops(dev)
        mem = compiled.memory_analysis()
        rec.update(
            update_lower_s=round(t1 - t0, 2),
            update_compile_s=round(t2 - t1, 2),
            update_s=round(t, 3),
            update_loss=float(aux["loss"]),
            update_tokens_per_s=round(float(real.sum()) / t, 1),
            mfu=round(flops / t / peak, 4),
            peak_flops=peak,
            peak_source=peak_src,
            update_temp_gb=round(mem.temp_size_in_bytes / 1e9, 3) if mem is not None else None,
        )

    def parity():  # float32 greedy decoding, default device vs CPU, first PARITY_PROMPTS x PARITY_TOKENS
        pr = prompts(dataclasses.replace(shapes, prompts=min(shapes.prompts, PARITY_PROMPTS)), cfg.vocab_size)
        n_tok = min(shapes.response_len, PARITY_TOKENS)
        greedy = SamplingParams(max_new_tokens=n_tok, temperature=0.0, do_sample=False, eos_token_ids=())
        toks = {}
        with jax.default_matmul_precision("highest"):
            for where, device in (("device", dev), ("cpu", jax.devices("cpu")[0])):
                with jax.default_device(device):
                    mdl = nnx.merge(graphdef, jax.device_put(host_state, device))
                    res = Generator(mdl, cache_segment_len=platform_defaults.cache_segment_len(device.platform))
                    toks[where] = np.asarray(res.generate(pr, greedy).batch["responses"])
        rec.update({f"greedy_{k}": v for k, v in greedy_parity(toks["device"], toks["cpu"]).items()})

    _guarded(rec, "rollout", rollout)
    attention = resolve_attention_impl("auto", plat, dtype=dtype, softcap=cfg.attn_logit_softcap)
    _guarded(rec, "update", lambda: update(attention))
    if "update_error" in rec and attention != "xla":  # the kernel failed: the dense path's numbers instead
        rec[f"update_error_{attention}"] = rec.pop("update_error")
        _guarded(rec, "update", lambda: update("xla"))
    _guarded(rec, "parity", parity)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    rec["peak_device_memory_gb"] = round(stats["peak_bytes_in_use"] / 1e9, 3) if stats else None
    return rec


COLS = (
    ("model", "{}"),
    ("params_b", "{}"),
    ("dtype", "{}"),
    ("rollout_first_call_s", "{}"),
    ("rollout_tokens_per_s", "{}"),
    ("update_compile_s", "{}"),
    ("update_s", "{}"),
    ("mfu", "{}"),
    ("peak_device_memory_gb", "{}"),
    ("greedy_rows_equal", "{}"),
    ("greedy_prefix_equal", "{:.3f}"),
)


def table(rows: list[dict]) -> str:
    """Markdown table of the records (`-` where a stage failed: its `<stage>_error` is in the JSON)."""
    cell = lambda r, k, f: "-" if r.get(k) is None else f.format(r[k])
    head = "| " + " | ".join(k for k, _ in COLS) + " |"
    body = ["| " + " | ".join(cell(r, k, f) for k, f in COLS) + " |" for r in rows]
    return "\n".join([head, "|" + "---|" * len(COLS)] + body)


def models(tiny: bool):
    """(name, config, weights or None) of the models to check."""
    if tiny:
        return [("tiny random", TINY, None)]
    out = []
    try:
        from jaxrl_post.models import load_pretrained

        with jax.default_device(jax.devices("cpu")[0]):
            m, _ = load_pretrained("smollm2-135m-instruct")
        out.append(("SmolLM2-135M-Instruct", m.config, nnx.state(m)))
    except Exception as e:  # package missing on this host: same shapes, random weights
        print(f"SmolLM2 not loadable ({type(e).__name__}: {e}); its shapes with random weights", flush=True)
        out.append(("SmolLM2-135M shapes (random)", PRESETS["smollm2_135m"], None))
    out.append(("Llama-3.2-1B shapes (random)", PRESETS["llama3_2_1b"], None))
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy at tiny shapes (CPU; what the test runs)")
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args(argv)
    shapes = SMALL if args.tiny else FULL
    print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind} x {jax.device_count()}", flush=True)
    rows = []

    def save():  # after every stage: a run cut short by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    for i, (name, cfg, weights) in enumerate(models(args.tiny)):
        t = time.perf_counter()
        rows.append(check_model(name, cfg, shapes, weights))
        print(f"{name}: {time.perf_counter() - t:.1f} s {json.dumps(rows[-1])}", flush=True)
        save()
        if i == 0:  # the fused attention kernel against the dense path, on the first model
            t = time.perf_counter()
            rows[0]["kernel_parity"] = kp = {}
            run = functools.partial(kernel_parity, name, cfg, shapes)
            _guarded(kp, "kernel_parity", lambda run=run, kp=kp: kp.update(run()))
            print(f"kernel parity: {time.perf_counter() - t:.1f} s {json.dumps(kp)}", flush=True)
            save()
    print(table(rows))
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
