"""The documentation keeps its promises: the pages quote the result files exactly, every result
file says where it was measured, the API reference lists every
public name, and code, tests and pages carry no dates or issue numbers.

The site itself (Sphinx, warnings as errors, the pages' examples run) is built by `make docs`,
which `make test` runs.
"""

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b\d\d:\d\d(:\d\d)? ?UTC\b|\buntil 20\d\d\b")
ISSUE = re.compile(r"\b[Ii]ssue \d+|\b[Ii]ssue #\d+")


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_matches_its_result_files():
    figures = _figures()
    stale = []
    for page in figures.pages():
        text = page.read_text()
        if figures.render(text) != text:
            stale.append(str(page.relative_to(ROOT)))
    assert not stale, f"run python scripts/figures.py: {stale} differ from docs/results"


def test_figures_render_a_table_and_a_value_from_a_result_file(tmp_path, monkeypatch):
    figures = _figures()
    doc = {"schema": 1, "title": "t", "columns": ["size", "ratio"], "rows": [["8 B", 0.5712]],
           "formats": ["{}", "{:.2f}"], "values": {"r8": "0.57"},
           "provenance": {k: "x" for k in figures.PROVENANCE_KEYS} | {"load": [1.0, 1.0, 1.0]}}
    (tmp_path / "demo.json").write_text(json.dumps(doc))
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    monkeypatch.setattr(figures, "_CACHE", {})
    page = ("a <!-- value: demo.r8 -->?<!-- end value --> b\n"
            "<!-- results: demo -->\nold\n<!-- end results -->\n")
    out = figures.render(page)
    assert "a <!-- value: demo.r8 -->0.57<!-- end value --> b" in out
    assert "| 8 B | 0.57 |" in out and "old" not in out and "`docs/results/demo.json`" in out
    with pytest.raises(figures.FigureError, match="no value 'r9'"):
        figures.render("<!-- value: demo.r9 --><!-- end value -->")
    with pytest.raises(figures.FigureError, match="no result file"):
        figures.render("<!-- results: absent -->\n<!-- end results -->")


def test_every_quoted_result_file_says_where_it_was_measured():
    figures = _figures()
    cited = figures.cited()
    assert cited, "no page quotes a result file"
    for name in sorted(cited):
        doc = figures.load(name)
        prov = doc["provenance"]
        assert all(prov.get(k) not in (None, "") for k in figures.PROVENANCE_KEYS), name
        assert doc["rows"] and all(len(r) == len(doc["columns"]) for r in doc["rows"]), name


def test_the_api_reference_documents_every_public_name():
    import mpiallreduce as mar

    reference = (ROOT / "docs" / "reference" / "api.md").read_text()
    missing = [name for name in mar.__all__ if not name.startswith("__")
               and f"mpiallreduce.{name}" not in reference]
    assert not missing, f"docs/reference/api.md lacks {missing}"


@pytest.mark.parametrize("where", ["mpiallreduce", "tests", "docs", "README.md", "examples"])
def test_no_dates_or_issue_numbers(where):
    root = ROOT / where
    files = [root] if root.is_file() else [
        p for p in root.rglob("*") if p.suffix in (".py", ".pyx", ".pxd", ".md")
        and "_build" not in p.parts and "results" not in p.parts]
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if DATED.search(line) or ISSUE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:90]}")
    assert not found, "\n".join(found[:40])
