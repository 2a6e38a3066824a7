"""The on-policy distillation teacher: a frozen model scoring the student's sampled tokens.

`TeacherRole` is composed into `RLTrainer` (trainer.py). With `distillation.enabled` it builds the teacher of
`distillation.teacher_models.teacher_model` (any supported family: an HF dir, a .gguf, an alias or an
exported run dir at `model_path`; or a random model for tests), in its own dtype, sharded on the trainer's
mesh like the reference, and checks up front that it shares the student's tokenizer. Each step it computes
`teacher_log_prob [B, R] float32` (and, in the top-k modes, its top-k log-probs and ids `[B, R, K]`) with
the same packed / padded log-prob forward as the reference (`update_core.make_log_prob_fn`
on the packed or padded layout and the teacher's graph), at temperature 1.0 (verl forces the
teacher's temperature to 1.0: it scores fixed tokens, it does not sample).

Vocabulary: the tokenizers must be equal (same token -> id map and special tokens); the embedding tables may
be padded differently. A teacher whose table is larger than the student's has its head sliced to the
student's rows (`slice_vocab`: its logits restricted to the ids the student can sample); a smaller one is
an error (the student could sample ids the teacher cannot score).

Source: verl `docs/algo/opd.md` (teacher config, same-tokenizer requirement, temperature 1.0),
`verl/workers/config/distillation.py`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from jaxrl_post.algos.distillation import TOPK_LOSS_MODES, compute_distillation_losses
from jaxrl_post.engine import packed_steps, steps, update_core
from jaxrl_post.errors import ConfigError
from jaxrl_post.models import get_preset, init_model, load_pretrained
from jaxrl_post.models.attention import resolve_attention_impl
from jaxrl_post.models.hf_io import check_causal_lm_dir
from jaxrl_post.models.resolve import _HUB_GGUF_RE, _HUB_ID_RE, check_model_files, resolve_model_path
from jaxrl_post.rl import builders
from jaxrl_post.runtime.platform_defaults import resolve_value
from jaxrl_post.runtime.sharding import shard_params

log = logging.getLogger(__name__)

TEACHER_KEY = "distillation.teacher_models.teacher_model"


def _tokenizer_name(tok, source: str) -> str:
    name = getattr(tok, "name_or_path", "") or ""
    return f"{type(tok).__name__}({name or source!s}, {len(tok)} tokens)"


def check_tokenizers_match(student, teacher, student_source: str = "model", teacher_source: str = "teacher") -> None:
    """Raise ConfigError unless `teacher` tokenizes exactly as `student` (same token -> id map, including added
    tokens, and the same bos / eos / pad / unk tokens). Embedding sizes are not compared (padded tables are
    fine). The message names both tokenizers and the first difference."""
    problems = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv), key=sv.get)[:3]
        only_t = sorted(set(tv) - set(sv), key=tv.get)[:3]
        moved = sorted((t for t in set(sv) & set(tv) if sv[t] != tv[t]), key=sv.get)[:3]
        if only_s:
            problems.append(f"tokens only in the student's: {only_s}")
        if only_t:
            problems.append(f"tokens only in the teacher's: {only_t}")
        if moved:
            problems.append("different ids: " + ", ".join(f"{t!r} {sv[t]} vs {tv[t]}" for t in moved))
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        a, b = getattr(student, attr, None), getattr(teacher, attr, None)
        if a != b:
            problems.append(f"{attr} {a!r} vs {b!r}")
    if problems:
        raise ConfigError(
            f"config.{TEACHER_KEY}: the teacher's tokenizer {_tokenizer_name(teacher, teacher_source)} differs from "
            f"the student's {_tokenizer_name(student, student_source)}: {'; '.join(problems)}. On-policy "
            "distillation scores the student's token ids with the teacher, so both must share one tokenizer "
            "(e.g. two models of one family)."
        )


def slice_vocab(model, n: int) -> None:
    """Keep the first `n` rows of `model`'s embedding (and columns of an untied LM head): its logits become the
    first `n` logits of the original (ids < n embed as before). Raises ValueError when the table has < n rows."""
    v = model.config.vocab_size
    if v < n:
        raise ValueError(f"cannot slice a vocabulary of {v} to {n}")
    if v == n:
        return
    model.embedding.set_value(model.embedding[...][:n])
    if model.lm_head is not None:
        model.lm_head.set_value(model.lm_head[...][:, :n])
    model.config = model.config.replace(vocab_size=n)


def check_teacher_path(cfg: Any) -> None:
    """With `distillation.enabled` and a loaded teacher, check before anything is loaded that `model_path`
    names a model that exists (as `preflight.check_model_path` does for `model.path`; a hub id is left to the
    loader). Raises ConfigError naming the key, with the command that exports a run as a teacher."""
    t = cfg.distillation.teacher_models.teacher_model
    if not cfg.distillation.enabled or t.random_init:
        return

    name = os.path.expanduser(str(t.model_path or ""))
    if name and not os.path.exists(name) and (_HUB_ID_RE.match(name) or _HUB_GGUF_RE.match(name)):
        return
    try:
        kind, local = resolve_model_path(name)
        check_model_files(kind, local)  # a corrupt or truncated file, named
        if kind == "hf_dir":
            check_causal_lm_dir(local)  # a reward model's export has no LM head to distil from
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"config.{TEACHER_KEY}.model_path={t.model_path!r}: {e}. A trained run becomes a teacher with "
            "`python scripts/export_hf.py --checkpoint=<run dir> --out=<dir>`."
        ) from e


def build_teacher(cfg: Any, mesh, student_tokenizer, student_vocab: int):
    """The teacher model (frozen; compute and storage in `teacher_model.dtype`, default `model.dtype`) with its
    vocabulary matched to the student's `student_vocab` rows.

    Raises:
      ConfigError: a tokenizer differing from the student's (`check_tokenizers_match`), or an embedding table
        smaller than the student's (naming both sizes).
    """

    t = cfg.distillation.teacher_models.teacher_model
    dtype = resolve_value("model.dtype", t.dtype or cfg.model.dtype)
    if t.random_init:
        overrides = {k: v for k, v in t.arch.items() if v is not None}
        mcfg = get_preset(t.preset).replace(dtype=dtype, param_dtype=dtype, **overrides)
        model = init_model(mcfg, seed=int(t.seed), dtype=dtype, param_dtype=dtype, mesh=mesh)
        tokenizer = builders.load_tokenizer(t.tokenizer_path or t.model_path)
        source = t.tokenizer_path or t.model_path
    else:
        model, tokenizer = load_pretrained(t.model_path, dtype=dtype, param_dtype=dtype, mesh=mesh)
        if t.tokenizer_path or tokenizer is None:
            tokenizer = builders.load_tokenizer(t.tokenizer_path or t.model_path)
        source = t.tokenizer_path or t.model_path
    check_tokenizers_match(student_tokenizer, tokenizer, cfg.model.tokenizer_path or cfg.model.path, source)
    tv = model.config.vocab_size
    if tv < student_vocab:
        raise ConfigError(
            f"config.{TEACHER_KEY}: the teacher's embedding has {tv} rows, fewer than the student's {student_vocab}: "
            "the student can sample ids the teacher cannot score"
        )
    if tv > student_vocab:
        log.info("distillation: teacher vocabulary %d sliced to the student's %d ids", tv, student_vocab)
        slice_vocab(model, student_vocab)
    model.scan_layers = bool(cfg.model.scan_layers)
    try:
        impl = resolve_attention_impl(
            cfg.model.attention_impl,
            jax.default_backend(),
            dtype=dtype,
            softcap=model.config.attn_logit_softcap,
            sinks=model.config.attention_sinks,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model.set_attention_impl(impl)
    builders.apply_moe_impl(cfg, model)
    return model


def kl_to_teacher_metrics(student_log_prob, teacher_log_prob, mask, loss_mode: str) -> dict[str, float]:
    """Host metrics of the step's samples (`[B, R]` arrays, rollout-time student log-probs): per-token
    distillation loss range before any clamp (verl `actor/distillation/loss_min` / `loss_max`; not in the top-k
    modes, whose losses need the student's top-k log-probs of the update), and ours:
    `actor/distillation/teacher_log_prob` (mean teacher log-prob of the sampled tokens) and
    `actor/distillation/reverse_kl` (mean k1 = log pi_student - log pi_teacher, the per-token reverse-KL
    estimate), both over `mask`."""

    m = np.asarray(mask) > 0
    if not m.any():
        return {}
    s, t = np.asarray(student_log_prob, np.float32), np.asarray(teacher_log_prob, np.float32)
    out = {
        "actor/distillation/teacher_log_prob": float(t[m].mean()),
        "actor/distillation/reverse_kl": float((s - t)[m].mean()),
    }
    if loss_mode in TOPK_LOSS_MODES:  # the top-k losses need the student's top-k log-probs: update metrics only
        return out
    d = np.asarray(compute_distillation_losses(s, t, loss_mode))[m]
    return {"actor/distillation/loss_min": float(d.min()), "actor/distillation/loss_max": float(d.max()), **out}


class TeacherRole:
    """The frozen teacher (see the module docstring). Build with `TeacherRole.build` (None without
    `distillation.enabled`).

    Attributes: `model`, `graphdef` / `rest`, `params` (frozen, fresh buffers), `micro`
    (`teacher_model.log_prob_micro_batch_size`), `spec` (the reference's packing geometry), `topk` (K of the
    top-k loss modes, else 0), `log_prob_fn` (jitted).
    """

    @classmethod
    def build(cls, cfg, policy, placement, tokenizer) -> TeacherRole | None:
        """None without `distillation.enabled`; else the teacher (`build_teacher`) with its jitted log-prob fn.
        Raises ConfigError (see `build_teacher`; also a top-k larger than the vocabulary)."""
        if not cfg.distillation.enabled:
            return None
        self = cls()
        self.placement = placement
        vocab = policy.model.config.vocab_size
        model = build_teacher(cfg, placement.mesh, tokenizer, vocab)
        g, params, rest = steps.split_model(model)
        if placement.sharded:
            params = shard_params(params, placement.mesh)
        self.graphdef, self.rest = g, rest
        self.params = placement.commit(params)
        self.model = model
        self.micro = int(cfg.distillation.teacher_models.teacher_model.log_prob_micro_batch_size)
        self.spec = policy.pack_spec("ref", policy.geometry.batch_size, self.micro)
        kw = dict(temperature=1.0, with_entropy=False, on_trace=placement.tracer("teacher"))
        dl = cfg.distillation.distillation_loss
        self.topk = int(dl.topk) if dl.loss_mode in TOPK_LOSS_MODES else 0
        if self.topk > vocab:
            raise ConfigError(
                f"config.distillation.distillation_loss.topk={self.topk} exceeds the vocabulary ({vocab} ids)"
            )
        padded = steps.padded_layout(micro_batch_size=self.micro)
        layout = packed_steps.PACKED if self.spec is not None else padded
        fn = update_core.make_log_prob_fn(layout, g, rest, topk=self.topk, **kw)
        self.log_prob_fn = jax.jit(fn)
        return self

    def forward(self, b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The teacher's batch fields: `teacher_log_prob [B, R] float32` of the response tokens (0 at packed
        padding) and, in a top-k mode, `teacher_topk_log_probs [B, R, K] float32` / `teacher_topk_ids
        [B, R, K] int32` (`distillation_topk.teacher_topk`, every response position)."""
        out = self.placement.forward(self.log_prob_fn, self.params, b, self.micro, self.spec)
        res = {"teacher_log_prob": np.asarray(out[0], np.float32)}
        if self.topk:
            res["teacher_topk_log_probs"] = np.asarray(out[2], np.float32)
            res["teacher_topk_ids"] = np.asarray(out[3], np.int32)
        return res
