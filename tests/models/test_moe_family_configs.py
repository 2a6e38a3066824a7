"""`configs/grpo.py`'s tiny variants of the MoE families (mixtral_tiny, qwen2_moe_tiny, gpt_oss_tiny, besides
test_moe_replay.py's moe_tiny): each validates and builds the family's model with its features, and one GRPO step
of `gpt_oss_tiny` runs on the CPU."""

import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models.decoder import Transformer
from jaxrl_post.models.moe import MoE
from jaxrl_post.rl.builders import model_config_from
from jaxrl_post.rl.config_check import validate_config


def _grpo():
    """configs/grpo.py (config files are loaded by path; the repository root makes `configs` importable)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    return importlib.import_module("configs.grpo")


VARIANTS = {"mixtral_tiny": "mixtral", "qwen2_moe_tiny": "qwen2_moe", "gpt_oss_tiny": "gpt_oss"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_family_variant_validates_and_builds(variant):
    """The variant passes the trainer's config checks and builds a 2-layer random model of its family with 4 experts
    top-2 of width 32 and the family's own parts (Mixtral: no q/k norm; Qwen2-MoE: shared expert and qkv bias;
    GPT-OSS: sinks, biases, a sliding then a full layer, YaRN); its forward traces to `[B, T, V]` logits."""
    c = _grpo().get_config(variant)
    validate_config(c, n_devices=1)
    cfg = model_config_from(c)
    assert cfg.family == VARIANTS[variant] and cfg.num_layers == 2 and cfg.hidden_size == 64
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # abstract params: no compile
    assert all(isinstance(b.mlp, MoE) for b in model.layers)
    mlp, attn = model.layers[0].mlp, model.layers[0].attn
    if variant == "mixtral_tiny":
        assert attn.q_norm is None and mlp.shared_expert is None and cfg.norm_topk_prob
    elif variant == "qwen2_moe_tiny":
        assert mlp.shared_expert is not None and attn.q_proj.bias is not None
    else:
        assert attn.sinks is not None and attn.o_proj.bias is not None and mlp.gate_up_proj.shape == (4, 64, 64)
        assert [b.attn.window for b in model.layers] == [8, None] and cfg.rope_scaling_dict["rope_type"] == "yarn"
    ids = jnp.zeros((2, 6), jnp.int32)
    graphdef, state = nnx.split(model)
    logits = jax.eval_shape(lambda st: nnx.merge(graphdef, st)(ids, jnp.ones_like(ids)), state)
    assert logits.shape == (2, 6, cfg.vocab_size)


@pytest.mark.slow
def test_gpt_oss_tiny_grpo_step_runs_on_cpu(tmp_path):
    """One GRPO step of `configs/grpo.py:gpt_oss_tiny` with the load-balancing loss on (rollout with a KV cache
    through the sliding window, old log-probs, reference, packed update): finite metrics, and the update (no weight
    decay) moves the router (weight and bias), the fused experts and the sinks: each has a gradient."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = _grpo().get_config("gpt_oss_tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.save_freq = -1
    c.trainer.total_training_steps = 1
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.model.arch.output_router_logits = True
    c.model.arch.router_aux_loss_coef = 0.01
    c.actor.optim.weight_decay = 0.0  # a param moves only through its gradient (decay alone would move them all)
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        before = jax.tree.map(np.asarray, trainer.state.actor.params)
        hist = trainer.fit()["history"]
        assert all(np.isfinite(v) for v in hist[-1].values())
        assert hist[-1]["actor/moe/aux_loss"] >= 1.0
        after = jax.tree.map(np.asarray, trainer.state.actor.params)
        layer_b, layer_a = before["layers"][0], after["layers"][0]
        for part, key in [("mlp", k) for k in ("router", "router_bias", "gate_up_proj", "down_proj_bias")] + [
            ("attn", "sinks")
        ]:
            assert np.abs(layer_a[part][key][...] - layer_b[part][key][...]).max() > 0, key
    finally:
        trainer.close()
