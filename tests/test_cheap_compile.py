"""The tests' cheap XLA:CPU compile flags (tests/cheap_compile.py, tests/conftest.py): added after the job's
defaults without overriding a flag the environment names, and left out of a `production_xla_flags` test's run."""

import os

import pytest

from jaxrl_post.runtime.xla_flags import DEFAULT_XLA_FLAGS
from tests.cheap_compile import (
    CHEAP_COMPILE_FLAGS,
    PRODUCTION_XLA_ENV,
    add_cheap_compile_flags,
    without_cheap_compile_flags,
)

CHEAP = CHEAP_COMPILE_FLAGS.split()


def test_added_after_the_other_flags_once_and_a_given_value_wins():
    env = {}
    assert add_cheap_compile_flags(env) == CHEAP and env["XLA_FLAGS"] == CHEAP_COMPILE_FLAGS
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 "}
    add_cheap_compile_flags(env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS
    assert add_cheap_compile_flags(env) == [] and env["XLA_FLAGS"].count("--xla_backend_optimization_level") == 1
    env = {"XLA_FLAGS": "--xla_backend_optimization_level=3"}  # the production code generation, asked for
    assert add_cheap_compile_flags(env) == ["--xla_llvm_disable_expensive_passes=true"]
    assert env["XLA_FLAGS"] == "--xla_backend_optimization_level=3 --xla_llvm_disable_expensive_passes=true"


def test_removal_keeps_every_other_flag():
    flags = f"--xla_force_host_platform_device_count=4 {CHEAP_COMPILE_FLAGS} {DEFAULT_XLA_FLAGS[0]}"
    assert without_cheap_compile_flags(flags) == f"--xla_force_host_platform_device_count=4 {DEFAULT_XLA_FLAGS[0]}"
    assert without_cheap_compile_flags("--xla_backend_optimization_level=2") == ""


def test_this_session_compiles_with_the_defaults_and_the_cheap_flags():
    tokens = os.environ["XLA_FLAGS"].split()
    assert all(f in tokens for f in DEFAULT_XLA_FLAGS + tuple(CHEAP))
    assert os.environ.get(PRODUCTION_XLA_ENV) != "1"


@pytest.mark.production_xla_flags
def test_a_marked_test_runs_in_a_process_without_them():
    """conftest runs this in a pytest subprocess: the job's defaults, none of the cheap flags."""
    tokens = os.environ["XLA_FLAGS"].split()
    assert os.environ[PRODUCTION_XLA_ENV] == "1"
    assert all(f in tokens for f in DEFAULT_XLA_FLAGS)
    assert not any(t.split("=", 1)[0] in CHEAP_COMPILE_FLAGS for t in tokens)
