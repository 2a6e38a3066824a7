"""The advantage-estimator and policy-loss registries: verl's ``register_adv_est`` / ``register_policy_loss``.

Each registry fills a plain dict (name -> function: ``ADV_ESTIMATORS``, ``POLICY_LOSSES``, what the lookups
return) and keeps beside it what each entry declared when it registered (name -> a frozen spec): the inputs
an estimator consumes (``needs``), the aggregation a loss fixes (``loss_agg_mode``) and the hyper-parameters
it reads (``params``). Config checks, the docs generator and the trainer read the declarations, so adding an
estimator or a loss is one decorated function (in :mod:`jaxrl_post.algos.advantages` or a module of
:mod:`jaxrl_post.algos.policy_losses`) and its test; nothing else names it. The built-in entries register when
those modules are imported; every lookup here imports them first.

Source: verl ``verl/trainer/ppo/core_algos.py`` (``ADV_ESTIMATOR_REGISTRY``, ``POLICY_LOSS_REGISTRY``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from jaxrl_post.algos.loss_agg import LOSS_AGG_MODES


class Registry:
    """``fns``: name -> function; ``specs``: name -> declaration; ``config_key``: the key that selects one."""

    def __init__(self, what: str, config_key: str, builtins: str):
        self.what = what
        self.config_key = config_key
        self.builtins = builtins  # module whose import registers the built-in entries
        self.fns: dict[str, Callable[..., Any]] = {}
        self.specs: dict[str, Any] = {}

    def add(self, name: str, fn: Callable[..., Any], spec: Any) -> None:
        """Register ``fn`` under ``name``. Raises ValueError for an empty/non-string name or a name already
        registered to another function (the same module.function again, e.g. a reloaded module, replaces it)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} name must be a non-empty string, got {name!r}")
        old = self.fns.get(name)
        same = old is not None and (old.__module__, old.__qualname__) == (fn.__module__, fn.__qualname__)
        if old is not None and not same:
            raise ValueError(
                f"{self.what} {name!r} is already registered ({old.__module__}.{old.__qualname__}); "
                f"cannot register {fn.__module__}.{fn.__qualname__} under the same name"
            )
        self.fns[name] = fn
        self.specs[name] = spec

    def remove(self, name: str) -> None:
        """Unregister ``name`` (no-op if absent); for tests and plugins that register temporarily."""
        self.fns.pop(name, None)
        self.specs.pop(name, None)

    def names(self) -> list[str]:
        importlib.import_module(self.builtins)
        return sorted(self.fns)

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name``. Raises ValueError naming the config key and the valid names."""
        if name not in self.fns:
            importlib.import_module(self.builtins)
        if name not in self.fns:
            raise ValueError(f"Unknown {self.config_key} {name!r} ({self.what}); valid names: {self.names()}")
        return self.fns[name]

    def spec(self, name: str) -> Any:
        """The declaration of ``name``; raises like :meth:`get`."""
        self.get(name)
        return self.specs[name]


def check_params(what: str, name: str, fn: Callable[..., Any], required: Iterable[str], declared: Iterable[str]):
    """Raise ValueError unless ``fn`` takes every ``required`` and ``declared`` parameter by keyword.

    Catches a typo in a registration's ``needs``/``params`` when the module is imported, not mid-run.
    """
    sig = inspect.signature(fn)
    takes = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [p for p in (*required, *declared) if p not in takes]
    if missing:
        raise ValueError(f"{what} {name!r}: {fn.__qualname__} has no parameter(s) {missing}; it takes {sorted(takes)}")


# ----------------------------------------------------------------------------------------------------------
# Advantage estimators (verl ``register_adv_est``): each declares the inputs it consumes
# ----------------------------------------------------------------------------------------------------------

# Batch inputs beside ``token_level_rewards`` / ``response_mask``, and what the trainer does for each:
ADV_ESTIMATOR_INPUTS = {
    "values": "critic values [B, R]: the trainer runs a critic (critic.enable=None turns it on)",
    "index": "group ids [B] (prompt uid): group-based, needs rollout.n >= 2",
    "reward_baselines": "score [B] of a greedy response per prompt: the trainer generates one more (ReMax)",
}
# Hyper-parameters ``compute_advantage`` forwards when declared (config ``algorithm.<name>``):
ADV_ESTIMATOR_HPARAMS = ("gamma", "lam", "epsilon", "norm_adv_by_std_in_grpo")


@dataclasses.dataclass(frozen=True)
class AdvEstimatorSpec:
    """What ``register_adv_est`` recorded: ``needs`` = inputs and hyper-parameters the estimator consumes."""

    needs: tuple[str, ...]


ADV_ESTIMATOR_REGISTRY = Registry("advantage estimator", "algorithm.adv_estimator", "jaxrl_post.algos.advantages")
ADV_ESTIMATORS: dict[str, Callable[..., Any]] = ADV_ESTIMATOR_REGISTRY.fns
ADV_ESTIMATOR_SPECS: dict[str, AdvEstimatorSpec] = ADV_ESTIMATOR_REGISTRY.specs


def register_adv_est(name: str, *, needs: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator: register an estimator ``fn(token_level_rewards, response_mask, ..., **needs)`` as ``name``.

    ``needs`` lists, by parameter name, what ``compute_advantage`` passes beside the rewards and the mask:
    batch inputs (keys of :data:`ADV_ESTIMATOR_INPUTS`) and hyper-parameters (:data:`ADV_ESTIMATOR_HPARAMS`).
    The estimator returns ``(advantages [B, R] float32, returns [B, R] float32)``, 0 outside the mask.
    Raises ValueError (at import) for an unknown entry in ``needs``, a parameter ``fn`` lacks, or a name
    already registered to another function. Source: verl ``register_adv_est``.
    """
    needs = tuple(needs)
    unknown = [n for n in needs if n not in ADV_ESTIMATOR_INPUTS and n not in ADV_ESTIMATOR_HPARAMS]
    if unknown:
        raise ValueError(
            f"advantage estimator {name!r}: unknown needs {unknown}; valid: "
            f"{sorted(ADV_ESTIMATOR_INPUTS) + list(ADV_ESTIMATOR_HPARAMS)}"
        )

    def decorator(fn):
        check_params("advantage estimator", name, fn, ("token_level_rewards", "response_mask"), needs)
        ADV_ESTIMATOR_REGISTRY.add(name, fn, AdvEstimatorSpec(needs))
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> Callable[..., Any]:
    """Look up ``algorithm.adv_estimator``. Raises ValueError listing the valid names.

    Source: verl ``get_adv_estimator_fn``.
    """
    return ADV_ESTIMATOR_REGISTRY.get(name)


def adv_estimator_needs(name: str) -> tuple[str, ...]:
    """The inputs and hyper-parameters estimator ``name`` declared; raises ValueError for an unknown name."""
    return ADV_ESTIMATOR_REGISTRY.spec(name).needs


# ----------------------------------------------------------------------------------------------------------
# Policy losses (verl ``register_policy_loss``): each may fix its aggregation and read hyper-parameters
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """What ``register_policy_loss`` recorded.

    ``loss_agg_mode``: the aggregation the reference fixes whatever ``actor.loss_agg_mode`` says (None: the
    configured one); ``params``: hyper-parameters read from ``actor.policy_loss.<name>``.
    """

    loss_agg_mode: str | None
    params: tuple[str, ...]


POLICY_LOSS_REGISTRY = Registry("policy loss", "actor.policy_loss.loss_mode", "jaxrl_post.algos.policy_losses")
POLICY_LOSSES: dict[str, Callable[..., Any]] = POLICY_LOSS_REGISTRY.fns
POLICY_LOSS_SPECS: dict[str, PolicyLossSpec] = POLICY_LOSS_REGISTRY.specs
_POLICY_LOSS_ARGS = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "rollout_is_weights")


def register_policy_loss(
    name: str, *, loss_agg_mode: str | None = None, params: Iterable[str] = ()
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low,
    clip_ratio_high, clip_ratio_c, loss_agg_mode, rollout_is_weights, **params, **agg_kwargs)
    -> (pg_loss [] float32, metrics)`` as ``actor.policy_loss.loss_mode=name``.

    ``loss_agg_mode``: set it when the reference aggregates one way whatever the configuration (verl's GSPO:
    ``seq-mean-token-mean``); the registered function is then a wrapper that always passes that mode, so
    direct calls and ``compute_policy_loss`` agree. ``params``: the loss's own hyper-parameters, config keys
    ``actor.policy_loss.<param>``, forwarded by ``compute_policy_loss``. Raises ValueError (at import) for an
    unknown mode, a parameter ``fn`` lacks, or a name already registered to another function.
    Source: verl ``register_policy_loss``.
    """
    params = tuple(params)
    if loss_agg_mode is not None and loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"policy loss {name!r}: loss_agg_mode {loss_agg_mode!r} not in {list(LOSS_AGG_MODES)}")

    def decorator(fn):
        check_params("policy loss", name, fn, _POLICY_LOSS_ARGS, params)
        if loss_agg_mode is not None:
            fn = _with_agg_mode(fn, loss_agg_mode)
        POLICY_LOSS_REGISTRY.add(name, fn, PolicyLossSpec(loss_agg_mode, params))
        return fn

    return decorator


def _with_agg_mode(fn: Callable, mode: str) -> Callable:
    """``fn`` with its ``loss_agg_mode`` argument replaced by ``mode`` (``__wrapped__`` is ``fn``)."""

    @functools.wraps(fn)
    def fixed(*args, **kwargs):
        kwargs["loss_agg_mode"] = mode
        return fn(*args, **kwargs)

    return fixed


def get_policy_loss_fn(name: str) -> Callable[..., Any]:
    """Look up ``actor.policy_loss.loss_mode``. Raises ValueError listing the valid names.

    Source: verl ``get_policy_loss_fn``.
    """
    return POLICY_LOSS_REGISTRY.get(name)


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The declaration of loss ``name``; raises ValueError for an unknown name."""
    return POLICY_LOSS_REGISTRY.spec(name)
