"""Generates `docs/config.md` (every config key: default, verl name, meaning) from `configs/base.py`, and
the tables of registered advantage estimators and policy losses in `docs/algorithms.md`.

    python scripts/gen_config_docs.py           # (re)write docs/config.md and the tables of docs/algorithms.md
    python scripts/gen_config_docs.py --check   # exit 1 if either is stale

Where each piece comes from:
- keys and defaults: the ConfigDict that `configs.base.get_base_config()` returns;
- meanings: the comments in the source of `configs/base.py`, found with `ast` (which statement assigns a
  key) and `tokenize` (which comments sit on that statement's lines). A key's meaning is its inline comment
  (after the code, on any line of the statement), followed by the comment block directly above the statement
  (no blank line in between). Keys assigned inside a helper (`c.actor.optim = _optim(...)`) take the
  comments of the helper's statements (`o.lr = lr  # ...`);
- sections: the `# ---------- name` header comments in `get_base_config`;
- the verl column: `configs.base.verl_key` (keys listed in `configs.base.VERL_KEYS`);
- valid names of `algorithm.adv_estimator` / `actor.policy_loss.loss_mode`, and the algorithms tables: the
  registries of `jaxrl_post.algos.registry` (built-in entries only: functions defined in `jaxrl_post`), with what
  each entry declared and the first line of its docstring. The tables replace the text between the
  `<!-- registry:begin -->` / `<!-- registry:end -->` markers of docs/algorithms.md.

Every key must have a comment: the script names the keys without one and exits 1. Output is deterministic.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import os
import re
import sys
import tokenize
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_PY = os.path.join(REPO, "configs", "base.py")
DOC_PATH = os.path.join(REPO, "docs", "config.md")
ALGO_PATH = os.path.join(REPO, "docs", "algorithms.md")
ALGO_BEGIN, ALGO_END = "<!-- registry:begin -->", "<!-- registry:end -->"
REGENERATE = "python scripts/gen_config_docs.py"
ROOT_FUNCTION = "get_base_config"
_SECTION = re.compile(r"^-{3,}\s*(.*)$")


@dataclass(frozen=True)
class Statement:
    """One `<var>.a.b = value` assignment in a function of the config source."""

    path: str  # dotted key relative to the function's ConfigDict, e.g. 'model.path' or 'lr'
    line: int  # first line of the statement
    meaning: str  # inline comment, then the comment block directly above ('' if none)
    section: str  # the last section header above it ('' if none)
    helper: str | None  # name of the module-level function the value is built by, if any


def _target_path(node: ast.expr) -> str | None:
    """`c.model.path` -> 'model.path' (the root variable dropped); None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or not parts:
        return None
    return ".".join(reversed(parts))


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """(inline, own_line): comment text by line number, split by whether code precedes it on the line."""
    inline, own_line = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        text = tok.string.lstrip("#").strip()
        (inline if tok.line[:col].strip() else own_line)[row] = text
    return inline, own_line


def parse_statements(source: str) -> dict[str, list[Statement]]:
    """Statements of every module-level function of `source`, by function name, in source order."""
    tree = ast.parse(source)
    inline, own_line = _comments(source)
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    out: dict[str, list[Statement]] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        headers = {
            r: m.group(1) for r, t in own_line.items() if fn.lineno < r <= fn.end_lineno and (m := _SECTION.match(t))
        }
        assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1]  # nested too
        stmts = []
        for node in sorted(assigns, key=lambda n: n.lineno):
            path = _target_path(node.targets[0])
            if path is None:
                continue
            section = next((headers[r] for r in sorted(headers, reverse=True) if r < node.lineno), "")
            parts = [inline[r] for r in range(node.lineno, node.end_lineno + 1) if r in inline]
            above, row = [], node.lineno - 1
            while row in own_line and not _SECTION.match(own_line[row]):
                above.insert(0, own_line[row])
                row -= 1
            meaning = _join(" ".join(parts), " ".join(above))
            value = node.value
            helper = None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in functions:
                helper = value.func.id
            stmts.append(Statement(path, node.lineno, meaning, section, helper))
        out[fn.name] = stmts
    return out


def _flatten(cfg: Any, prefix: str = ""):
    """(dotted key, value, type) for every leaf of a ConfigDict."""
    for k, v in cfg.items():
        if hasattr(v, "keys") and hasattr(v, "get_type"):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v, cfg.get_type(k)


def _fmt(v: Any) -> str:
    """Python-literal rendering with double-quoted strings (deterministic)."""
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ", ".join(_fmt(x) for x in v) + (",)" if len(v) == 1 else ")")
    return repr(v)


def _join(first: str, second: str) -> str:
    """'a' + 'b' -> 'a. b' (no doubled full stop); either may be empty."""
    if first and second:
        return f"{first}{'' if first.endswith(('.', ':', ';')) else '.'} {second}"
    return first or second


def _cell(text: str) -> str:
    """Markdown table cell: `|` escaped everywhere; `*`, `<`, `>` escaped outside `code` spans."""
    parts = text.split("`")
    for i, part in enumerate(parts):
        part = part.replace("|", "\\|")
        if i % 2 == 0:  # outside backticks
            part = part.replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")
        parts[i] = part
    return "`".join(parts)


@dataclass(frozen=True)
class KeyDoc:
    """One row of the table."""

    key: str
    default: str
    meaning: str
    section: str
    verl: str | None
    order: tuple[int, int]


def _load_base(path: str):
    spec = importlib.util.spec_from_file_location("_config_base_for_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collect(base_py: str = BASE_PY) -> tuple[list[KeyDoc], str]:
    """Rows for every key of `get_base_config()` (source order, group rows included) and the module docstring."""
    with open(base_py, encoding="utf-8") as f:
        source = f.read()
    module = _load_base(base_py)
    stmts = parse_statements(source)
    root = {s.path: s for s in stmts[ROOT_FUNCTION]}
    helpers = {p: s for p, s in root.items() if s.helper}
    verl_key = getattr(module, "verl_key", lambda key: None)
    rows = []
    for key, value, typ in _flatten(module.get_base_config()):
        stmt, inner = root.get(key), None
        if stmt is None:  # built by a helper: the helper's statement for the rest of the key
            for prefix, h in helpers.items():
                if key.startswith(prefix + "."):
                    inner = next((s for s in stmts[h.helper] if s.path == key[len(prefix) + 1 :]), None)
                    stmt = h
        default = _fmt(value) if value is not None else f"None ({getattr(typ, '__name__', typ)})"
        meaning = (inner or stmt).meaning if stmt else ""
        order = (stmt.line if stmt else 10**9, inner.line if inner else 0)
        names = registry_names().get(key)
        if names:
            meaning = _join(meaning, "Valid: " + ", ".join(f"`{n}`" for n in names))
        rows.append(KeyDoc(key, default, meaning, stmt.section if stmt else "", verl_key(key), order))
    # groups (`c.model.arch = mlc.ConfigDict()  # ...`) with a comment get a row of their own
    for s in stmts[ROOT_FUNCTION]:
        if s.meaning and not s.helper and any(r.key.startswith(s.path + ".") for r in rows):
            rows.append(KeyDoc(s.path + ".*", "", s.meaning, s.section, None, (s.line, -1)))
    rows.sort(key=lambda r: (r.order, r.key))
    return rows, ast.get_docstring(ast.parse(source)) or ""


def _registries():
    """{config key: Registry} of jaxrl_post.algos.registry (imports jaxrl_post from this checkout)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from jaxrl_post.algos import registry

    return {r.config_key: r for r in (registry.ADV_ESTIMATOR_REGISTRY, registry.POLICY_LOSS_REGISTRY)}


def _builtin(reg) -> list[str]:
    """Names whose function is defined in jaxrl_post (not one a test or a user script registered)."""
    return [n for n in reg.names() if reg.fns[n].__module__.startswith("jaxrl_post.")]


def registry_names() -> dict[str, list[str]]:
    """{config key: sorted built-in registered names} for the keys that select a registry entry."""
    return {key: _builtin(reg) for key, reg in _registries().items()}


def _summary(fn) -> str:
    """First paragraph of ``fn``'s docstring, reST code spans and roles turned into markdown."""
    doc = (getattr(fn, "__doc__", None) or "").strip().split("\n\n")[0]
    doc = re.sub(r":\w+:`", "`", " ".join(doc.split()).replace("``", "`"))
    return _cell(doc)


def render_algorithm_tables() -> str:
    """The markdown tables of registered estimators and losses (what goes between the markers)."""
    regs = _registries()
    est, loss = regs["algorithm.adv_estimator"], regs["actor.policy_loss.loss_mode"]
    out = [
        ALGO_BEGIN,
        f"<!-- Generated from jaxrl_post/algos/registry.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "### Advantage estimators (`algorithm.adv_estimator`)",
        "",
        "| Name | Function | Needs | Summary |",
        "|---|---|---|---|",
    ]
    for n in _builtin(est):
        fn, needs = est.fns[n], est.specs[n].needs
        out.append(
            f"| `{n}` | `{fn.__module__}.{fn.__name__}` | {', '.join(f'`{x}`' for x in needs)} | {_summary(fn)} |"
        )
    out += [
        "",
        "### Policy losses (`actor.policy_loss.loss_mode`)",
        "",
        "| Name | Function | Fixed aggregation | Hyper-parameters | Summary |",
        "|---|---|---|---|---|",
    ]
    for n in _builtin(loss):
        fn, spec = loss.fns[n], loss.specs[n]
        agg = f"`{spec.loss_agg_mode}`" if spec.loss_agg_mode else "`actor.loss_agg_mode`"
        params = ", ".join(f"`actor.policy_loss.{p}`" for p in spec.params)
        out.append(f"| `{n}` | `{fn.__module__}.{fn.__name__}` | {agg} | {params} | {_summary(fn)} |")
    return "\n".join(out + [ALGO_END])


def render_algorithms(current: str) -> str:
    """``current`` (the text of docs/algorithms.md) with its marked tables regenerated.

    Raises ValueError when the markers are missing."""
    begin, end = current.find(ALGO_BEGIN), current.find(ALGO_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{os.path.relpath(ALGO_PATH, REPO)}: missing the {ALGO_BEGIN} / {ALGO_END} markers")
    return current[:begin] + render_algorithm_tables() + current[end + len(ALGO_END) :]


def missing_meanings(rows: list[KeyDoc]) -> list[str]:
    """Keys without a comment in configs/base.py."""
    return [r.key for r in rows if not r.meaning]


def render(base_py: str = BASE_PY) -> str:
    """The full text of docs/config.md."""
    rows, doc = collect(base_py)
    missing = missing_meanings(rows)
    if missing:
        raise ValueError(f"configs/base.py: keys without a comment (add an inline `# meaning`): {missing}")
    out = [
        "# Configuration keys",
        "",
        f"<!-- Generated from configs/base.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key of `configs/base.py` with its default and meaning. Override any of them on the command line,",
        "e.g. `python -m jaxrl_post.main --config=configs/grpo.py --config.rollout.n=4`; the job configs",
        "(`configs/grpo.py`, `configs/ppo.py`, `configs/dapo.py` and their variants) change some defaults.",
        "`--config.KEY=None` sets None for a key whose default is None, a string key, or one `configs/base.py`",
        "declares optional (`_opt_int`, `_opt_str`, a typed `FieldReference`; its meaning says what None does,",
        "e.g. `trainer.max_actor_ckpt_to_keep`); a value the key's type cannot take (`--config.rollout.n=four`)",
        "stops the job with one `error:` line naming the key and the type.",
        "",
        "The *verl* column gives verl's full key for keys whose name and meaning (units included) are verl's;",
        "a dash marks our own keys. Rows ending in `.*` describe a group of keys.",
        "",
        "From `configs/base.py`:",
        "",
        *(f"> {line}".rstrip() for line in doc.splitlines()),
    ]
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            out += ["", f"## {section or 'other'}", "", "| Key | Default | verl | Meaning |", "|---|---|---|---|"]
        default = f"`{_cell(r.default)}`" if r.default else ""
        verl = f"`{r.verl}`" if r.verl else "—"
        out.append(f"| `{r.key}` | {default} | {verl} | {_cell(r.meaning)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Writes docs/config.md and the tables of docs/algorithms.md, or with `--check` reports whether they are
    up to date."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated doc differs from a fresh render")
    args = ap.parse_args(argv)
    try:
        with open(ALGO_PATH, encoding="utf-8") as f:
            algo_current = f.read()
        outputs = {DOC_PATH: render(), ALGO_PATH: render_algorithms(algo_current)}
    except (OSError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    stale = []
    for path, text in outputs.items():
        current = ""
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                current = f.read()
        if current == text:
            continue
        stale.append(os.path.relpath(path, REPO))
        if not args.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(path, REPO)}")
    if args.check and stale:
        print(f"{', '.join(stale)} stale; regenerate with: {REGENERATE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
