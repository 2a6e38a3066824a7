"""On-policy distillation: the loss math by hand (numpy), the teacher's log-probs against its own forward
(packed == padded == one unpadded sequence at a time), the same-tokenizer check, the vocabulary slice, and a
tiny end-to-end OPD run through the RL trainer whose student moves toward the teacher."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.algos import core_algos, distillation
from jaxrl_post.engine import steps, update_core
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import losses, ppo_update
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ----------------------------------------------------------------------------------------- the math by hand
# two responses of 4 tokens; mask holes at (0, 3) and (1, 0) hold garbage that must not count
S = np.array([[-0.5, -1.0, -2.0, -0.1], [-3.0, -0.7, -0.2, -1.5]], np.float32)  # student (current)
T = np.array([[-1.5, -0.2, -13.0, -9e3], [9e3, -0.7, -0.9, -1.0]], np.float32)  # teacher
OLD = np.array([[-0.4, -1.2, -2.0, -0.1], [-3.0, -0.5, -0.3, -1.5]], np.float32)  # rollout-time student
MASK = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], np.int32)


def _np_k1(s, t):
    return s - t


def _np_k3(s, t):
    lr = np.clip(t - s, -20, 20)
    return np.clip(np.exp(lr) - lr - 1.0, -10, 10)


def _np_vanilla(adv, s, old, mask, lo, hi, c=3.0):
    """verl compute_policy_loss_vanilla, token-mean: per-token max(-A r, -A clip(r)), dual-clipped for A < 0."""
    r = np.exp(s - old)
    l1 = np.maximum(-adv * r, -adv * np.clip(r, 1 - lo, 1 + hi))
    l = np.where(adv < 0, np.minimum(l1, -adv * c), l1)
    return (l * mask).sum() / mask.sum()


@pytest.mark.parametrize("mode,np_fn", [("k1", _np_k1), ("k3", _np_k3)])
def test_per_token_losses_and_clamp_by_hand(mode, np_fn):
    d = np.asarray(distillation.compute_distillation_losses(S, T, mode))
    m = MASK > 0
    np.testing.assert_allclose(d[m], np_fn(S, T)[m], rtol=1e-6, atol=1e-6)
    # k1 at (0, 2) is -2 + 13 = 11; the clamp keeps it in [-c, c]
    dc = np.asarray(distillation.compute_distillation_losses(S, T, mode, loss_max_clamp=1.0))
    np.testing.assert_allclose(dc[m], np.clip(np_fn(S, T), -1, 1)[m], rtol=1e-6, atol=1e-6)
    if mode == "k1":
        assert d[0, 2] == pytest.approx(11.0) and dc[0, 2] == 1.0


def test_pg_opd_advantage_is_minus_clamped_k1_through_clipped_ppo():
    c = distillation.DistillationLossConfig(
        loss_mode="k1", use_policy_gradient=True, loss_max_clamp=1.0, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    adv = -np.clip(S - T, -1.0, 1.0)  # the per-token advantage: sg(log teacher - log student), clamped
    want = _np_vanilla(adv, S, OLD, MASK, 0.2, 0.28)

    def f(s):
        return distillation.distillation_loss(c, s, jnp.asarray(OLD), jnp.asarray(T), jnp.asarray(MASK))

    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(S))
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(m["pg_loss"]) == pytest.approx(want, rel=1e-6)
    m_ = MASK > 0
    assert float(m["abs_loss"]) == pytest.approx(np.abs(S - T)[m_].mean(), rel=1e-6)  # before the clamp
    # the advantage is a constant (stop-gradient): d loss / d s = -A r / N where the ratio is not clipped
    r = np.exp(S - OLD)
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    want_g = np.where(m_ & ~clipped, -adv * r / MASK.sum(), 0.0)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-7)


def test_supervised_k3_is_differentiated_through_the_estimator():
    c = distillation.DistillationLossConfig(loss_mode="k3", use_policy_gradient=False, loss_max_clamp=5.0)

    def f(s):
        return distillation.distillation_loss(c, s, jnp.asarray(OLD), jnp.asarray(T), jnp.asarray(MASK))[0]

    loss, g = jax.value_and_grad(f)(jnp.asarray(S))
    m = MASK > 0
    d = np.clip(_np_k3(S, T), -5, 5)
    assert float(loss) == pytest.approx(d[m].mean(), rel=1e-6)
    # d/ds [exp(t - s) - (t - s) - 1] = 1 - exp(t - s), zero where a clamp is active ((0, 2): k3 = 8.1 -> 5)
    lr = np.clip(T - S, -20, 20)
    active = (np.exp(lr) - lr - 1 > 5) | (np.abs(T - S) > 20)
    want_g = np.where(m & ~active, (1 - np.exp(np.clip(T - S, -20, 20))) / MASK.sum(), 0.0)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("use_task_rewards", [True, False])
def test_actor_loss_combines_task_and_distillation_as_verl(use_task_rewards):
    """use_task_rewards: task PPO loss (+ entropy) + coef * distill; else the distillation loss alone."""
    task_adv = np.array([[0.5, 0.5, 0.5, 0.5], [-1.0, -1.0, -1.0, -1.0]], np.float32)
    d = distillation.DistillationLossConfig(
        loss_mode="k1", use_policy_gradient=True, use_task_rewards=use_task_rewards, distillation_loss_coef=1.5
    )
    c = ppo_update.ActorLossConfig(entropy_coeff=0.01, distillation=d)
    mb = dict(
        loss_mask=jnp.asarray(MASK),
        advantages=jnp.asarray(task_adv),
        old_log_probs=jnp.asarray(OLD),
        teacher_log_prob=jnp.asarray(T),
    )
    ent = jnp.full(S.shape, 2.0, jnp.float32)
    counts = core_algos.global_batch_info(jnp.asarray(MASK))
    loss, m = losses.actor_loss(c, jnp.asarray(S), ent, mb, counts)
    task = _np_vanilla(task_adv, S, OLD, MASK, 0.2, 0.2)
    distill = _np_vanilla(-(S - T), S, OLD, MASK, 0.2, 0.2)
    want = task - 0.01 * 2.0 + 1.5 * distill if use_task_rewards else distill
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(m["distillation/loss"]) == pytest.approx(distill, rel=1e-5)
    assert float(m["pg_loss"]) == pytest.approx(task, rel=1e-5)


def test_missing_teacher_is_one_config_error_with_the_export_command(tmp_path):
    from configs import opd
    from jaxrl_post.rl.trainer import RLTrainer

    c = opd.get_config("smollm2")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.distillation.teacher_models.teacher_model.model_path = str(tmp_path / "no_such_teacher")
    with pytest.raises(ConfigError, match=r"teacher_model.model_path=.*no_such_teacher.*scripts/export_hf.py"):
        RLTrainer(c)


def test_config_refuses_what_verl_refuses(tmp_path):
    from configs import opd
    from jaxrl_post.rl.config_check import validate_config

    c = opd.get_config()
    validate_config(c, n_devices=1)
    c.distillation.distillation_loss.use_policy_gradient = False  # k1 as a supervised loss: no teacher gradient
    c.distillation.distillation_loss.loss_max_clamp = -1.0
    c.distillation.distillation_loss.policy_loss_mode = "gspo"
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    msg = str(e.value)
    assert "distillation.distillation_loss.loss_mode='k1'" in msg and "use_policy_gradient=True" in msg
    assert "loss_max_clamp=-1.0" in msg and "policy_loss_mode='gspo'" in msg
    c = opd.get_config()  # PG: a top-k mode is a supervised loss
    c.distillation.distillation_loss.loss_mode = "forward_kl_topk"
    c.distillation.distillation_loss.log_prob_min_clamp = 1.0
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    msg = str(e.value)
    assert "use_policy_gradient" in msg and "log_prob_min_clamp=1.0" in msg
    validate_config(opd.get_config("tiny_topk"), n_devices=1)


# ----------------------------------------------------------------------------------------- the teacher
def _other_char_tokenizer():
    """The character tokenizer with 'a' and 'b' swapped: same size and special tokens, different ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxrl_post.models.char_tokenizer import CHARS, SPECIAL_TOKENS

    toks = list(SPECIAL_TOKENS + CHARS)
    ia, ib = toks.index("a"), toks.index("b")
    toks[ia], toks[ib] = "b", "a"
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>"],
        name_or_path="swapped-char",
    )


def test_tokenizer_mismatch_is_one_clear_error_naming_both(tmp_path):
    from configs import opd
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer
    from jaxrl_post.models.hf_io import save_pretrained
    from jaxrl_post.rl.roles.teacher import build_teacher, check_tokenizers_match

    char = build_char_tokenizer()
    check_tokenizers_match(char, char)  # the same tokenizer passes
    teacher_dir = str(tmp_path / "teacher")  # a teacher model dir shipping the other tokenizer
    save_pretrained(_peaked_model(), _other_char_tokenizer(), teacher_dir)
    c = opd.get_config()
    t = c.distillation.teacher_models.teacher_model
    t.random_init, t.model_path, t.tokenizer_path = False, teacher_dir, None
    with pytest.raises(ConfigError) as e:
        build_teacher(c, None, char, 128)
    msg = str(e.value)
    assert "distillation.teacher_models.teacher_model" in msg
    assert teacher_dir in msg and "(char, 101 tokens)" in msg  # both tokenizers named
    assert "'a' " in msg and "different ids" in msg  # and what differs
    # a teacher table smaller than the student's: the student could sample ids the teacher cannot score
    c = opd.get_config()
    c.distillation.teacher_models.teacher_model.arch.num_layers = 1
    c.distillation.teacher_models.teacher_model.arch.vocab_size = 112
    with pytest.raises(ConfigError, match="112 rows, fewer than the student's 128"):
        build_teacher(c, None, char, 128)


def _peaked_model(vocab=128, seed=3, scale=3.0, unigram=0.0):
    """A tiny llama whose output distribution is far from uniform (a random 0.02-std model is near-uniform).
    `unigram` > 0: attention and MLP outputs zeroed and every embedding row given a shared positive component
    `a_v * unigram / D` (a_v in [0, 1], seeded), so the final hidden state points the same way whatever the
    context and the next-token logits are about `unigram * a_v`: a context-free preference over the whole
    vocabulary that a student's samples always carry signal about."""
    from jaxrl_post.models import get_preset, init_model

    cfg = get_preset("smollm2_135m").replace(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = init_model(cfg, seed=seed)
    model.embedding.set_value(model.embedding[...] * scale)
    if unigram:
        for layer in model.layers:
            layer.attn.o_proj.kernel.set_value(layer.attn.o_proj.kernel[...] * 0)
            layer.mlp.down_proj.kernel.set_value(layer.mlp.down_proj.kernel[...] * 0)
        a = np.random.default_rng(seed).uniform(0.0, 1.0, vocab).astype(np.float32)
        shared = jnp.asarray(a[:, None] * np.full((1, 64), unigram / 64, np.float32))
        model.embedding.set_value(model.embedding[...] + shared)
    return model


def _rollout_batch(n=6, p=6, r=5, vocab=101, seed=0, max_prompt=8):
    """Left-padded prompts (at most `max_prompt` real tokens), right-padded responses of varied lengths (as the
    rollout writes them)."""
    rng = np.random.default_rng(seed)
    p_len, r_len = rng.integers(2, min(p, max_prompt) + 1, n), rng.integers(1, r + 1, n)
    am = np.concatenate([np.arange(p)[None] >= p - p_len[:, None], np.arange(r)[None] < r_len[:, None]], 1)
    ids = (rng.integers(4, vocab, (n, p + r)) * am).astype(np.int32)
    return dict(
        input_ids=ids,
        attention_mask=am.astype(np.int32),
        position_ids=np.maximum(np.cumsum(am, 1) - 1, 0).astype(np.int32),
        responses=ids[:, p:].copy(),
    )


# The reference forward, jitted: the same math as calling the model, one compiled program per shape instead of
# every layer's ops dispatched one by one (eager, ~4x slower on a loaded 2-core CPU).
_forward = jax.jit(lambda model, ids, mask: model(ids, mask))


def _own_forward(model, b, vocab=None):
    """log_softmax of the model's logits at the sampled tokens, one unpadded sequence at a time."""
    p = b["input_ids"].shape[1] - b["responses"].shape[1]
    out = np.zeros(b["responses"].shape, np.float32)
    for i in range(b["input_ids"].shape[0]):
        keep = b["attention_mask"][i] > 0
        ids = b["input_ids"][i][keep][None]
        logits = np.asarray(_forward(model, ids, np.ones_like(ids)), np.float64)[0]
        if vocab is not None:
            logits = logits[:, :vocab]
        mx = logits.max(-1, keepdims=True)
        lsm = logits - mx - np.log(np.exp(logits - mx).sum(-1, keepdims=True))
        n_p = int(keep[:p].sum())
        resp = b["responses"][i][b["attention_mask"][i][p:] > 0]
        out[i, : len(resp)] = lsm[n_p - 1 + np.arange(len(resp)), resp]
    return out


@pytest.mark.slow
def test_vocab_slice_gives_the_first_logits_log_softmax():
    from jaxrl_post.rl.roles.teacher import slice_vocab

    big = _peaked_model(vocab=160)
    b = _rollout_batch(n=3)
    want = _own_forward(big, b, vocab=128)  # log_softmax over the student's 128 ids only
    slice_vocab(big, 128)
    assert big.config.vocab_size == 128 and big.embedding[...].shape[0] == 128
    got = _own_forward(big, b)
    mask = b["attention_mask"][:, 6:] > 0
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- end to end
@pytest.mark.slow  # ~1.5 min on a loaded 2-core CPU: two trainer compiles (update, teacher, rollout) + 8 steps
def test_tiny_opd_run_moves_the_student_toward_the_teacher(tmp_path):
    """An exported-style teacher dir (a tiny llama with a context-free preference over the vocabulary, a table
    of 160 rows > the student's 128, its own char tokenizer files) distilled into a random student: the
    on-policy reverse KL to the teacher falls, every step's metrics are finite, the teacher compiles once; its
    log-probs (packed, the trainer's path) equal its own forward on each unpadded sequence and the padded
    forward."""
    from configs import opd
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer
    from jaxrl_post.models.hf_io import save_pretrained
    from jaxrl_post.rl.trainer import RLTrainer

    teacher_dir = str(tmp_path / "teacher")
    save_pretrained(_peaked_model(vocab=160, scale=1.0, unigram=6.0), build_char_tokenizer(), teacher_dir)
    c = opd.get_config()
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.total_training_steps = 8
    t = c.distillation.teacher_models.teacher_model
    t.random_init, t.model_path, t.tokenizer_path = False, teacher_dir, None
    c.actor.optim.lr = 1e-2
    trainer = RLTrainer(c, console_write=lambda line: None)
    trainer.fit()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if "actor/distillation/reverse_kl" in r]
    assert len(rows) == 8
    for r in rows:
        for k in ("actor/distillation/loss", "actor/distillation/reverse_kl", "actor/distillation/teacher_log_prob"):
            assert np.isfinite(r[k]), (k, r)
    kl = [r["actor/distillation/reverse_kl"] for r in rows]
    tlp = [r["actor/distillation/teacher_log_prob"] for r in rows]
    print("reverse_kl per step", np.round(kl, 3), "teacher_log_prob", np.round(tlp, 3))
    assert np.mean(kl[-2:]) < 0.5 * np.mean(kl[:2])  # the student moved toward the teacher
    assert np.mean(tlp[-2:]) > np.mean(tlp[:2])  # its samples got likelier under the teacher
    assert trainer.compile_counts()["teacher"] == 1
    assert trainer.teacher.model.config.vocab_size == 128  # the 160-row table was sliced to the student's ids

    b = _rollout_batch(
        n=trainer.geometry.batch_size, p=int(c.data.max_prompt_length), r=trainer.geometry.response_length
    )
    got = trainer.teacher.forward(b)["teacher_log_prob"]
    assert trainer.teacher.spec is not None  # packed: the trainer's default path
    want = _own_forward(trainer.teacher.model, {k: v[:4] for k, v in b.items()})  # 4 rows: eager is slow
    mask = b["attention_mask"][:, -trainer.geometry.response_length :] > 0
    np.testing.assert_allclose(got[:4][mask[:4]], want[mask[:4]], rtol=1e-4, atol=1e-4)
    padded = update_core.make_log_prob_fn(
        steps.padded_layout(micro_batch_size=8),
        trainer.teacher.graphdef,
        trainer.teacher.rest,
        temperature=1.0,
        with_entropy=False,
    )
    lp_pad = np.asarray(jax.jit(padded)(trainer.teacher.params, {k: jnp.asarray(v) for k, v in b.items()})[0])
    np.testing.assert_allclose(got[mask], lp_pad[mask], rtol=1e-4, atol=1e-4)


_MESH_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import jax
from configs import opd
from jaxrl_post.rl.trainer import RLTrainer

assert jax.device_count() == 8
c = opd.get_config()
c.trainer.default_local_dir = sys.argv[1]
c.trainer.mesh.data, c.trainer.mesh.fsdp, c.trainer.mesh.tensor = 2, 2, 2
c.trainer.total_training_steps = 2
c.distillation.teacher_models.teacher_model.arch.vocab_size = 160
c.distillation.teacher_models.teacher_model.dtype = "bfloat16"
trainer = RLTrainer(c, console_write=lambda line: None)
last = trainer.fit()["last"]
emb = trainer.teacher.params["embedding"][...]
out = dict(shape=list(emb.shape), dtype=str(emb.dtype), spec=str(emb.sharding.spec), counts=trainer.compile_counts(),
           last={k: v for k, v in last.items() if "distillation" in k})
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow  # ~2 min: a subprocess on 8 fake CPU devices compiling the tiny run
def test_tiny_opd_on_8_fake_devices(tmp_path):
    """The teacher on a ('data', 'fsdp', 'tensor') = (2, 2, 2) mesh: bf16 (its own dtype), its 160-row table
    sliced to the student's 128 and sharded like the actor's embedding, compiled once, finite metrics."""
    import subprocess
    import sys

    script = tmp_path / "mesh_run.py"
    script.write_text(_MESH_SCRIPT)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS,
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["shape"] == [128, 64] and out["dtype"] == "bfloat16"
    assert out["spec"] == "P('tensor', 'fsdp')"  # vocab over tensor, embed over fsdp (as the actor)
    assert out["counts"]["teacher"] == 1 and set(out["counts"].values()) == {1}
    for k in ("actor/distillation/loss", "actor/distillation/reverse_kl", "actor/distillation/teacher_log_prob"):
        assert np.isfinite(out["last"][k]), k


def test_teacher_path_with_a_random_teacher_is_refused_not_ignored():
    from configs import opd
    from jaxrl_post.rl.config_check import validate_config

    c = opd.get_config()  # tiny: a random teacher
    c.distillation.teacher_models.teacher_model.model_path = "exported/grpo_smollm2"
    with pytest.raises(ConfigError, match=r"teacher_model\.model_path.*ignored.*random_init=True"):
        validate_config(c, n_devices=1)
