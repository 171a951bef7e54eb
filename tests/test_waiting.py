"""The one wait loop, ``_waiting.wait_until``, in both forms: the Python generator-paced loop
(the reference) and its compiled twin (``_compiled.wait_until``, which ``_waiting`` installs
where the extension is built) call ``ready`` alike and end alike."""

from __future__ import annotations

import time

import pytest

from mpiallreduce import _form, _waiting

PYTHON = getattr(_waiting.wait_until, "__wrapped__", _waiting.wait_until)
FORMS = {"python": PYTHON}
if _form.compiled is not None:
    FORMS["compiled"] = _form.compiled.wait_until


class Ready:
    """``ready()`` that turns true on its ``after``-th call (never, for None)."""

    def __init__(self, after=None):
        self.after, self.calls = after, 0

    def __call__(self):
        self.calls += 1
        return self.after is not None and self.calls >= self.after


@pytest.fixture(params=list(FORMS))
def wait_until(request):
    return FORMS[request.param]


def test_the_selected_form_is_installed():
    expected = _form.compiled.wait_until if _form.compiled is not None else PYTHON
    assert _waiting.wait_until is expected


@pytest.mark.parametrize("after", [1, 5, 64, 65, 200])
def test_true_on_the_call_that_is_ready_without_deadline(wait_until, after):
    ready = Ready(after)
    assert wait_until(ready, None) is True
    assert ready.calls == after


def test_false_past_the_deadline_after_one_more_call(wait_until):
    ready = Ready()
    start = time.monotonic()
    assert wait_until(ready, start + 0.02, spin=3, yield_seconds=0.005) is False
    took = time.monotonic() - start
    assert 0.02 <= took < 1.0
    # spins, then yields for 5 ms, then sleeps from 50 µs doubling to 1 ms: several calls each
    assert ready.calls > 3 + 2


def test_a_past_deadline_still_asks_ready(wait_until):
    ready = Ready(1)
    assert wait_until(ready, time.monotonic() - 1.0, spin=0, yield_seconds=0) is True
    assert ready.calls == 1


def test_the_sleeps_double_from_50_us_to_1_ms(wait_until):
    # no spin, no yielding: over 10 ms the sleeps are 50, 100, 200, 400, 800 µs, then 1 ms
    # each; the calls are about 5 + 8 + 1, never a busy loop's thousands
    ready = Ready()
    assert wait_until(ready, time.monotonic() + 0.01, spin=0, yield_seconds=0) is False
    assert 4 <= ready.calls <= 20, ready.calls


def test_on_timeout_raises_its_error_and_must_raise(wait_until):
    class Late(Exception):
        pass

    def late():
        raise Late("past it")

    with pytest.raises(Late, match="past it"):
        wait_until(Ready(), time.monotonic() + 0.001, late, spin=1, yield_seconds=0)
    with pytest.raises(AssertionError, match="must raise"):
        wait_until(Ready(), time.monotonic() + 0.001, lambda: None, spin=1, yield_seconds=0)


def test_an_error_of_ready_propagates(wait_until):
    def broken():
        raise ZeroDivisionError("ready failed")

    with pytest.raises(ZeroDivisionError, match="ready failed"):
        wait_until(broken, None)


def test_both_forms_call_ready_as_often_in_the_spin(wait_until):
    # the spin phase is exact: ``spin`` calls back to back before the first yield
    ready = Ready(11)
    assert wait_until(ready, None, spin=10, yield_seconds=0) is True
    assert ready.calls == 11
