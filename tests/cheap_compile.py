"""XLA:CPU flags for the tests, where compiling tiny models dominates the run time: LLVM at -O0 and without its
expensive passes. They change LLVM's code generation, not the HLO program XLA optimizes (its optimized HLO text is
the same with and without them), but the float rounding does change: -O0 emits other instructions, and a tiny
model's gradients differ in the last bits (float32, relative ~1e-6; `--xla_llvm_disable_expensive_passes` alone
changes nothing). Both sides of an equality a test checks therefore run under the same flags, and a test that
compares exactly against numbers recorded under the production flags is marked `production_xla_flags`.

tests/conftest.py adds them to `XLA_FLAGS` for the whole session (`add_cheap_compile_flags`): the pytest workers
and every subprocess that inherits the environment compile with them. A test that starts a subprocess with its
own `XLA_FLAGS` (e.g. fake devices) appends `CHEAP_COMPILE_FLAGS` itself. Measured: docs/performance.md, "Test
suite: cheap XLA:CPU compiles"."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CHEAP_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Set to "1": conftest leaves the cheap flags out of this process (a `production_xla_flags` test's own run).
PRODUCTION_XLA_ENV = "JAXRL_POST_TEST_PRODUCTION_XLA"


def add_cheap_compile_flags(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Append each flag of `CHEAP_COMPILE_FLAGS` to `environ["XLA_FLAGS"]` (default `os.environ`) unless that
    flag name is already there (a value the user set wins, e.g. `XLA_FLAGS=--xla_backend_optimization_level=3`
    runs the suite with the production code generation). Returns the flags added."""
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "").strip()
    names = {tok.split("=", 1)[0] for tok in current.split()}
    added = [f for f in CHEAP_COMPILE_FLAGS.split() if f.split("=", 1)[0] not in names]
    if added:
        env["XLA_FLAGS"] = " ".join(([current] if current else []) + added)
    return added


def without_cheap_compile_flags(xla_flags: str) -> str:
    """`xla_flags` (an `XLA_FLAGS` value) without any flag that `CHEAP_COMPILE_FLAGS` names."""
    names = {f.split("=", 1)[0] for f in CHEAP_COMPILE_FLAGS.split()}
    return " ".join(tok for tok in xla_flags.split() if tok.split("=", 1)[0] not in names)
