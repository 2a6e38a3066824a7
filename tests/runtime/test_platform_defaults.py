"""Platform defaults (`jaxrl_post/runtime/platform_defaults.py`): "auto" config values resolve by platform, explicit
values win, the CPU path keeps its values, host settings apply on CPU only."""

from __future__ import annotations

import logging

import pytest

from configs import base, grpo
from jaxrl_post.runtime import platform_defaults as pd
from jaxrl_post.runtime.xla_flags import DEFAULT_XLA_FLAGS


def test_base_config_leaves_the_platform_keys_on_auto():
    c = base.get_base_config()
    assert (c.model.dtype, c.model.remat, c.model.scan_layers, c.model.attention_impl) == ("auto",) * 4


@pytest.mark.parametrize(
    "platform, want",
    [
        ("cpu", ("float32", False, False, "xla")),  # the values the CPU path always had
        ("cuda", ("bfloat16", "nothing_saveable", True, "cudnn")),
        ("tpu", ("bfloat16", "nothing_saveable", True, "splash")),
    ],
)
def test_auto_resolves_by_platform_in_place(platform, want, caplog):
    c = base.get_base_config()
    with caplog.at_level(logging.INFO, logger="jaxrl_post.runtime.platform_defaults"):
        out = pd.resolve_config(c, platform)
    assert (c.model.dtype, c.model.remat, c.model.scan_layers) == want[:3]
    assert out["model.attention_impl"] == (want[3], "auto")
    assert c.model.attention_impl == "auto"  # the model builder resolves it (builders.apply_attention_impl)
    line = caplog.records[-1].getMessage()
    assert line.startswith(f"platform defaults on {pd.platform_name(platform)}: ") and "model.dtype=" in line
    assert pd.resolve_config(c, platform)["model.dtype"] == (want[0], "config")  # idempotent


def test_explicit_values_win_and_keep_their_types():
    c = grpo.get_config()
    c.model.dtype, c.model.remat, c.model.scan_layers = "float32", "dots_saveable", False
    out = pd.resolve_config(c, "tpu")
    assert (c.model.dtype, c.model.remat, c.model.scan_layers) == ("float32", "dots_saveable", False)
    assert all(src == "config" for k, (_, src) in out.items() if k.startswith("model.") and k != "model.attention_impl")
    c.model.remat = True  # a bool into the "auto" field (tests and configs assign either)
    assert pd.resolve("model.remat", c.model.remat, "gpu") is True


def test_cache_segments_and_unknown_platform():
    assert pd.cache_segment_len("cpu") is None  # the Generator's own choice (an eighth of the cache)
    assert pd.cache_segment_len("gpu") == pd.ONE_SEGMENT == pd.cache_segment_len("tpu")
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        pd.platform_name("metal")


def test_early_platform_reads_jax_platforms_without_starting_a_backend():
    assert pd.early_platform({"JAX_PLATFORMS": "cuda"}) == "gpu"
    assert pd.early_platform({"JAX_PLATFORMS": "tpu,cpu"}) == "tpu"
    assert pd.early_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"


def test_host_settings_apply_on_cpu_only():
    env: dict[str, str] = {}
    assert pd.apply_host_defaults(env, platform="gpu") == [] and env == {}
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    applied = pd.apply_host_defaults(env, platform="cpu")
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in applied
    assert env["XLA_FLAGS"] == " ".join(("--xla_dump_to=/tmp/x", *DEFAULT_XLA_FLAGS))
