"""The RL trainer's prompt data from its config: the train and validation rows (files, reasoning-gym tasks,
held-out splits), the reward sources they name, and the grain loaders of prompt batches."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxrl_post.data import pipeline
from jaxrl_post.data.sources import disjoint_seed, load_rows
from jaxrl_post.errors import ConfigError
from jaxrl_post.rewards import UnknownDataSourceError, check_data_sources
from jaxrl_post.rl.config_check import validation_enabled
from jaxrl_post.rl.preflight import (
    check_reasoning_gym_task,
    check_remote_reward,
    load_custom_reward,
    not_enough_prompts_message,
)

log = logging.getLogger(__name__)


def _rg_kwargs(cfg: Any, val: bool) -> dict[str, Any]:

    rg = cfg.data.reasoning_gym
    val_seed = rg.val_seed if rg.val_seed is not None else disjoint_seed(rg.seed, rg.size)
    task_cfg = {k: (tuple(v) if isinstance(v, list) else v) for k, v in rg.config.to_dict().items() if v is not None}
    return dict(
        size=int(rg.val_size if val else rg.size),
        seed=int(val_seed if val else rg.seed),
        config=task_cfg or None,
        prompt_format=rg.prompt_format,
    )


def load_split_rows(cfg: Any, val: bool):
    """`sources.Rows` of `data.train_files` / `data.val_files` (comma-separated specs) via `sources.load_rows`.

    Raises: MalformedRowError naming the file, row and problem (unless `data.skip_malformed`);
      FileNotFoundError; ConfigError naming `data.train_files` / `data.val_files`: an unknown reasoning-gym
      task (lists similar and some valid task names), or no rows at all (empty file, or every row skipped as
      malformed).
    """

    key = "data.val_files" if val else "data.train_files"
    spec = cfg.data.val_files if val else cfg.data.train_files
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    for s in specs:
        check_reasoning_gym_task(key, spec, s)
    rows = load_rows(
        specs if len(specs) > 1 else specs[0],
        split="test" if val else "train",
        skip_malformed=bool(cfg.data.skip_malformed),
        system_prompt=cfg.data.system_prompt,
        **_rg_kwargs(cfg, val),
    )
    if len(rows) == 0:
        why = (
            f"all {rows.num_skipped} rows were skipped as malformed (data.skip_malformed=True)"
            if rows.num_skipped
            else "the data has no rows (an empty file?)"
        )
        raise ConfigError(f"config.{key}={spec!r}: {why}; point {key} at a file with prompt rows")
    return rows


def _prompt_key(row: dict[str, Any]) -> str:
    return repr([m.get("content") for m in row["prompt"]])


def heldout_rows(train_rows, val_rows, limit: int | None):
    """Validation rows whose prompt does not occur in the training rows (first `limit`), and #dropped.

    `train_rows` / `val_rows`: lists of rows or `sources.Rows` (then a `Rows` is returned)."""
    seen = {_prompt_key(r) for r in getattr(train_rows, "rows", train_rows)}
    rows = getattr(val_rows, "rows", val_rows)
    keep = [i for i, r in enumerate(rows) if _prompt_key(r) not in seen]
    dropped = len(rows) - len(keep)
    if limit:
        keep = keep[:limit]
    if hasattr(val_rows, "select"):
        return val_rows.select(keep), dropped
    return [rows[i] for i in keep], dropped


@dataclasses.dataclass
class DataRows:
    """Checked rows of both splits (`sources.Rows`; `val` None without validation data), data stats, and the
    custom reward function loaded while checking (None without `custom_reward_function.path`)."""

    train: Any
    val: Any
    stats: dict[str, Any]
    custom_reward_fn: Any = None


def _check_reward_sources(cfg: Any, data: DataRows) -> None:
    """Without a custom reward function, every row's data_source must have a scorer in the reward registry
    (unless the reward model is the reward, `reward_model.enable`); with one, it must load
    (`load_custom_reward`; kept in `data.custom_reward_fn` for the reward manager). A remote reward service
    must accept connections (`preflight.check_remote_reward`)."""
    check_remote_reward(cfg)  # nothing without reward_model.remote.url
    if cfg.custom_reward_function.path:
        data.custom_reward_fn = load_custom_reward(cfg)
        return
    if cfg.reward_model.remote.url or cfg.reward_model.judge.path or cfg.reward_model.enable:
        return

    for key, spec, rows in (
        ("train_files", cfg.data.train_files, data.train),
        ("val_files", cfg.data.val_files, data.val),
    ):
        if rows is None:
            continue
        try:
            check_data_sources(r["data_source"] for r in rows.rows)
        except UnknownDataSourceError as e:
            raise ConfigError(f"config.data.{key}={spec!r}: {e}") from e


def load_data_rows(cfg: Any) -> DataRows:
    """Load and check both splits' rows before any model is loaded (no tokenizer needed).

    Validation rows whose prompt occurs in the training data are dropped (a held-out set must be held out;
    counted in `data/val_dropped_seen_in_train`); reasoning-gym specs draw more to keep `val_size`.

    Raises:
      MalformedRowError: a malformed row (file, row, problem; suggests `data.skip_malformed=True`).
      ConfigError: a data_source with no reward function and no `custom_reward_function.path` (lists the
        known ones); a `custom_reward_function.path/name` that does not load (`load_custom_reward`); no rows
        or an unknown reasoning-gym task (`load_split_rows`); a remote reward service that does not accept
        connections (`preflight.check_remote_reward`); every validation prompt also occurs in the
        training data while validation is on
        (`trainer.val_before_train`, `trainer.val_at_end`, `trainer.test_freq > 0`). With validation off
        such a val set is dropped with a warning (`trainer.validate()` then raises).
    """
    train_rows = load_split_rows(cfg, val=False)
    stats: dict[str, Any] = {}
    if train_rows.num_skipped:
        stats["data/num_skipped_malformed"] = train_rows.num_skipped
    val_rows = None
    if cfg.data.val_files:
        spec_is_rg = str(cfg.data.val_files).startswith("reasoning_gym")
        want = int(cfg.data.max_val_samples or (cfg.data.reasoning_gym.val_size if spec_is_rg else 0)) or None
        loaded = load_split_rows(cfg, val=True)
        val_rows, dropped = heldout_rows(train_rows, loaded, want)
        factor = 2
        while spec_is_rg and len(val_rows) < want and factor <= 16:
            # problems seen in training were dropped: draw more from the same held-out generator
            more = cfg.copy_and_resolve_references()
            more.data.reasoning_gym.val_size = factor * int(cfg.data.reasoning_gym.val_size)
            loaded = load_split_rows(more, val=True)
            val_rows, dropped = heldout_rows(train_rows, loaded, want)
            factor *= 2
        stats["data/val_dropped_seen_in_train"] = dropped
        if loaded.num_skipped:
            stats["data/num_val_skipped_malformed"] = loaded.num_skipped
        if len(val_rows) == 0:
            why = (
                f"config.data.val_files={cfg.data.val_files!r}: all {dropped} validation prompts also occur in "
                f"config.data.train_files={cfg.data.train_files!r}; validating on training prompts would measure "
                "memorisation, not held-out accuracy"
            )
            if validation_enabled(cfg):
                raise ConfigError(
                    f"{why}. Use held-out data (for reasoning_gym: move data.reasoning_gym.val_seed away from the "
                    "training seeds), or turn validation off (trainer.val_before_train=False, "
                    "trainer.val_at_end=False, trainer.test_freq=-1)."
                )
            log.warning("%s; validation is off, so the validation set is dropped.", why)
            val_rows = None
    data = DataRows(train_rows, val_rows, stats)
    _check_reward_sources(cfg, data)
    return data


def build_dataloaders(cfg: Any, data: DataRows, tokenizer, pad_token_id: int):
    """(train loader (infinite, shuffled, drop_remainder), val loader or None, data stats dict) from the
    rows of `load_data_rows`.

    Raises:
      ConfigError: every prompt is longer than `data.max_prompt_length` (with `data.filter_overlong_prompts`;
        gives the longest / median prompt length), or fewer training prompts than `data.train_batch_size`.
      MalformedRowError: a prompt the chat template rejects, or an overlong one with truncation='error'.
    """

    try:
        train = pipeline.make_dataloader(
            data.train,
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
    except pipeline.NotEnoughPromptsError as e:
        raise ConfigError(not_enough_prompts_message(cfg, "data.train_files", cfg.data.train_files, e)) from e
    stats = dict(train.stats, **data.stats)
    val = None
    if data.val is not None:
        n_val = len(data.val)
        bs = int(cfg.data.val_batch_size or n_val)
        try:
            val = pipeline.make_dataloader(
                data.val,
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
        except pipeline.NotEnoughPromptsError as e:
            raise ConfigError(not_enough_prompts_message(cfg, "data.val_files", cfg.data.val_files, e)) from e
        stats["data/num_val_prompts"] = val.num_prompts
    return train, val, stats
