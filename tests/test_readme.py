"""The README (a user's front page) and docs/ tell the truth: every command they show exists and runs.

Make targets are checked with ``make -n``, ``python -m`` commands run (with ``--help`` where they
are tools), the pip extras named exist in pyproject.toml, every example listed exists with a
``main()`` (the examples themselves run in tests/test_examples.py), and every relative link in
README and docs resolves (file and, where given, heading anchor).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from conftest import launcher_environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = README
DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
PAGES = [ROOT / "README.md", *DOCS]


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) <= 120
    for heading in ("## Install and first run", "## Three ways to use it", "## When it helps",
                    "## Documentation"):
        assert heading in README
    linked = set(re.findall(r"\(docs/([\w/-]+\.md)", README))
    pages = {str(page.relative_to(ROOT / "docs")) for page in DOCS}
    assert linked == pages - {"index.md"}, linked ^ (pages - {"index.md"})


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                yield page, target


@pytest.mark.parametrize(("page", "target"), list(_links()),
                         ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, pathlib.Path) else v)
def test_relative_links_resolve(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{page.name}: {target} does not exist"
    if anchor and resolved.suffix == ".md":
        headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
        assert anchor in {_anchor(h) for h in headings}, f"{page.name}: no heading #{anchor}"


@pytest.mark.parametrize("target", sorted(set(re.findall(r"^make (\w[\w-]*)", FIRST_SCREEN, re.M))))
def test_make_targets_exist(target):
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


MODULES = sorted(set(re.findall(r"-m (mpiallreduce[\w.]*)",
                                "".join(page.read_text() for page in PAGES))))


def test_the_first_screen_names_commands():
    assert "mpiallreduce" in MODULES and "mpiallreduce.bench" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_python_m_commands_run(module):
    args = [] if module == "mpiallreduce" else ["--help"]
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=launcher_environment())
    assert done.returncode == 0, done.stdout + done.stderr


def test_pip_extras_exist():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1]
                            .split("\n[")[0], re.M))
    named = {extra for group in re.findall(r"pip install '[^']*\[([\w,]+)\]'", FIRST_SCREEN)
             for extra in group.split(",")}
    assert named and named <= extras, (named, extras)


def test_listed_examples_exist_with_main():
    listed = sorted(set(re.findall(r"examples/(\w+\.py)", "".join(p.read_text() for p in PAGES))))
    assert listed == sorted(p.name for p in (ROOT / "examples").glob("*.py")), listed
    for name in listed:
        assert "\ndef main(" in (ROOT / "examples" / name).read_text(), name


#: words with which a page keeps a measurement it says is superseded (an "older" table, a
#: "(before: ...)" figure, a run "measured again"): the current figure stays, with where and how
#: it was measured, and git history keeps the rest: a page states one figure per fact
SUPERSEDED = re.compile(r"tables? below (?:are|is) older|\bolder tables?\b|\(before: |"
                        r"\bmeasured again\b|\bearlier (?:sweep|runs?) the same\b|"
                        r"\ba run a minute earlier\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_pages_keep_no_superseded_measurements(page):
    stale = [f"{page.name}:{number}: {line.strip()}"
             for number, line in enumerate(page.read_text().splitlines(), 1)
             if SUPERSEDED.search(line)]
    assert not stale, "superseded measurements kept (git history has them):\n" + "\n".join(stale)


GETTING_STARTED = ROOT / "docs" / "getting-started.md"


def _install_lines() -> list[str]:
    """The shell lines of the getting-started page's install section that set up a shell
    (source, export): what the README sends a user to after `make`."""
    text = GETTING_STARTED.read_text()
    section = text.split("\n## Install", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith((". ", "source ", "export ")):
                lines.append(line)
    return lines


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "activate").exists(),
                    reason="no .venv: the README's set-up command (make) has not run")
def test_the_first_example_runs_as_written_after_the_set_up():
    # After `make test-quick` the README's first example failed: `mpirun: command not found`
    # (the venv was not on PATH), and Open MPI printed osc/ucx errors at the first window.
    command = re.search(r"`(mpirun -n \d+ python -m mpi4py examples/\w+\.py)`", README).group(1)
    env = {k: v for k, v in launcher_environment().items()
           if not k.startswith(("OMPI_", "PRTE_", "VIRTUAL_ENV"))}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":")
                           if not p.startswith(str(ROOT)))
    script = " && ".join([*_install_lines(), command])
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"
    assert "pi ~" in result.stdout
    assert "Error" not in result.stderr, result.stderr
