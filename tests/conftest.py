"""Shared pytest setup: CPU JAX, offline Hugging Face, repo paths, one compilation cache for the session."""

import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The XLA:CPU flags `python -m jaxrl_post.main` sets (jaxrl_post/runtime/xla_flags.py; they change fusions, so float
# rounding): in-process trainers and the CLI runs the tests start compile the same programs, and the tests see
# what users run. Set before any test imports JAX.
from jaxrl_post.runtime.xla_flags import set_default_xla_flags  # (imports no JAX)

set_default_xla_flags()
# Then the cheap XLA:CPU code generation (tests/cheap_compile.py: LLVM -O0; the HLO programs are unchanged) for the
# whole session: most of the suite's time is XLA:CPU compiling tiny models. Added after the defaults, each flag
# only if XLA_FLAGS does not name it yet, so both sets apply and a value given in the environment wins.
from tests.cheap_compile import add_cheap_compile_flags  # (imports no JAX)

add_cheap_compile_flags()
# One persistent XLA compilation cache for the whole session: the pytest-xdist workers and every subprocess the
# tests start (main jobs, multi-host processes, notebook kernels) inherit these variables, so a program compiled
# once (the same tiny trainer is built in many files) is loaded from disk afterwards. The controller process
# creates a fresh directory per session (timings stay honest; nothing leaks between runs); a directory given in
# the environment is used as is (e.g. a warm cache kept across local runs).
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl_post_test_xla_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO_ROOT.parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.skip(f"GSM8K not found at {GSM8K_DIR}")
    return GSM8K_DIR


def pytest_sessionfinish(session, exitstatus):
    """The controller removes the session's compilation cache (xdist workers inherit the directory, not this).
    With JAXRL_POST_RECORD_MODULES=DIR, each process (controller, xdist worker) writes the `jaxrl_post` modules
    it imported to DIR/<worker>.txt (scripts/fast_tier_coverage.py lists the modules no selected test imports)."""
    record = os.environ.get("JAXRL_POST_RECORD_MODULES")
    if record:
        import sys

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        names = sorted(m for m in sys.modules if m == "jaxrl_post" or m.startswith("jaxrl_post."))
        pathlib.Path(record, f"{worker}.txt").write_text("\n".join(names) + "\n")
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
