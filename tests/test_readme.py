"""The README's first screen tells the truth: every command it shows exists and runs.

The first screen is everything before the "## Using it" section: make targets are checked with
``make -n``, ``python -m`` commands run (with ``--help`` where they are tools), the pip extras it
names exist in pyproject.toml, and every example it lists exists with a ``main()`` (the examples
themselves run in tests/test_examples.py).
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
FIRST_SCREEN = README.split("\n## Using it", 1)[0]


def test_the_first_screen_is_a_screen_or_so():
    assert "## Using it" in README
    assert len(FIRST_SCREEN.splitlines()) < 110
    for heading in ("## When it helps, and when it does not", "## Install", "## Use"):
        assert heading in FIRST_SCREEN


@pytest.mark.parametrize("target", sorted(set(re.findall(r"^make (\w[\w-]*)", FIRST_SCREEN, re.M))))
def test_make_targets_exist(target):
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


MODULES = sorted(set(re.findall(r"-m (mpiallreduce[\w.]*)", FIRST_SCREEN)))


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
    named = set(re.findall(r"mpiallreduce\[(\w+)\]", FIRST_SCREEN))
    assert named and named <= extras, (named, extras)


def test_listed_examples_exist_with_main():
    listed = sorted(set(re.findall(r"examples/(\w+\.py)", FIRST_SCREEN)))
    assert listed == sorted(p.name for p in (ROOT / "examples").glob("*.py")), listed
    for name in listed:
        assert "\ndef main(" in (ROOT / "examples" / name).read_text(), name
