"""The one wait loop, ``_waiting.wait_until``, in both forms: the Python generator-paced loop
(the reference) and its compiled twin (``_compiled.wait_until``, which ``_waiting`` installs
where the extension is built) call ``ready`` alike and end alike."""

from __future__ import annotations

import time

import pytest

from mpiallreduce import _form, _waiting, executor

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


# -- the ready() of a wait for a few requests, and a schedule's timed step -------------------------

EACH = {"python": _waiting.PythonEachTested}
if _form.compiled is not None:
    EACH["compiled"] = _form.compiled.EachTested


class FakeRequest:
    """A request whose ``Test()`` turns true on its ``after``-th call, recording the order."""

    def __init__(self, name, after, log):
        self.name, self.after, self.calls, self.log = name, after, 0, log

    def Test(self):  # noqa: N802 - MPI's name
        self.calls += 1
        self.log.append(self.name)
        return self.calls >= self.after


@pytest.mark.parametrize("form", list(EACH))
def test_each_tested_asks_the_last_request_first_and_skips_the_done(form):
    log = []
    recv, send = FakeRequest("recv", 3, log), FakeRequest("send", 1, log)
    ready = EACH[form]([recv, send])
    assert ready() is False and ready() is False and ready() is True
    # the send (posted last) first, done at once; then only the receive until it is done
    assert log == ["send", "recv", "recv", "recv"]
    log.clear()
    assert ready() is True  # a next run (persistent requests) tests them all again
    assert log == ["send", "recv"]


@pytest.mark.parametrize("form", list(EACH))
def test_each_tested_of_no_request_is_ready(form):
    assert EACH[form]([])() is True


def test_a_few_requests_are_tested_one_by_one_and_more_with_testall():
    assert isinstance(_waiting.tested([FakeRequest("a", 1, [])] * _waiting.EACH_MOST),
                      _waiting.EachTested)
    assert not isinstance(_waiting.tested([FakeRequest("a", 1, [])] * (_waiting.EACH_MOST + 1)),
                          _waiting.EachTested)


class FakePlan:
    """What a timed step reads of its plan: the run's deadline and timeout, and ``expire``."""

    def __init__(self, deadline, timeout):
        self._deadline, self._timeout, self.expired = deadline, timeout, []

    def expire(self, requests, bound, timeout):
        self.expired.append((requests, bound, timeout))
        raise TimeoutError("expired")

    _poll_step = executor.Plan._poll_step  # the Python form's step, as Plan has it


STEPS = {"python": executor.python_polled_step}
if _form.compiled is not None:
    STEPS["compiled"] = _form.compiled.PolledStep


def test_the_selected_timed_step_is_installed():
    expected = (_form.compiled.PolledStep if _form.compiled is not None
                else executor.python_polled_step)
    assert executor.polled_step is expected


@pytest.mark.parametrize("form", list(STEPS))
def test_a_timed_step_waits_to_the_plans_deadline_then_expires(form):
    requests, bound = ["r"], "bound"
    plan = FakePlan(time.monotonic() + 60.0, 60.0)
    ready = Ready(3)
    STEPS[form](plan, ready, requests, bound)()
    assert ready.calls == 3 and plan.expired == []
    plan._deadline, plan._timeout = time.monotonic() - 1.0, 0.25  # read at each call
    with pytest.raises(TimeoutError, match="expired"):
        STEPS[form](plan, Ready(), requests, bound)()
    assert plan.expired == [(requests, bound, 0.25)]
