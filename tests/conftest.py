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
# Then the cheap XLA:CPU code generation (tests/cheap_compile.py: LLVM -O0) for the whole session: most of the
# suite's time is XLA:CPU compiling tiny models. Added after the defaults, each flag only if XLA_FLAGS does not name
# it yet, so both sets apply and a value given in the environment wins. The HLO programs are the same, the float
# rounding is not (LLVM -O0 emits other instructions: gradients of a tiny model differ in the last bits); a test
# that compares against numbers recorded under the production flags is marked `production_xla_flags` (below).
from tests.cheap_compile import (  # (imports no JAX)
    PRODUCTION_XLA_ENV,
    add_cheap_compile_flags,
    without_cheap_compile_flags,
)

if os.environ.get(PRODUCTION_XLA_ENV) != "1":
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

import subprocess
import sys

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


# The longest test files of a CI run (seconds of test time, 2026-12-07; docs/performance.md "Test suite: time per
# file"), started first. `-n 2 --dist loadfile` hands each worker the next file of the collection when it runs out
# of work, and pyproject's `--no-loadscope-reorder` keeps this order (xdist's default reorders the files by their
# number of tests, which left single-test files of 2-2.5 min, e.g. test_rollout_tp.py, for the end of the run, one
# worker idle meanwhile). Longest first, each worker's total ends within a few seconds of the other's. A file not
# listed keeps its place in the collection, after these.
LONGEST_FILES_FIRST = (
    "tests/e2e/test_notebooks.py",  # 350 s
    "tests/e2e/test_multihost.py",  # 298 s
    "tests/rl/async_training/test_split_trainer.py",  # 192 s
    "tests/rl/test_rollout_tp.py",  # 149 s
    "tests/e2e/test_interrupt.py",  # 147 s
    "tests/rl/test_trainer.py",  # 144 s
    "tests/e2e/test_resume.py",  # 143 s
    "tests/rollout/test_rollout.py",  # 131 s
    "tests/models/test_lora.py",  # 130 s
    "tests/e2e/test_multihost_sft.py",  # 130 s
    "tests/rollout/test_agent_loop_model.py",  # 121 s
    "tests/rl/async_training/test_background_trainer.py",  # 116 s
)


def pytest_collection_modifyitems(config, items):
    """The files of `LONGEST_FILES_FIRST` first, in that order; each file's tests keep their order (stable sort)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `production_xla_flags` compares exactly against numbers recorded under the production XLA:CPU
    code generation (what `python -m jaxrl_post.main` compiles with). XLA reads XLA_FLAGS once per process, so in a
    process with the cheap flags the test runs in a pytest subprocess without them (the job's defaults kept) and
    fails with that run's output if it fails there."""
    if pyfuncitem.get_closest_marker("production_xla_flags") is None or os.environ.get(PRODUCTION_XLA_ENV) == "1":
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update({PRODUCTION_XLA_ENV: "1", "XLA_FLAGS": without_cheap_compile_flags(env.get("XLA_FLAGS", ""))})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", pyfuncitem.nodeid]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"under the production XLA flags ({' '.join(cmd[1:])}):\n{proc.stdout[-6000:]}", pytrace=False)
    return True


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
