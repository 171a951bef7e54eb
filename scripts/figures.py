"""Render the measured figures of ``docs/results/`` into the README and the docs pages.

A page asks for a table with a pair of markers, and for a single figure in prose with another::

    <!-- results: call_cost -->
    (the table and its provenance line, written by this script)
    <!-- end results -->

    a repeated 8-byte call takes <!-- value: call_cost.plan_8B -->0.26<!-- end value --> of ...

``results: NAME columns=0,2 rows=1,3`` keeps some columns or rows (indices). Every figure on a
page comes from one result file, so two pages cannot disagree; rerunning a measuring script and
then this one updates every page that quotes it.

    python scripts/figures.py           # rewrite the pages from the result files
    python scripts/figures.py --check   # exit 1 if a page differs from its result files (a test)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PROVENANCE_KEYS = ("machine", "cpu", "cores", "mpi", "mpi4py", "numpy", "python", "commit", "date",
                   "command", "ranks", "load")

TABLE = re.compile(r"(<!-- results: (?P<name>[\w.-]+)(?P<opts>[^>]*?) -->\n)(?P<body>.*?)"
                   r"(<!-- end results -->)", re.S)
VALUE = re.compile(r"(<!-- value: (?P<name>[\w.-]+)\.(?P<key>\w+) -->)(?P<body>.*?)"
                   r"(<!-- end value -->)", re.S)


class FigureError(ValueError):
    """A marker names a result file or a figure that does not exist, or a file lacks a field."""


def pages() -> list[pathlib.Path]:
    """The pages that may quote results: the README and every Markdown page under docs/."""
    found = [ROOT / "README.md"]
    found += sorted(p for p in (ROOT / "docs").rglob("*.md")
                    if "_build" not in p.parts and "results" not in p.parts)
    return found


_CACHE: dict[str, dict] = {}


def load(name: str) -> dict:
    """A result file, checked for the fields every page relies on."""
    if name not in _CACHE:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise FigureError(f"no result file docs/results/{name}.json")
        doc = json.loads(path.read_text())
        missing = [k for k in ("title", "provenance", "columns", "rows") if k not in doc]
        missing += [f"provenance.{k}" for k in PROVENANCE_KEYS if k not in doc.get("provenance", {})]
        if missing:
            raise FigureError(f"docs/results/{name}.json lacks {', '.join(missing)}")
        _CACHE[name] = doc
    return _CACHE[name]


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt and not isinstance(value, str):
        return fmt.format(value)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _indices(opts: str, key: str, n: int) -> list[int]:
    m = re.search(rf"\b{key}=([\d,]+)", opts)
    if not m:
        return list(range(n))
    picked = [int(i) for i in m.group(1).split(",")]
    if any(i >= n for i in picked):
        raise FigureError(f"{key}={m.group(1)} but the file has {n}")
    return picked


def caption(name: str) -> str:
    """One line saying where the figures were measured and by which command."""
    doc = load(name)
    p = doc["provenance"]
    load1 = p["load"][0] if isinstance(p["load"], list) else p["load"]
    ranks = f"{p['ranks']} rank" + ("" if p["ranks"] == 1 else "s")
    text = (f"Measured by `{p['command']}` at {ranks}: {p['mpi']}, {p['cpu']} "
            f"({p['cores']} cores), load {load1}, commit `{p['commit']}`; "
            f"`docs/results/{name}.json`.")
    if doc.get("notes"):
        text += f" {doc['notes']}"
    return f"*{text}*"


def table(name: str, opts: str = "") -> str:
    """The Markdown table of a result file (optionally some columns/rows) and its caption."""
    doc = load(name)
    cols = _indices(opts, "columns", len(doc["columns"]))
    rows = _indices(opts, "rows", len(doc["rows"]))
    formats = doc.get("formats") or [None] * len(doc["columns"])
    head = [doc["columns"][c] for c in cols]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if c == cols[0] else "---:" for c in cols) + "|"]
    for r in rows:
        row = doc["rows"][r]
        lines.append("| " + " | ".join(_cell(row[c], formats[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n\n" + caption(name) + "\n"


def value(name: str, key: str) -> str:
    """A single named figure of a result file, as prose quotes it."""
    values = load(name).get("values", {})
    if key not in values:
        raise FigureError(f"docs/results/{name}.json has no value {key!r} (has {sorted(values)})")
    return _cell(values[key], None)


def render(text: str) -> str:
    """The page with every marked table and value rewritten from its result file."""
    text = TABLE.sub(lambda m: m.group(1) + table(m["name"], m["opts"]) + m.group(5), text)
    return VALUE.sub(lambda m: m.group(1) + value(m["name"], m["key"]) + m.group(5), text)


def cited() -> set[str]:
    """The result files some page quotes."""
    names = set()
    for page in pages():
        text = page.read_text()
        names |= {m["name"] for m in TABLE.finditer(text)}
        names |= {m["name"] for m in VALUE.finditer(text)}
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report pages that differ; write nothing")
    args = ap.parse_args(argv)
    stale, errors = [], []
    for page in pages():
        text = page.read_text()
        try:
            new = render(text)
        except FigureError as exc:
            errors.append(f"{page.relative_to(ROOT)}: {exc}")
            continue
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    for line in errors:
        print(line, file=sys.stderr)
    if args.check and stale:
        print("out of date with docs/results (run python scripts/figures.py): "
              + ", ".join(map(str, stale)), file=sys.stderr)
    elif stale:
        print("updated: " + ", ".join(map(str, stale)))
    return 1 if errors or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
