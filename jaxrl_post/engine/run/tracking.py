"""Experiment tracking: one `Tracking` object fans metrics out to backends (verl's `utils/tracking.py`).

Backends: `console` (compact one-line summary per step), `jsonl` (`metrics.jsonl` in the working dir,
always on, one JSON object per line: `{"step": int, "<metric>": float, ...}`), `tensorboard` (tensorboardX
event files in `<workdir>/tensorboard`) and `wandb` (Weights & Biases, when installed and configured); the
last two live in `loggers.py`. A backend implements `log(metrics, step)` and `close()` and registers in
`BACKENDS`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxrl_post.engine.run.loggers import TensorBoardLogger, WandbLogger

# Console summary: (metric, short label), printed when present.
_CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("loss", "loss"),  # SFT (TRL names)
    ("mean_token_accuracy", "acc"),
    ("val/loss", "val_loss"),
    ("val/perplexity", "val_ppl"),
    ("rewards/accuracies", "rew_acc"),  # DPO (TRL names)
    ("rewards/margins", "rew_margin"),
    ("val/rewards/accuracies", "val_rew_acc"),
    ("accuracy", "pair_acc"),  # reward model (TRL names)
    ("margin", "margin"),
    ("val/accuracy", "val_pair_acc"),
    ("grad_norm", "grad_norm"),  # SFT / DPO / reward model
    ("val-core/*", None),
    ("critic/rewards/mean", "reward"),
    ("critic/vf_explained_var", "vf_ev"),
    ("response_length/mean", "resp_len"),
    ("response_length/clip_ratio", "truncated"),  # share of responses cut at max_response_length (not PPO clip)
    ("num_turns/mean", "turns"),  # multi-turn (rollout/trajectory.py rollout_metrics)
    ("tool_calls/mean", "tool_calls"),
    ("tool/errors", "tool_err"),
    ("actor/pg_loss", "pg"),
    ("actor/entropy", "ent"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/kl_loss", "kl_loss"),
    ("actor/reward_kl_penalty", "kl_rew"),
    ("actor/distillation/loss", "distill"),
    ("actor/distillation/reverse_kl", "kl_teacher"),
    ("actor/grad_norm", "gnorm"),
    ("critic/vf_loss", "vf_loss"),
    ("timing_s/step", "step_s"),
    ("timing_s/gen", "gen_s"),
    ("timing_s/update_actor", "upd_s"),
)


# What each console label means (printed at the start of a run in a new run directory, and in `--help`;
# docs/console.md holds the same text, checked by tests/test_console.py): (label, tags, meaning). A run prints the
# lines whose tags meet its own (`console_tags`): the trainer (`rl`, `sft`, `dpo`, `reward_model`) and, for RL,
# the features that add metrics (`critic`, `kl_loss`, `kl_in_reward`, `opd`, `agent`).
_SUPERVISED = ("sft", "dpo", "reward_model")
CONSOLE_LEGEND = (
    ("score", ("rl",), "critic/score/mean: mean score the reward function gave a response (before any KL penalty)"),
    ("loss", ("sft",), "loss (SFT): mean negative log-likelihood per trained token of the step"),
    ("loss", ("dpo",), "loss (DPO): mean preference loss of the step's pairs (dpo.loss_type)"),
    ("loss", ("reward_model",), "loss (reward model): mean -log sigmoid(score chosen - score rejected) of the pairs"),
    ("acc", ("sft",), "mean_token_accuracy (SFT): share of trained tokens the model's argmax predicts"),
    ("val_loss", ("sft",), "val/loss (SFT): mean negative log-likelihood per trained token on the held-out set"),
    ("val_loss", ("dpo", "reward_model"), "val/loss (DPO / reward model): the loss on the held-out pairs"),
    ("val_ppl", ("sft",), "val/perplexity (SFT): exp(val/loss)"),
    ("rew_acc", ("dpo",), "rewards/accuracies (DPO): share of pairs whose implicit reward of chosen > rejected"),
    (
        "rew_margin",
        ("dpo",),
        "rewards/margins (DPO): mean implicit reward of chosen minus rejected (beta * log-ratio gap)",
    ),
    ("val_rew_acc", ("dpo",), "val/rewards/accuracies (DPO): rewards/accuracies on the held-out pairs"),
    ("pair_acc", ("reward_model",), "accuracy (reward model): share of pairs scored chosen > rejected"),
    ("margin", ("reward_model",), "margin (reward model): mean score of chosen minus rejected"),
    ("val_pair_acc", ("reward_model",), "val/accuracy (reward model): accuracy on the held-out pairs"),
    ("grad_norm", _SUPERVISED, "grad_norm (SFT/DPO/RM): the gradient norm before clipping"),
    ("val-core/...", ("rl",), "validation score on the held-out set (verl's val-core/<data_source>/<metric>)"),
    ("reward", ("rl",), "critic/rewards/mean: mean reward per response after the KL-in-reward penalty (PPO)"),
    (
        "vf_ev",
        ("critic",),
        "critic/vf_explained_var (PPO): 1 - Var(returns - values) / Var(returns); n/a if returns are constant",
    ),
    ("resp_len", ("rl",), "response_length/mean: mean response length in tokens"),
    ("truncated", ("rl",), "response_length/clip_ratio: share of responses cut at data.max_response_length"),
    ("turns", ("agent",), "num_turns/mean (multi-turn): mean turns per trajectory (the model's and the environment's)"),
    ("tool_calls", ("agent",), "tool_calls/mean (multi-turn): mean tool calls per trajectory"),
    ("tool_err", ("agent",), "tool/errors (multi-turn): tool calls of the step that failed (error, bad call, timeout)"),
    ("pg", ("rl",), "actor/pg_loss: policy-gradient (clipped surrogate) loss of the actor update"),
    ("ent", ("rl",), "actor/entropy: mean per-token entropy of the policy on the responses"),
    (
        "ppo_kl",
        ("rl",),
        "actor/ppo_kl: KL between the rollout (old) policy and the updated one, how far the update moved",
    ),
    ("kl_loss", ("kl_loss",), "actor/kl_loss: KL to the reference model (actor.use_kl_loss)"),
    ("kl_rew", ("kl_in_reward",), "actor/reward_kl_penalty (PPO): KL to the reference subtracted from the reward"),
    ("distill", ("opd",), "actor/distillation/loss (OPD): the distillation loss of the actor update"),
    (
        "kl_teacher",
        ("opd",),
        "actor/distillation/reverse_kl (OPD): mean log pi_student - log pi_teacher of the sampled tokens",
    ),
    ("gnorm", ("rl",), "actor/grad_norm: the actor's gradient norm before clipping"),
    ("vf_loss", ("critic",), "critic/vf_loss (PPO): the critic's value loss"),
    ("step_s", ("rl", *_SUPERVISED), "timing_s/step: seconds for the whole step"),
    ("gen_s", ("rl",), "timing_s/gen: seconds generating the responses"),
    ("upd_s", ("rl",), "timing_s/update_actor: seconds in the actor update"),
)


def console_legend(tags=None) -> str:
    """The console legend: a header line and one `  label  metric: meaning` line per label.

    Args:
      tags: the running trainer's `console_tags` (e.g. `{"rl", "critic"}`, `{"dpo"}`): only the lines of the
        metrics it logs; None: every line (docs/console.md, `--help`).
    """
    rows = [(label, meaning) for label, when, meaning in CONSOLE_LEGEND if tags is None or set(when) & set(tags)]
    width = max(len(label) for label, _ in rows)
    lines = ["console step line (all metrics in metrics.jsonl; 'n/a': undefined, e.g. vf_ev of constant returns):"]
    lines += [f"  {label:<{width}}  {meaning}" for label, meaning in rows]
    return "\n".join(lines)


def _fmt(f: float) -> str:
    return "n/a" if math.isnan(f) else f"{f:.4g}"


def _to_float(v: Any) -> float | None:
    try:
        f = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return f


def to_jsonable(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Scalars -> float (NaN/inf kept as strings so the line stays valid JSON); others -> str."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, (str, bool)) or v is None:
            out[k] = v
            continue
        f = _to_float(v)
        if f is None:
            out[k] = str(v)
        elif math.isfinite(f):
            out[k] = f
        else:
            out[k] = str(f)
    return out


class JsonlLogger:
    """Appends `{"step": step, **metrics}` lines to `<workdir>/metrics.jsonl` (flushed every line).

    The file is opened at the first `log`, so the trainer can still move an earlier run's file aside or
    truncate it on resume (`run_files.prepare_metrics_file`) after building its loggers.
    """

    def __init__(self, workdir: str, filename: str = "metrics.jsonl"):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, filename)
        self._f = None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._f.write(json.dumps({"step": int(step), **to_jsonable(metrics)}) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _dropped_validation_words(dropped: float, used: Any) -> str:
    """The step-0 note on validation prompts that also occur in the training data (`rl/data_rows.py` drops them;
    a reasoning-gym validation set draws others in their place)."""
    n = _to_float(used)
    kept = "" if n is None else f"; validating on {n:.0f} prompts not in the training data"
    return f"{dropped:.0f} validation prompts were also training prompts: left out{kept}"


class ConsoleLogger:
    """Prints a compact line every `print_every` steps (validation lines always)."""

    def __init__(self, print_every: int = 1, stream=None, write=None):
        self.print_every = max(int(print_every), 1)
        self._write = write or (lambda s: print(s, file=stream or sys.stdout, flush=True))

    @staticmethod
    def format(metrics: Mapping[str, Any], step: int) -> str:
        parts = [f"step {step}"]
        for key, label in _CONSOLE_KEYS:
            if key.endswith("/*"):
                for k in sorted(metrics):
                    if k.startswith(key[:-1]):
                        f = _to_float(metrics[k])
                        if f is not None:
                            parts.append(f"{k}={_fmt(f)}")
                continue
            if key in metrics:
                f = _to_float(metrics[key])
                if f is not None:
                    parts.append(f"{label}={_fmt(f)}")
        if len(parts) == 1:  # nothing from the summary list (e.g. data statistics): print everything
            for k, v in metrics.items():
                f = _to_float(v)
                if k == "data/val_dropped_seen_in_train":  # a count of what was done, not an error
                    if f:
                        parts.append(_dropped_validation_words(f, metrics.get("data/num_val_prompts")))
                    continue
                parts.append(f"{k}={_fmt(f)}" if f is not None else f"{k}={v}")
        return " | ".join(parts)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        is_val = any(k.startswith(("val-", "val/")) for k in metrics)
        if is_val or step % self.print_every == 0:
            self._write(self.format(metrics, step))

    def close(self) -> None:
        pass


def _tensorboard(workdir, **kw):

    return TensorBoardLogger(workdir, **kw)


def _wandb(workdir, **kw):

    return WandbLogger(workdir, **kw)


BACKENDS = {"console": ConsoleLogger, "jsonl": JsonlLogger, "tensorboard": _tensorboard, "wandb": _wandb}
LOGGER_SYNTAX = "--config.trainer.logger=console,tensorboard or --config.trainer.logger=\"('console','tensorboard')\""


def parse_logger_names(value: Any) -> tuple[str, ...]:
    """`trainer.logger` -> backend names, accepting "console,tensorboard", ("console", "tensorboard") and
    the command line's ('console,tensorboard',) alike (entries split on commas; spaces, quotes and brackets
    stripped; duplicates and empty entries dropped).

    Raises:
      ValueError: a name not in `BACKENDS` (the message lists the valid names and the syntax), or a value
        that is neither a string nor a list/tuple of strings.
    """
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError(
            f"trainer.logger must be a comma-separated string or a list of names, got {value!r}; {_hint()}"
        )
    names = [n.strip(" \t'\"[]()") for x in items for n in x.split(",")]
    names = list(dict.fromkeys(n for n in names if n))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; {_hint()}")
    return tuple(names)


def _hint() -> str:
    return f"valid names: {', '.join(sorted(BACKENDS))} (jsonl is always on); syntax: {LOGGER_SYNTAX}"


class Tracking:
    """Fan-out logger. `jsonl` is always on; `loggers` selects the others (names in `BACKENDS`).

    `project`, `experiment` and `config` (a JSON-able dict) go to backends that record runs (wandb).

    `loggers`: names as `parse_logger_names` accepts them (a list, or "console,tensorboard").

    Raises:
      ValueError: an unknown logger name (lists the valid ones and the syntax).
      ImportError / RuntimeError: wandb requested but not installed /
        not configured (see `loggers.WandbLogger`).
    """

    def __init__(
        self,
        workdir: str,
        loggers=("console", "jsonl"),
        print_every: int = 1,
        console_write=None,
        *,
        project: str | None = None,
        experiment: str | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        try:
            names = list(dict.fromkeys(["jsonl", *parse_logger_names(loggers)]))
        except ValueError as e:
            raise ValueError(f"trainer.logger: {e}") from None
        self.backends = {}
        for n in names:
            if n == "jsonl":
                self.backends[n] = JsonlLogger(workdir)
            elif n == "console":
                self.backends[n] = ConsoleLogger(print_every, write=console_write)
            else:
                try:
                    self.backends[n] = BACKENDS[n](workdir, project=project, experiment=experiment, config=config)
                except Exception:
                    self.close()
                    raise

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for b in self.backends.values():
            b.log(data, step)

    def close(self) -> None:
        for b in self.backends.values():
            b.close()
