"""scripts/figures.py: the figures quoted in README.md, docs/*.md and the notebooks' markdown come from
docs/figures.json. The repository passes `check`; a tampered copy fails naming file:line and both values;
`write` repairs it; `from-run` turns a run's metrics.jsonl into the default-run figures."""

import json
import pathlib
import re
import shutil
import statistics

import pytest

from tests.script_loader import load_script

REPO = pathlib.Path(__file__).resolve().parents[2]
figures = load_script("figures")


@pytest.fixture
def copy(tmp_path):
    """README.md, docs/*.md, docs/figures.json and colab/*.ipynb copied to a tmp root."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "colab").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for p in [*REPO.glob("docs/*.md"), REPO / "docs/figures.json", *REPO.glob("colab/*.ipynb")]:
        shutil.copy(p, tmp_path / p.relative_to(REPO))
    return tmp_path


def _check(root, capsys):
    rc = figures.main(["--root", str(root), "check"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_repository_agrees_with_figures_json(capsys):
    rc, out = _check(REPO, capsys)
    assert rc == 0, out
    n = int(re.match(r"(\d+) figures in", out)[1])
    assert n >= 40, out  # README, results, tutorials, the notebooks, LoRA, bf16, DAPO


def _markdown(path):
    """A page's markdown: the file, or a notebook's markdown cells (its outputs are a run's, not quotes)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_default_run_accuracy_is_quoted_only_inside_spans():
    """An unmarked copy of the default run's final accuracy would drift unnoticed: every quote of it is a span.
    (Its step-0 accuracy, 10.75%, is also other runs' step 0, so it is not searched for.)"""
    data = figures.load(REPO)
    texts = {figures.render(data, "default_run.val_after", fmt) for fmt in ("pct", "f3", "f2")}  # 34.58% 0.346 0.35
    texts.add(f"{data['default_run']['figures']['val_after']['value']}")  # 0.3458
    # a quote is the number on its own, not the tail or head of another one (20.35, 0.352 are not 0.35)
    quoted = {t: re.compile(r"(?<![\d.])" + re.escape(t) + r"(?![\d])") for t in texts}
    pages = {p.name: figures.SPAN.sub("", _markdown(p)) for p in figures.pages(REPO)}
    loose = [(name, t) for name, text in pages.items() for t in texts if quoted[t].search(text)]
    assert not loose, f"quoted outside a <!-- fig:... --> span: {loose}"


def test_a_tampered_copy_fails_naming_the_span_and_write_repairs_it(copy, capsys):
    readme, nb = copy / "README.md", copy / "colab/01_concepts.ipynb"
    original = {p: p.read_text() for p in (readme, nb)}
    span = "<!-- fig:default_run.val_after -->34.58%<!-- /fig -->"
    assert span in original[readme]
    readme.write_text(original[readme].replace(span, span.replace("34.58%", "30.25%"), 1))
    nb01 = figures.render(figures.load(copy), "notebook_times.nb01_s", "min1")  # the minutes 01's first cell quotes
    nb.write_text(original[nb].replace(f"-->{nb01}<!-- /fig -->", "-->3.4<!-- /fig -->"))
    line = next(i for i, s in enumerate(original[readme].splitlines(), 1) if span in s)
    nb_line = next(i for i, s in enumerate(original[nb].splitlines(), 1) if f"-->{nb01}<!--" in s)
    rc, out = _check(copy, capsys)
    assert rc == 1
    assert f"README.md:{line}: fig:default_run.val_after says '30.25%', docs/figures.json gives '34.58%'" in out
    assert f"colab/01_concepts.ipynb:{nb_line}: fig:notebook_times.nb01_s says '3.4'" in out
    assert figures.main(["--root", str(copy), "write"]) == 0
    assert {p: p.read_text() for p in (readme, nb)} == original
    assert _check(copy, capsys)[0] == 0


def test_a_changed_figure_fails_every_page_quoting_it_until_written(copy, capsys):
    data = json.loads((copy / "docs/figures.json").read_text())
    data["default_run"]["figures"]["val_after"]["value"] = 0.4012
    (copy / "docs/figures.json").write_text(json.dumps(data))
    rc, out = _check(copy, capsys)
    assert rc == 1
    failing = {m.split(":")[0] for m in re.findall(r"^\S+:\d+: fig:default_run\.val_after", out, re.M)}
    assert {"README.md", "docs/results.md"} <= failing
    assert "docs/lora.md" in out and "'0.346'" in out and "'0.401'" in out  # the :f3 quote, its own format
    figures.main(["--root", str(copy), "write"])
    assert "<!-- fig:default_run.val_after -->40.12%<!-- /fig -->" in (copy / "README.md").read_text()
    assert _check(copy, capsys)[0] == 0


def test_unknown_figure_unclosed_marker_and_code_cell_marker_are_problems(copy, capsys):
    page = copy / "docs/results.md"
    page.write_text(
        page.read_text() + "\nx <!-- fig:default_run.nope -->1<!-- /fig --> y <!-- fig:default_run.date -->\n"
    )
    nb = copy / "colab/02_grpo_quickstart.ipynb"
    cells = json.loads(nb.read_text())
    code = next(c for c in cells["cells"] if c["cell_type"] == "code")
    code["source"] = ["# <!-- fig:default_run.date -->2026-12-03<!-- /fig -->\n", *code["source"]]
    nb.write_text(json.dumps(cells, indent=1))
    rc, out = _check(copy, capsys)
    n = len(page.read_text().splitlines())
    assert rc == 1
    assert f"docs/results.md:{n}: fig:default_run.nope: no figure 'default_run.nope'" in out
    assert f"docs/results.md:{n}: a <!-- fig:...--> marker without its <!-- /fig -->" in out
    assert "colab/02_grpo_quickstart.ipynb: code cell" in out


def _synthetic_run(run_dir, n=30):
    """metrics.jsonl of a 30-step run: validation at step 0 and after step n, one line per step."""
    key = "val-core/reasoning_gym/basic_arithmetic/reward/mean@1"
    rows = [{"step": 0, key: 0.1, "timing_s/testing": 70.0}]
    for s in range(1, n + 1):
        rows.append(
            {
                "step": s,
                "critic/score/mean": s / 100,
                "response_length/mean": 40.0 - s,
                "timing_s/step": 10.0 + s,
                "timing_s/gen": 4.0 + s / 10,
                "timing_s/update_actor": 5.0 + s / 5,
            }
        )
    rows[-1] |= {key: 0.5125, "timing_s/testing": 45.5}
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_from_run_reads_the_default_run_figures(copy, tmp_path, capsys):
    _synthetic_run(tmp_path / "run")
    time_v = tmp_path / "time.txt"
    time_v.write_text(
        "\tElapsed (wall clock) time (h:mm:ss or m:ss): 12:03.50\n\tMaximum resident set size (kbytes): 6543210\n"
    )
    argv = ["--root", str(copy), "from-run", str(tmp_path / "run"), "--time-v", str(time_v), "--commit", "abc1234"]
    assert figures.main(argv) == 0
    group = json.loads((copy / "docs/figures.json").read_text())["default_run"]
    got = {k: e["value"] for k, e in group["figures"].items()}
    assert got["val_before"] == 0.1 and got["val_after"] == 0.5125
    assert got["score_first5"] == pytest.approx((1 + 2 + 3 + 4 + 5) / 500)
    assert got["score_last5"] == pytest.approx((26 + 27 + 28 + 29 + 30) / 500)
    assert got["response_length_first"] == 39.0 and got["response_length_last"] == 10.0
    assert got["step_median_s"] == pytest.approx(statistics.median(10.0 + s for s in range(1, 31)))  # 25.5
    assert got["update_median_s"] == pytest.approx(5.0 + 15.5 / 5)
    assert got["val_before_s"] == 70.0 and got["val_after_s"] == 45.5 and got["step1_s"] == 11.0
    assert got["steps"] == 30
    assert got["wall_s"] == 723.5 and got["peak_rss_gb"] == pytest.approx(6.54321)
    assert group["commit"] == "abc1234" and re.fullmatch(r"\d{4}-\d\d-\d\d", group["date"])
    capsys.readouterr()
    assert _check(copy, capsys)[0] == 1  # the pages still quote the old run
    figures.main(["--root", str(copy), "write"])
    readme = (copy / "README.md").read_text()
    assert "<!-- fig:default_run.val_after -->51.25%<!-- /fig -->" in readme
    assert "<!-- fig:default_run.wall_s -->12 min 4 s<!-- /fig -->" in readme  # 723.5 s rounds to 724
    assert _check(copy, capsys)[0] == 0


def test_from_run_refuses_without_wall_time_and_without_validations(copy, tmp_path, capsys):
    rows = _synthetic_run(tmp_path / "run")
    before = (copy / "docs/figures.json").read_text()
    assert figures.main(["--root", str(copy), "from-run", str(tmp_path / "run")]) == 2
    assert "--time-v" in capsys.readouterr().err
    (tmp_path / "run/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))  # no step 0
    args = ["--root", str(copy), "from-run", str(tmp_path / "run"), "--wall-seconds", "1", "--peak-rss-gb", "1"]
    assert figures.main(args) == 2
    assert "validation at step 0" in capsys.readouterr().err
    assert (copy / "docs/figures.json").read_text() == before


def test_formats():
    assert figures.FORMATS["pct"](0.3458) == "34.58%"
    assert figures.FORMATS["min_s"](687) == "11 min 27 s"
    assert figures.FORMATS["min1"](1104) == "18.4"
    text = "Elapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03\nMaximum resident set size (kbytes): 1000\n"
    assert figures.parse_time_v(text) == {"wall_s": 3723.0, "peak_rss_gb": 1e-3}
