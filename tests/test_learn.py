"""What learning times and how it is switched (serial: :mod:`mpiallreduce.select`'s part)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpiallreduce import algorithms, select
from mpiallreduce.ops import reducer


def _user_op():
    return MPI.Op.Create(lambda a, b, t: None, commute=False)


def test_the_switches_default_on_and_read_the_environment(monkeypatch):
    for name in (select.LEARN_ENV, select.LEARN_RUNS_ENV, select.RELEARN_ENV):
        monkeypatch.delenv(name, raising=False)
    assert select.learn_settings() == select.LearnSettings(True, select.LEARN_RUNS, 0)
    monkeypatch.setenv(select.LEARN_ENV, "off")
    assert select.learn_settings() == select.LearnSettings(False, select.LEARN_RUNS, 0)
    monkeypatch.setenv(select.LEARN_ENV, "ON")
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "2")
    monkeypatch.setenv(select.RELEARN_ENV, "1000")
    assert select.learn_settings() == select.LearnSettings(True, 2, 1000)


@pytest.mark.parametrize("name, value", [("MPIALLREDUCE_LEARN", "maybe"),
                                         ("MPIALLREDUCE_LEARN_RUNS", "0"),
                                         ("MPIALLREDUCE_LEARN_RUNS", "x"),
                                         ("MPIALLREDUCE_RELEARN_EVERY", "-1")])
def test_a_bad_switch_is_a_clear_error(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        select.learn_settings()


@pytest.mark.parametrize("runs", [1, 2, 3, 4, 5, 9])
def test_learning_fits_its_budget_of_calls(runs):
    from mpiallreduce import learn

    candidates, calls = learn.budget(runs)
    assert candidates >= 2 and calls == (
        candidates * 2 + select.LEARN_FINALISTS * (runs - 1) * 2
        if candidates > select.LEARN_FINALISTS else candidates * runs * 2)
    if runs * 2 * 2 <= select.LEARN_CALLS:  # two candidates fit: the budget holds
        assert calls <= select.LEARN_CALLS
    if runs == select.LEARN_RUNS:
        assert candidates == select.LEARN_CANDIDATES  # the defaults screen the most


def test_the_switches_change_the_digest_the_ranks_compare(monkeypatch):
    monkeypatch.setenv(select.TUNING_ENV, "off")
    monkeypatch.setenv(select.LEARN_ENV, "off")
    off = select.digest()
    monkeypatch.setenv(select.LEARN_ENV, "on")
    on = select.digest()
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "9")
    assert len({off, on, select.digest()}) == 3


@pytest.mark.parametrize("nranks", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("nbytes", [8, 1000, 65536, 8 << 20, 64 << 20])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("one_node", [False, True])
def test_candidates_start_with_the_rules_and_are_a_handful(nranks, nbytes, in_place, one_node):
    red = reducer(MPI.SUM, np.dtype(np.float64))
    ruled = select.choose(nranks, nbytes, red)
    names = select.learn_candidates(nranks, nbytes, red, in_place, one_node, ruled)
    assert names[0] == ruled and len(names) == len(set(names)) <= select.LEARN_CANDIDATES
    assert "native" in names
    assert ("shm" in names) == one_node or ruled == "shm"
    assert all(name in ("native", "shm") or name in algorithms.REGISTRY for name in names)
    # the same answer for the same arguments (every rank asks alike)
    assert names == select.learn_candidates(nranks, nbytes, red, in_place, one_node, ruled)


def test_non_commutative_ops_get_order_keeping_candidates_only():
    op = _user_op()
    try:
        red = reducer(op, np.dtype(np.float64))
        names = select.learn_candidates(4, 1 << 20, red, False, True, "native")
    finally:
        op.Free()
    assert not any(name in algorithms.REGISTRY and algorithms.REGISTRY[name].commutative_only
                   for name in names)


def test_saturating_native_sums_are_not_candidates():
    red = reducer(MPI.SUM, np.dtype(np.int8))
    names = select.learn_candidates(2, 64, red, False, False, "recursive_doubling", "int8")
    if select.native_deviates_for("SUM", "int8"):
        assert "native" not in names


def test_a_table_keeps_in_place_ranges_of_their_own():
    table = select.parse({"format": select.FORMAT, "provenance": {}, "tables": [{
        "nranks": 2, "classes": {
            "commutative": [{"min_bytes": 0, "max_bytes": None, "algorithm": "native"}],
            "commutative_in_place": [{"min_bytes": 0, "max_bytes": 4096, "algorithm": "shm"},
                                     {"min_bytes": 4096, "max_bytes": None,
                                      "algorithm": "ring"}]}}]})
    assert select.lookup(table, 2, 100, True) == "native"
    assert select.lookup(table, 2, 100, True, in_place=True) == "shm"
    assert select.lookup(table, 2, 1 << 20, True, in_place=True) == "ring"
    # no in-place ranges: the class's own hold in place too
    assert select.lookup(table, 2, 100, False, in_place=True) is None
    with pytest.raises(ValueError, match="reorders"):
        select.parse({"format": select.FORMAT, "provenance": {}, "tables": [{
            "nranks": 2, "classes": {"noncommutative_in_place": [
                {"min_bytes": 0, "max_bytes": None, "algorithm": "ring"}]}}]})


def test_each_candidate_is_timed_on_the_call_after_one_of_its_own():
    """A timed call follows an untimed call of the same candidate (its caches warm, as repeated
    calls run it), never straight after another candidate's; rounds interleave the candidates."""
    from mpiallreduce import learn

    record = learn.Record(("key",), ("shm", "native", "ring"), "shm", runs=2, relearn=0)
    sequence = []
    _drive(record, lambda name, index: {"shm": 1e-6, "native": 3e-6, "ring": 2e-6}[name],
           sequence)
    # the first round screens all three; the rules' choice and the fastest other go on
    assert sequence == [step for names in (("shm", "native", "ring"), ("shm", "ring"))
                        for name in names for step in [(name, False), (name, True)]]
    assert record.candidates == ["shm", "ring"] and set(record.screened) == {"shm", "native",
                                                                             "ring"}
    assert all(len(samples) == 2 for samples in record.samples.values())


def _drive(record, seconds, sequence=None) -> str:
    """Run ``record``'s learning as a Learner does (screening, then deciding, on one rank):
    ``seconds(name, index)`` is the candidate's time at its ``index``-th timed call."""
    seen: dict[str, int] = {}
    while True:
        name, timed = record.due()
        if sequence is not None:
            sequence.append((name, timed))
        record.ran(name, seconds(name, seen.get(name, 0)) if timed else 1.0, timed)
        seen[name] = seen.get(name, 0) + timed
        if record.calls >= record.total and record.screening:
            record.screen(MPI.COMM_SELF)
        elif record.calls >= record.total:
            return record.decide(MPI.COMM_SELF)


def _record(runs: int, one_node: bool = True):
    from mpiallreduce import learn

    key = (1 << 20, False, True, False, np.dtype(np.float64).str, None)
    return learn.Record(key, ("shm", "native", "ring"), "shm", runs=runs, relearn=0,
                        one_node=one_node)


def _learn(record, times: dict) -> str:
    """Feed ``times[name][round]`` as the timed calls, in the order the record asks."""
    return _drive(record, lambda name, index: times[name][index])


def test_learning_decides_by_the_one_rule_with_the_rules_choice_as_incumbent():
    """The medians of the rounds, judged by :func:`mpiallreduce.decide.decide`: a lead beyond
    the noise replaces the rules' choice; within it, the rules' choice stays and the record
    says so."""
    steady = [1e-5, 1.01e-5, 0.99e-5, 1e-5, 1.02e-5]
    record = _record(5)
    clear = {"shm": steady, "native": [2e-5] * 5, "ring": [t / 2 for t in steady]}
    assert _learn(record, clear) == "ring"
    report = record.report()
    assert report["decided"] is True and report["verdict"].startswith("ring beats shm by ")
    assert report["agreed_us"]["ring"] == pytest.approx(5.0)  # the median, in us
    record = _record(5)
    close = {"shm": steady, "native": [2e-5] * 5, "ring": [0.9e-5, 1.2e-5, 0.8e-5, 1.1e-5, 0.95e-5]}
    assert _learn(record, close) == "shm"
    assert record.report()["decided"] is False
    assert record.report()["verdict"].startswith("within noise: keeping shm (ring leads by")


def test_one_run_per_candidate_keeps_the_rules_choice():
    record = _record(1)
    assert _learn(record, {"shm": [1.0], "native": [0.1], "ring": [0.2]}) == "shm"
    assert record.verdict.reason == "too few rounds" and not record.verdict.decided
