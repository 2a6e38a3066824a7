"""LoRA: exactness with B = 0 / adapters off, gradients only on A/B, merged export and PEFT adapter vs
transformers + peft, adapter round trip, bad-input errors, and a tiny GRPO run with LoRA (learns, reference =
base, adapters-only checkpoint and resume, export)."""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.models import ModelConfig, init_model, load_hf_dir, save_pretrained
from jaxrl_post.models.lora import (
    LoRAConfig,
    apply_lora,
    iter_projections,
    load_peft_adapter,
    lora_config_of,
    parse_target_modules,
    save_peft_adapter,
    set_lora_enabled,
)
from jaxrl_post.rl import ppo_update
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

TINY = ModelConfig(
    family="qwen2", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, qkv_bias=True,
)  # fmt: skip
_fwd = jax.jit(lambda m, ids, mask: m(ids, mask))


def _batch(vocab, b=2, t=9, seed=0):
    ids = np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :3] = 0  # left padding
    return ids, mask


def _randomize_adapters(model, seed=1, scale=0.3):
    rng = np.random.default_rng(seed)
    for *_, lin in iter_projections(model):
        if lin.lora_a is not None:
            lin.lora_b.set_value(jnp.asarray(rng.normal(0, scale, lin.lora_b.shape), jnp.float32))


@pytest.mark.slow
def test_zero_b_equals_base_adapters_off_equals_base_and_grads_reach_only_adapters():
    ids, mask = _batch(TINY.vocab_size)
    bf16 = init_model(TINY, seed=3, dtype="bfloat16")  # bf16 compute and params, float32 adapters
    base = np.asarray(_fwd(bf16, ids, mask))
    np.testing.assert_array_equal(np.asarray(_fwd(apply_lora(bf16, LoRAConfig(4, 8.0)), ids, mask)), base)
    model = init_model(TINY, seed=3)
    base = np.asarray(_fwd(model, ids, mask))
    apply_lora(model, LoRAConfig(4, 8.0))
    assert lora_config_of(model) == LoRAConfig(4, 8.0)
    np.testing.assert_array_equal(np.asarray(_fwd(model, ids, mask)), base)  # B = 0: bit-exact
    # trainable state = the A/B of all 7 projections of both layers, float32, nothing else
    graphdef, adapters, frozen, rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    paths = [p for p, _ in nnx.to_flat_state(adapters)]
    assert len(paths) == 2 * 7 * 2 and all(p[-1] in ("lora_a", "lora_b") for p in paths)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
    assert not any(p[-1].startswith("lora") for p, _ in nnx.to_flat_state(frozen))

    def loss(ad):
        return jnp.sum(nnx.merge(graphdef, ad, frozen, rest)(ids, mask)[..., :7] ** 2)

    grads = jax.jit(jax.grad(loss))(adapters)
    g = {p: float(jnp.abs(v.get_value()).max()) for p, v in nnx.to_flat_state(grads)}
    assert all(v > 0 for p, v in g.items() if p[-1] == "lora_b")  # dL/dB = scale (xA)^T dL/dy != 0
    assert all(v == 0 for p, v in g.items() if p[-1] == "lora_a")  # dL/dA has a factor B = 0
    _randomize_adapters(model)
    adapted = np.asarray(_fwd(model, ids, mask))
    assert np.abs(adapted - base).max() > 0.1
    np.testing.assert_array_equal(np.asarray(_fwd(set_lora_enabled(model, False), ids, mask)), base)
    np.testing.assert_array_equal(np.asarray(_fwd(set_lora_enabled(model, True), ids, mask)), adapted)


def test_bad_lora_settings_raise_clear_errors(tmp_path):
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.config_check import validate_config

    assert parse_target_modules("all-linear") == LoRAConfig(1).target_modules
    assert parse_target_modules("v_proj, q_proj") == ("q_proj", "v_proj")
    assert parse_target_modules(["model.layers.0.mlp.up_proj"]) == ("up_proj",)
    with pytest.raises(ValueError, match=r"unknown module names \['qkv'\]; valid: 'all-linear' or any of"):
        LoRAConfig(8, target_modules=("q_proj", "qkv"))
    for rank in (0, -1):
        with pytest.raises(ValueError, match="LoRA rank must be an int >= 1"):
            LoRAConfig(rank)
    model = apply_lora(init_model(TINY, seed=0), LoRAConfig(2, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        apply_lora(model, LoRAConfig(2))

    def errors(**model_keys):
        c = grpo.get_config("tiny")
        c.trainer.default_local_dir = str(tmp_path / "run")
        for k, v in model_keys.items():
            setattr(c.model, k, v)
        with pytest.raises(ConfigError) as e:
            validate_config(c)
        return str(e.value)

    assert "config.model.lora_rank=-1: must be an int >= 0" in errors(lora_rank=-1)
    assert "config.model.target_modules='q_proj,attn'" in errors(lora_rank=8, target_modules="q_proj,attn")
    assert "config.model.lora_alpha=0.0: must be > 0" in errors(lora_rank=8, lora_alpha=0.0)
    missing = errors(lora_adapter_path=str(tmp_path / "nope"))
    assert "config.model.lora_adapter_path" in missing and "no adapter_config.json" in missing
    save_peft_adapter(model, tmp_path / "ad")
    assert "has r=2; set lora_rank=2 or 0" in errors(lora_rank=4, lora_adapter_path=str(tmp_path / "ad"))
    with pytest.raises(ValueError, match="has rank r=2 but model.lora_rank=4"):
        load_peft_adapter(init_model(TINY, seed=0), tmp_path / "ad", rank=4)


def _hf_llama(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=71, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.copy_(0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


def _torch_logits(model, ids, mask):
    import torch

    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ids, mask, pos = torch.tensor(ids).long(), torch.tensor(mask), torch.tensor(pos)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    return out.logits.float().numpy()


@pytest.mark.slow
def test_merged_export_and_peft_adapter_match_transformers(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base_dir = _hf_llama(tmp_path)
    model = apply_lora(load_hf_dir(base_dir), LoRAConfig(3, 6.0, ("q_proj", "v_proj", "o_proj", "down_proj")))
    _randomize_adapters(model, seed=2)
    for *_, lin in iter_projections(model):
        if lin.lora_a is not None:  # A too, so every dim of the layout matters
            lin.lora_a.set_value(lin.lora_a[...] * 3.0)
    ids, mask = _batch(71, b=3, t=10)
    valid = mask.astype(bool)
    ours = np.asarray(_fwd(model, ids, mask))
    save_pretrained(model, None, tmp_path / "merged")
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=base_dir)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (3, 6, "LORA")

    auto = transformers.AutoModelForCausalLM
    merged = _torch_logits(auto.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval(), ids, mask)
    base_hf = auto.from_pretrained(base_dir, attn_implementation="eager").eval()
    base_logits = _torch_logits(base_hf, ids, mask)
    with_adapter = peft.PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
    via_peft = _torch_logits(with_adapter, ids, mask)
    assert np.abs(merged - base_logits)[valid].max() > 0.5  # the adapter changes the model
    assert np.abs(merged - via_peft)[valid].max() <= 1e-5  # merged export == adapter forward (transformers)
    assert np.abs(ours - via_peft)[valid].max() <= 1e-4 * max(1.0, np.abs(via_peft).max())  # == ours
    # the adapter loads back onto our base exactly
    again = load_hf_dir(base_dir)
    assert load_peft_adapter(again, tmp_path / "adapter") == lora_config_of(model)
    np.testing.assert_array_equal(np.asarray(_fwd(again, ids, mask)), ours)
    # an adapter written by peft itself (random B, full-path target_modules) loads with the same logits
    cfg = peft.LoraConfig(r=2, lora_alpha=5, target_modules="all-linear", init_lora_weights=False)
    theirs = peft.get_peft_model(auto.from_pretrained(base_dir, attn_implementation="eager"), cfg).eval()
    theirs.save_pretrained(tmp_path / "peft_made")
    ref = _torch_logits(theirs, ids, mask)
    ours = load_hf_dir(base_dir)
    assert load_peft_adapter(ours, tmp_path / "peft_made", rank=2) == LoRAConfig(2, 5.0)
    assert np.abs(np.asarray(_fwd(ours, ids, mask)) - ref)[valid].max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_peft_adapter_of_some_layers_only_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = apply_lora(init_model(TINY, seed=0), LoRAConfig(2, target_modules=("q_proj",)))
    save_peft_adapter(model, tmp_path)
    f = tmp_path / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if ".layers.1." not in k}, f)
    with pytest.raises(ValueError, match=r"every one of the model's 2 layers needs lora_A and lora_B"):
        load_peft_adapter(init_model(TINY, seed=0), tmp_path)


@pytest.mark.slow
def test_lora_with_scan_layers_equals_unrolled_forward_and_adapter_grads():
    """`model.scan_layers` stacks each layer's state, LoRA A/B included: same logits and adapter gradients as
    the unrolled layers, with adapters on and off (layers share their static LoRA attributes)."""
    cfg = dataclasses.replace(TINY, num_layers=3)
    model = apply_lora(init_model(cfg, seed=3), LoRAConfig(4, 8.0, ("q_proj", "v_proj", "down_proj")))
    _randomize_adapters(model, seed=4)
    ids, mask = _batch(cfg.vocab_size)
    graphdef, adapters, frozen, rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)

    def run(scan, enabled):
        def loss(ad):
            m = nnx.merge(graphdef, ad, frozen, rest)
            m.scan_layers = scan
            set_lora_enabled(m, enabled)
            logits = m(ids, mask)
            return jnp.sum(jnp.tanh(logits[..., :7])), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapters)
        return np.asarray(logits), jax.tree.map(np.asarray, grads)

    unrolled, g_unrolled = run(False, True)
    scanned, g_scanned = run(True, True)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_scanned), jax.tree.leaves(g_unrolled)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    assert min(float(np.abs(g).max()) for g in jax.tree.leaves(g_unrolled)) > 0  # every A and B gets a gradient
    base = np.asarray(_fwd(init_model(cfg, seed=3), ids, mask))  # the model before apply_lora
    assert np.abs(unrolled - base).max() > 0.1
    np.testing.assert_allclose(run(True, False)[0], base, atol=1e-5, rtol=1e-5)  # adapters off, scanned


@pytest.mark.slow
def test_lora_packed_update_and_log_probs_equal_padded():
    """The packed steps (the trainer's default) take a LoRA model's frozen base as their trailing argument like
    the padded ones: same adapter update (SGD: same gradients) and metrics; the reference fn (adapters off)
    gives the base model's log-probs, written out from its logits."""
    import optax

    from jaxrl_post.engine import packed_steps, steps, update_core
    from tests.engine.test_packing import _model, _packed, _rollout

    model = apply_lora(_model("llama", seed=1), LoRAConfig(4, 8.0))
    _randomize_adapters(model, seed=5, scale=0.2)
    graphdef, params, frozen, rest = steps.split_lora_model(model)
    b = _rollout()
    tx = optax.sgd(1.0)  # new adapters = adapters - grads
    cfg = ppo_update.ActorLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, temperature=0.7)
    padded = jax.jit(ppo_update.make_actor_update(steps.padded_layout(n_micro=4), graphdef, rest, tx, cfg))
    packed = jax.jit(ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, cfg))
    want = padded(params, tx.init(params), b, frozen)
    got = packed(params, tx.init(params), _packed(b, rows=2), frozen)
    moved = [
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(*map(jax.tree.leaves, (want[0], params)))
    ]
    assert len(moved) == 2 * 7 * 2 and min(moved) > 1e-6  # every A and B of both layers has a gradient
    for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5)
    for k in want[2]:
        np.testing.assert_allclose(got[2][k], want[2][k], atol=1e-5, rtol=1e-5, err_msg=k)

    mask = b["attention_mask"][:, 6:].astype(bool)
    kw = dict(temperature=0.7, with_entropy=False)
    ref_pad = jax.jit(
        update_core.make_log_prob_fn(steps.padded_layout(micro_batch_size=4), graphdef, rest, adapters=False, **kw)
    )
    ref_pk = jax.jit(update_core.make_log_prob_fn(packed_steps.PACKED, graphdef, rest, adapters=False, **kw))
    act_pk = jax.jit(update_core.make_log_prob_fn(packed_steps.PACKED, graphdef, rest, **kw))
    lp_pad, lp_pk = ref_pad(params, b, frozen)[0], ref_pk(params, _packed(b, rows=4), frozen)[0]
    base = _model("llama", seed=1)  # the same weights without adapters
    logits = base(b["input_ids"], b["attention_mask"], positions=b["position_ids"])[:, 5:-1] / 0.7
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), b["input_ids"][:, 6:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp_pad)[mask], expected[mask], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lp_pk)[mask], expected[mask], atol=1e-5, rtol=1e-5)
    adapted = np.asarray(act_pk(params, _packed(b, rows=4), frozen)[0])
    assert np.abs(adapted - expected)[mask].max() > 0.05  # with the adapters on the log-probs differ


# ----------------------------------------------------------------------------------------- trainer
def _tiny_base_dir(path):
    """A tiny llama HF dir whose logits are O(1) (embeddings x3): a random 0.02-std model is near-uniform and
    its tied head would leave LoRA on the projections almost no way to move the output distribution."""
    from configs import grpo
    from jaxrl_post.rl.builders import model_config_from

    model = init_model(model_config_from(grpo.get_config("tiny")), seed=0)
    model.embedding.set_value(model.embedding[...] * 3.0)
    save_pretrained(model, None, path)
    return str(path)


def _saved_keys(step_dir, item):
    with open(os.path.join(step_dir, item, "_METADATA")) as f:
        return [k for k, v in json.load(f)["tree_metadata"].items() if v["value_metadata"].get("write_shape")]


@pytest.mark.slow
def test_grpo_tiny_lora_learns_reference_is_base_checkpoint_holds_adapters_and_exports(tmp_path):
    from configs import grpo
    from jaxrl_post.engine.run import checkpoint as ckpt
    from jaxrl_post.rl.trainer import RLTrainer

    base_dir = _tiny_base_dir(tmp_path / "base")
    c = grpo.get_config("tiny")
    c.model.random_init, c.model.path = False, base_dir  # tokenizer: 'char' (tiny config)
    c.model.lora_rank, c.model.lora_alpha = 8, 16.0
    c.actor.optim.lr = 1e-2
    c.trainer.total_training_steps = c.trainer.save_freq = 20
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.trainer.print_every = 100
    c.trainer.default_local_dir = str(tmp_path / "run")
    trainer = RLTrainer(c, console_write=lambda line: None)
    try:
        assert (
            trainer.policy.lora == LoRAConfig(8, 16.0)
            and trainer.reference.params is None
            and trainer.reference is not None
        )
        # trained state: the 28 A/B arrays; AdamW moments only for them
        shapes = sorted(x.shape for x in jax.tree.leaves(trainer.state.actor.params))
        assert len(shapes) == 2 * 7 * 2 and all(8 in s for s in shapes)
        moments = sorted(x.shape for x in jax.tree.leaves(trainer.state.actor.opt_state) if x.ndim)
        assert moments == sorted(shapes * 2)
        # reference = initial actor = the base model without adapters, bit for bit
        rng = np.random.RandomState(0)
        t, r, n = c.data.max_prompt_length + c.data.max_response_length, c.data.max_response_length, 16
        b = {"input_ids": rng.randint(3, 100, (n, t)).astype(np.int32), "attention_mask": np.ones((n, t), np.int32)}
        b["position_ids"] = np.tile(np.arange(t, dtype=np.int32), (n, 1))
        b["responses"] = b["input_ids"][:, -r:]

        assert trainer.policy.spec is not None and trainer.reference.spec is not None  # packing on (the default)
        assert b["input_ids"].shape[0] == trainer.geometry.batch_size  # the packed forwards' static geometry

        def log_probs(fn):
            spec = trainer.reference.spec if fn is trainer.reference.log_prob_fn else trainer.policy.old_log_prob_spec
            return trainer.placement.forward(fn, trainer.state.actor.params, b, 8, spec, trainer.policy.frozen)[0]

        ref0, actor0 = log_probs(trainer.reference.log_prob_fn), log_probs(trainer.policy.old_log_prob_fn)
        np.testing.assert_array_equal(ref0, actor0)
        logits = jax.jit(lambda m, ids, mask, pos: m(ids, mask, pos))
        base_logits = logits(load_hf_dir(base_dir), b["input_ids"][:2], b["attention_mask"][:2], b["position_ids"][:2])
        own = logits(trainer.policy.model, b["input_ids"][:2], b["attention_mask"][:2], b["position_ids"][:2])
        np.testing.assert_array_equal(np.asarray(own), np.asarray(base_logits))
        frozen0 = jax.tree.map(np.asarray, trainer.policy.frozen)

        hist = trainer.fit()["history"]
        scores = [m["critic/score/mean"] for m in hist]
        assert len(scores) == 20 and np.mean(scores[-5:]) > np.mean(scores[:5]) + 0.08, scores  # it learns
        # the base never moved; the reference still is the base, the actor is not
        assert jax.tree.all(jax.tree.map(np.array_equal, frozen0, jax.tree.map(np.asarray, trainer.policy.frozen)))
        np.testing.assert_array_equal(log_probs(trainer.reference.log_prob_fn), ref0)
        assert np.abs(log_probs(trainer.policy.old_log_prob_fn) - actor0).max() > 0.1
        trained = jax.tree.map(np.asarray, trainer.state.actor.params)
    finally:
        trainer.close()

    # the checkpoint holds the adapters and their optimizer state only
    step_dir = os.path.join(c.trainer.default_local_dir, "checkpoints", "global_step_20")
    for item in ("actor.params", "actor.opt_state"):
        keys = _saved_keys(step_dir, item)
        assert len(keys) == (28 if item == "actor.params" else 56) and all("lora_" in k for k in keys), item
    # resume rebuilds the base from model.path and restores the adapters
    again = RLTrainer(c, console_write=lambda line: None)
    try:
        assert again.resumed_from == step_dir and again.global_steps == 20
        assert jax.tree.all(jax.tree.map(np.array_equal, trained, jax.tree.map(np.asarray, again.state.actor.params)))
        ours = np.asarray(
            logits(again.policy.model, b["input_ids"][:2], b["attention_mask"][:2], b["position_ids"][:2])
        )
    finally:
        again.close()
    c.model.lora_rank = 4
    with pytest.raises(ckpt.CheckpointError, match=r"LoRA does not match the config: checkpoint rank=8, alpha=16.0"):
        RLTrainer(c, console_write=lambda line: None)

    # export: merged weights (transformers) and a PEFT adapter (peft on the HF base) agree with the actor
    pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import export_hf

    out = export_hf.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert (
        json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == base_dir
    )
    auto = transformers.AutoModelForCausalLM
    ids, mask = b["input_ids"][:2, :40], b["attention_mask"][:2, :40]
    merged = _torch_logits(auto.from_pretrained(out, attn_implementation="eager").eval(), ids, mask)
    base_hf = auto.from_pretrained(base_dir, attn_implementation="eager").eval()
    via_peft = _torch_logits(peft.PeftModel.from_pretrained(base_hf, tmp_path / "hf" / "adapter").eval(), ids, mask)
    assert np.abs(merged - via_peft).max() <= 1e-5
    np.testing.assert_allclose(ours[:, :40], via_peft, atol=1e-4 * max(1.0, np.abs(via_peft).max()))


_MESH_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from configs import grpo
from jaxrl_post.models.lora import iter_projections, lora_config_of, set_lora_enabled
from jaxrl_post.rl.trainer import RLTrainer

c = grpo.get_config("tiny")
c.model.lora_rank, c.model.lora_alpha, c.model.dtype, c.model.scan_layers = 4, 8.0, "bfloat16", True
c.actor.optim.lr = 1e-2
c.trainer.total_training_steps, c.trainer.save_freq = 2, -1
c.trainer.val_before_train = c.trainer.val_at_end = False
c.trainer.default_local_dir = sys.argv[1]
c.trainer.mesh.data, c.trainer.mesh.fsdp, c.trainer.mesh.tensor = 2, 2, 2
t = RLTrainer(c, console_write=lambda s: None)
hist = t.fit()["history"]
specs = lambda tree: {str(k): str(v.sharding.spec) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
merged_ok = []
for i, parent, name, lin in iter_projections(t.policy.model):
    w = np.asarray(lin.kernel[...], np.float32)
    want = w + lin.lora_scale * np.tensordot(np.asarray(lin.lora_a[...]), np.asarray(lin.lora_b[...]), axes=1)
    got = np.asarray(getattr(getattr(t.rollout.model.layers[i], parent), name).kernel[...], np.float32)
    moved = float(np.abs(want - w).max()) > 4 * 2.0**-8 * float(np.abs(w).max())  # B moved: a copy of W fails
    merged_ok.append(bool(np.allclose(got, want, rtol=2.0**-8, atol=1e-30)) and moved)
emb_equal = bool(np.array_equal(np.asarray(t.rollout.model.embedding[...], np.float32),
                                np.asarray(t.policy.model.embedding[...].astype(jnp.bfloat16), np.float32)))
ids = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 9)), jnp.int32)
fwd = nnx.jit(lambda m: m(ids, jnp.ones((2, 9), jnp.int32)))
rollout, actor = np.asarray(fwd(t.rollout.model)), np.asarray(fwd(t.policy.model))
base = np.asarray(fwd(set_lora_enabled(t.policy.model, False)))
gap, effect = float(np.abs(rollout - actor).max()), float(np.abs(base - actor).max())
out = dict(frozen=specs(t.policy.frozen), rollout=specs(t.state.rollout), merged_ok=merged_ok,
           counts=t.compile_counts(), pg_loss=[m["actor/pg_loss"] for m in hist], emb_equal=emb_equal,
           gap=gap, effect=effect, actor_max=float(np.abs(actor).max()),
           copy=bool(t.rollout.copy), spec=t.policy.spec is not None,
           no_adapters=lora_config_of(t.rollout.model) is None and t.rollout.generator.model is t.rollout.model)
t.close()
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_lora_bf16_rollout_copy_on_8_fake_devices(tmp_path):
    """`model.dtype=bfloat16` (f32 masters) + LoRA on a (2, 2, 2) mesh of fake CPU devices, with
    `model.scan_layers` and packing (the default) on: the rollout samples from a bf16 copy without adapters, so
    `sync_weights` writes the merged kernels W + (alpha / r) A . B into it, keeping the base kernels' shardings.
    After real updates (B != 0) its kernels equal that sum written out in NumPy (to bf16 rounding), its
    embedding is the actor's in bf16, its logits equal the actor's adapter forward in bf16 compute, far closer
    than to the base model; every jitted fn compiles once."""
    import subprocess

    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS,
    )
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["rollout"] == out["frozen"] and len(out["frozen"]) == 20
    q = [v for k, v in out["frozen"].items() if "q_proj" in k and "kernel" in k]
    assert q and set(q) == {"P('fsdp', 'tensor', None)"}  # embed over fsdp, heads over tensor
    assert len(out["merged_ok"]) == 2 * 7 and all(out["merged_ok"])
    assert set(out["counts"].values()) == {1}, out["counts"]
    assert all(np.isfinite(out["pg_loss"]))
    assert out["copy"] and out["spec"] and out["emb_equal"] and out["no_adapters"]
    gap, effect = out["gap"], out["effect"]
    assert gap <= 0.05 * effect and gap <= 2.0**-6 * out["actor_max"], (gap, effect)
