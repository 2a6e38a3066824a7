"""scripts/fast_tier_coverage.py: the package's module names found on disk, and the recording hook in conftest."""

import os
import subprocess
import sys

from tests.script_loader import REPO, load_script


def test_package_modules_names_files_and_packages(tmp_path):
    cov = load_script("fast_tier_coverage")
    for rel in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py", "pkg/data.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert cov.package_modules(tmp_path / "pkg") == {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b"}
    real = cov.package_modules()
    assert {"jaxrl_post", "jaxrl_post.algos.core_algos", "jaxrl_post.rl.trainer"} <= real


def test_conftest_records_the_imported_package_modules(tmp_path):
    """One tiny test file run with JAXRL_POST_RECORD_MODULES: the file of the process lists what it imported."""
    (tmp_path / "test_one.py").write_text("def test_it():\n    import jaxrl_post.algos.core_algos  # noqa: F401\n")
    env = dict(os.environ, JAXRL_POST_RECORD_MODULES=str(tmp_path), PYTHONPATH=REPO)
    env.pop("PYTEST_XDIST_WORKER", None)  # under xdist the child would name its file after this worker
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--rootdir", REPO]
    cmd += ["-p", "tests.conftest", str(tmp_path / "test_one.py")]  # the file sits outside tests/: load its conftest
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = (tmp_path / "main.txt").read_text().split()
    assert "jaxrl_post.algos.core_algos" in names and all(n.startswith("jaxrl_post") for n in names)
