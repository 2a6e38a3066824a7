"""scripts/simulate_replicas.py: arguments it cannot simulate are one argparse error line (exit 2), not a
ZeroDivisionError, a numpy ValueError or the page allocator's ValueError deep in the run."""

import pytest

from tests.script_loader import load_script

sim = load_script("simulate_replicas")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--prompts", "0"], "error: --prompts: must be >= 1, got 0"),
        (["--n", "-1"], "error: --n: must be >= 1, got -1"),
        (["--sigma", "-1"], "error: --mean must be > 0 and --sigma >= 0, got 300.0, -1.0"),
        # a 256-token prompt + 2048 response tokens in pages of 16: 144 pages + the null page
        (["--tight-pages", "144"], "error: --tight-pages: must hold one longest sequence (145 pages of 16), got 144"),
    ],
)
def test_bad_arguments_are_one_usage_error(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        sim.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(line)
