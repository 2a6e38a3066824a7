"""List the `jaxrl_post` modules that no test of a pytest selection imports (default: the fast tier).

Usage: python scripts/fast_tier_coverage.py [PYTEST_ARGS...]   (default: -m "not slow")

Runs `python -m pytest -q PYTEST_ARGS` with JAXRL_POST_RECORD_MODULES set (tests/conftest.py then writes each
process's imported `jaxrl_post` modules), and prints every module of the package (found on disk, not imported
here) that none of them imported. Exit status: pytest's if it failed, else 1 when a module is missing, else 0.
An import is the floor, not line coverage: a module imported only through another is counted as covered.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def package_modules(root: pathlib.Path = REPO / "jaxrl_post") -> set[str]:
    """Dotted names of every `.py` file under `root` (`pkg/__init__.py` -> `pkg`)."""
    out = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def main(argv: list[str]) -> int:
    args = argv or ["-m", "not slow"]
    with tempfile.TemporaryDirectory() as record:
        env = dict(os.environ, JAXRL_POST_RECORD_MODULES=record)
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=REPO, env=env).returncode
        seen = set()
        for f in pathlib.Path(record).glob("*.txt"):
            seen |= set(f.read_text().split())
    missing = sorted(package_modules() - seen)
    print(f"\n{len(missing)} jaxrl_post modules imported by no selected test" + (":" if missing else ""))
    for name in missing:
        print(f"  {name}")
    return rc if rc else int(bool(missing))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
