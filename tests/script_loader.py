"""Import a file of `scripts/` by name in tests (the scripts are not a package)."""

import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    """The module `scripts/<name>.py`, executed once per call (registered in sys.modules for dataclasses)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_test_module(rel: str):
    """The test module `tests/<rel>.py` (e.g. 'engine/test_loggers'), for a helper another folder's test reuses."""
    name = "_tests_" + rel.replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tests", f"{rel}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
