"""Config -> objects: mesh, tokenizer, actor/critic models, data loaders, reward manager, optimizers.

The only place besides `trainer.py` and `main.py` that reads the ConfigDict; everything it returns takes
typed arguments.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.trainer import steps

log = logging.getLogger(__name__)


def build_mesh(cfg: Any) -> jax.sharding.Mesh:
    """Mesh ('data', 'fsdp', 'tensor') from `trainer.mesh.*` over all devices."""
    from jaxrl_post.sharding import make_mesh

    m = cfg.trainer.mesh
    return make_mesh(data=int(m.data), fsdp=int(m.fsdp), tensor=int(m.tensor))


def model_config_from(cfg: Any):
    """ModelConfig of a randomly initialised model: preset `model.preset` + non-None `model.arch` fields."""
    from jaxrl_post.models import get_preset

    overrides = {k: v for k, v in cfg.model.arch.items() if v is not None}
    return get_preset(cfg.model.preset).replace(dtype=cfg.model.dtype, param_dtype=cfg.model.dtype, **overrides)


def load_tokenizer(path: str):
    """`models.load_tokenizer`, memoised per process (a GGUF tokenizer takes seconds to parse);
    `'char'` -> the in-memory character tokenizer of `char_tokenizer.py` (tiny test models)."""
    if path == "char":
        from jaxrl_post.trainer.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    return _load_tokenizer_cached(str(path))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str):
    from jaxrl_post.models import load_tokenizer as _load

    return _load(path)


def build_actor_and_tokenizer(cfg: Any, mesh: jax.sharding.Mesh | None):
    """(actor Transformer, tokenizer). Random init when `model.random_init`, else `load_pretrained`.

    Raises:
      ValueError: the tokenizer's vocabulary is larger than the model's (token ids would be out of range).
    """
    from jaxrl_post.models import init_model, load_pretrained

    tok_path = cfg.model.tokenizer_path
    if cfg.model.random_init:
        tokenizer = load_tokenizer(tok_path or cfg.model.path)
        mcfg = model_config_from(cfg)
        model = init_model(mcfg, seed=int(cfg.trainer.seed), dtype=cfg.model.dtype, mesh=mesh, remat=cfg.model.remat)
    else:
        model, tokenizer = load_pretrained(cfg.model.path, dtype=cfg.model.dtype, mesh=mesh)
        model.remat = cfg.model.remat
        if tok_path or tokenizer is None:
            tokenizer = load_tokenizer(tok_path or cfg.model.path)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"config.model: tokenizer has {len(tokenizer)} tokens but the model vocabulary is {model.config.vocab_size}"
        )
    return model, tokenizer


def eos_and_pad(tokenizer) -> tuple[tuple[int, ...], int]:
    """(EOS ids ending a response, pad id) of the tokenizer."""
    from jaxrl_post.models.tokenizer import eos_token_ids

    eos = tuple(eos_token_ids(tokenizer))
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def _rg_kwargs(cfg: Any, val: bool) -> dict[str, Any]:
    from jaxrl_post.data.sources import disjoint_seed

    rg = cfg.data.reasoning_gym
    val_seed = rg.val_seed if rg.val_seed is not None else disjoint_seed(rg.seed, rg.size)
    task_cfg = {k: (tuple(v) if isinstance(v, list) else v) for k, v in rg.config.to_dict().items() if v is not None}
    return dict(
        size=int(rg.val_size if val else rg.size),
        seed=int(val_seed if val else rg.seed),
        config=task_cfg or None,
        prompt_format=rg.prompt_format,
    )


def load_split_rows(cfg: Any, val: bool) -> list[dict[str, Any]]:
    """Rows of `data.train_files` / `data.val_files` (comma-separated specs) via `data.sources.load_rows`."""
    from jaxrl_post.data.sources import load_rows

    spec = cfg.data.val_files if val else cfg.data.train_files
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    rows = load_rows(
        specs if len(specs) > 1 else specs[0],
        split="test" if val else "train",
        skip_malformed=bool(cfg.data.skip_malformed),
        system_prompt=cfg.data.system_prompt,
        **_rg_kwargs(cfg, val),
    )
    return list(getattr(rows, "rows", rows))


def _prompt_key(row: dict[str, Any]) -> str:
    return repr([m.get("content") for m in row["prompt"]])


def heldout_rows(
    train_rows: list[dict[str, Any]], val_rows: list[dict[str, Any]], limit: int | None
) -> tuple[list[dict[str, Any]], int]:
    """Validation rows whose prompt does not occur in the training rows (first `limit`), and #dropped."""
    seen = {_prompt_key(r) for r in train_rows}
    kept = [r for r in val_rows if _prompt_key(r) not in seen]
    dropped = len(val_rows) - len(kept)
    if limit:
        kept = kept[:limit]
    return kept, dropped


def build_dataloaders(cfg: Any, tokenizer, pad_token_id: int):
    """(train loader (infinite, shuffled, drop_remainder), val loader or None, data stats dict)."""
    from jaxrl_post.data import pipeline

    train_rows = load_split_rows(cfg, val=False)
    train = pipeline.make_dataloader(
        train_rows,
        tokenizer,
        batch_size=int(cfg.data.train_batch_size),
        max_prompt_length=int(cfg.data.max_prompt_length),
        seed=int(cfg.data.seed),
        shuffle=bool(cfg.data.shuffle),
        num_epochs=None,
        drop_remainder=True,
        filter_overlong_prompts=bool(cfg.data.filter_overlong_prompts),
        truncation=cfg.data.truncation,
        pad_token_id=pad_token_id,
    )
    stats = dict(train.stats)
    val = None
    if cfg.data.val_files:
        spec_is_rg = str(cfg.data.val_files).startswith("reasoning_gym")
        want = int(cfg.data.max_val_samples or (cfg.data.reasoning_gym.val_size if spec_is_rg else 0)) or None
        val_rows, dropped = heldout_rows(train_rows, load_split_rows(cfg, val=True), want)
        factor = 2
        while spec_is_rg and len(val_rows) < want and factor <= 16:
            # problems seen in training were dropped: draw more from the same held-out generator
            more = cfg.copy_and_resolve_references()
            more.data.reasoning_gym.val_size = factor * int(cfg.data.reasoning_gym.val_size)
            val_rows, dropped = heldout_rows(train_rows, load_split_rows(more, val=True), want)
            factor *= 2
        stats["data/val_dropped_seen_in_train"] = dropped
        n_val = len(val_rows)
        if n_val == 0:
            raise ValueError(
                f"config.data.val_files: all {dropped} held-out prompts also occur in the training data"
                " (for reasoning_gym: move data.reasoning_gym.val_seed away from the training seeds)"
            )
        bs = int(cfg.data.val_batch_size or n_val)
        val = pipeline.make_dataloader(
            val_rows,
            tokenizer,
            batch_size=min(bs, n_val),
            max_prompt_length=int(cfg.data.max_prompt_length),
            shuffle=False,
            num_epochs=1,
            drop_remainder=False,
            filter_overlong_prompts=bool(cfg.data.filter_overlong_prompts),
            truncation=cfg.data.truncation,
            pad_token_id=pad_token_id,
        )
        stats["data/num_val_prompts"] = val.num_prompts
    return train, val, stats


def build_reward_manager(cfg: Any, tokenizer):
    """RewardManager scoring with `custom_reward_function` (if set) or `default_compute_score`."""
    from jaxrl_post.rewards import RewardManager, load_custom_reward_fn

    fn = load_custom_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    return RewardManager(
        fn, tokenizer, num_workers=int(cfg.reward_model.num_workers), timeout_s=float(cfg.reward_model.timeout_s)
    )


def optim_config(opt: Any, *, grad_clip: float, total_training_steps: int, updates_per_step: int) -> steps.OptimConfig:
    """verl `*.optim` -> OptimConfig. Warmup is counted in training steps (as verl's scheduler)."""
    warm = int(opt.lr_warmup_steps)
    if warm < 0:
        warm = math.floor(float(opt.lr_warmup_steps_ratio) * total_training_steps)
    return steps.OptimConfig(
        lr=float(opt.lr),
        total_steps=int(total_training_steps),
        warmup_steps=warm,
        warmup_style=opt.warmup_style,
        min_lr_ratio=float(opt.min_lr_ratio),
        weight_decay=float(opt.weight_decay),
        b1=float(opt.betas[0]),
        b2=float(opt.betas[1]),
        eps=float(opt.eps),
        grad_clip=float(grad_clip),
        updates_per_step=int(updates_per_step),
    )


def actor_loss_config(cfg: Any, on_policy: bool) -> steps.ActorLossConfig:
    a = cfg.actor
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    return steps.ActorLossConfig(
        loss_mode=a.policy_loss.loss_mode,
        loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=float(low),
        clip_ratio_high=float(high),
        clip_ratio_c=float(a.clip_ratio_c),
        entropy_coeff=float(a.entropy_coeff),
        use_kl_loss=bool(a.use_kl_loss),
        kl_loss_coef=float(a.kl_loss_coef),
        kl_loss_type=a.kl_loss_type,
        temperature=float(cfg.rollout.temperature) if cfg.rollout.do_sample else 1.0,
        on_policy=on_policy,
    )


def copy_tree(tree):
    """Fresh device buffers for every leaf (so donating one tree never invalidates the other)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def pad_rows(arrays: dict[str, np.ndarray], multiple: int) -> tuple[dict[str, np.ndarray], int]:
    """Pad the leading dim of every array up to a multiple of `multiple` with copies of row 0."""
    n = next(iter(arrays.values())).shape[0]
    pad = (-n) % multiple
    if not pad:
        return arrays, 0
    return {k: np.concatenate([v, np.repeat(v[:1], pad, axis=0)], axis=0) for k, v in arrays.items()}, pad
