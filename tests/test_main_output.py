"""``python -m mpiallreduce`` prints clean text: no NUL (``MPI.Get_library_version()`` ends with
one) or other control bytes, so ``grep`` and pagers read it as text, whatever MPI reports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import launcher_environment

from mpiallreduce import __main__ as main_module

#: bytes a text line may hold below 0x20
ALLOWED = {ord("\n"), ord("\t")}


def _control_bytes(data: bytes) -> list[tuple[int, int]]:
    """(offset, byte) of every control byte in ``data`` other than newline and tab."""
    return [(at, byte) for at, byte in enumerate(data)
            if (byte < 0x20 and byte not in ALLOWED) or byte == 0x7F]


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_the_output_holds_no_control_bytes(argv):
    done = subprocess.run([sys.executable, "-m", "mpiallreduce", *argv], capture_output=True,
                          timeout=120, env=launcher_environment())
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.strip(), "nothing printed"
    found = _control_bytes(done.stdout)
    assert found == [], f"control bytes {found[:5]} in {done.stdout[:400]!r}"
    assert _control_bytes(done.stderr) == [], done.stderr
    if not argv:
        assert b"MPI library: " in done.stdout


def test_a_refused_argument_is_said_in_clean_text():
    done = subprocess.run([sys.executable, "-m", "mpiallreduce", "x\x01y"], capture_output=True,
                          timeout=120, env=launcher_environment())
    assert done.returncode == 2
    assert _control_bytes(done.stderr) == [], done.stderr


def test_clean_keeps_newlines_and_tabs_and_drops_other_controls():
    assert main_module.clean("Open MPI v5\x00") == "Open MPI v5"
    assert main_module.clean("a\tb\nc\x1b[0m\x7fd\re") == "a\tb\nc[0mde"
