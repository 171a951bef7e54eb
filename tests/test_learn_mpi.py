"""``auto`` learning on the machine at hand (:mod:`mpiallreduce.learn`), at every rank count.

Every case: results equal to ``comm.Allreduce`` on every rank (or an exact reference), the
same choice on every rank, calls with ``timeout=`` never timed, plans and repeated calls,
counts 0, 1, below p and large, call caches that differ between ranks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import (
    affine_compose,
    affine_maps,
    assert_matches_native,
    assert_on_every_rank,
    awkward_counts,
    contribution,
    repeat_auto,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _state, algorithms, learn, ops, select

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


@pytest.fixture(autouse=True)
def learning(monkeypatch):
    """Learning on, one timed run per candidate (the tests count calls, not time), at every
    size (the calls of small cases are otherwise too short to learn)."""
    monkeypatch.setenv(select.LEARN_ENV, "on")
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "1")
    monkeypatch.delenv(select.RELEARN_ENV, raising=False)
    monkeypatch.setattr(select, "LEARN_MIN_SECONDS", 0.0)
    monkeypatch.setattr(select, "LEARN_MIN_BYTES", 0)
    monkeypatch.setattr(select, "LEARN_FLOOR_BYTES", 0)


def _records(comm) -> list[learn.Record]:
    state = _state.existing(comm)
    return [] if state is None else list(learn.records(state).values())


def _enough(comm) -> int:
    """Calls that finish learning any case (candidates x 2 calls x 1 run), and some more."""
    return select.LEARN_CANDIDATES * 2 + 3


def _same_choices(comm) -> None:
    mine = sorted((r.key[:5], r.winner, tuple(r.candidates), r.learning_calls)
                  for r in _records(comm))
    assert_on_every_rank(comm, None if len(set(map(repr, comm.allgather(mine)))) == 1
                         else f"rank {comm.rank}: choices differ across ranks: {mine}")


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("count_of", ["0", "1", "p-1", "large"])
def test_repeated_calls_learn_and_stay_correct(comm, in_place, count_of):
    p = comm.size
    count = {"0": 0, "1": 1, "p-1": max(p - 1, 1), "large": 100_003}[count_of]
    for call in range(_enough(comm)):
        x = contribution(comm, count, "float64", seed=call)
        out = np.empty_like(x)
        buf = x.copy()
        for _ in range(2):  # the same arrays again: the call cache's entry
            if in_place:
                buf[:] = x
                result = mar.allreduce(MPI.IN_PLACE, buf, comm=comm)
            else:
                result = mar.allreduce(x, out, comm=comm)
            assert_matches_native(comm, x, result, MPI.SUM)
    records = _records(comm)
    if p == 1 or count == 0:
        assert records == []  # nothing to learn: one rank, or nothing to reduce
        return
    (record,) = records
    assert record.winner in record.candidates and record.rounds == 1
    assert record.learning_calls == len(record.candidates) * 2
    assert record.candidates[0] == record.ruled
    assert len(record.candidates) <= select.LEARN_CANDIDATES
    _same_choices(comm)


def test_the_same_arrays_bind_the_winner_after_learning(comm):
    """Once learned, the cached call is the winner's own plan (no learning plan in the path)."""
    x = contribution(comm, 1000, "float64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)
    if comm.size == 1:
        return
    entries = list(_state.existing(comm).calls.entries.values())
    assert entries and not any(isinstance(e.plan, learn.Learner) for e in entries)
    (record,) = _records(comm)
    assert entries[-1].plan.algorithm == record.winner
    _same_choices(comm)


def test_a_plan_learns_in_its_runs_then_runs_the_winner(comm):
    x = contribution(comm, 4099, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm) as plan:
        for round_ in range(_enough(comm)):
            x[:] = contribution(comm, 4099, "float64", seed=round_)
            plan.run()
            assert_matches_native(comm, x, out, MPI.SUM)
        if comm.size > 1:
            assert isinstance(plan, learn.Learner) and plan.algorithm == plan.record.winner
            assert_on_every_rank(comm, None if len(set(comm.allgather(plan.algorithm))) == 1
                                 else "plans chose differently")
        request = plan.start()  # the winner's own start and wait
        request.wait()
        assert_matches_native(comm, x, out, MPI.SUM)


def test_calls_with_a_timeout_are_never_timed(comm):
    x = contribution(comm, 300, "float64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm, timeout=30)
        assert_matches_native(comm, x, out, MPI.SUM)
    assert all(r.learning_calls == 0 and r.winner is None for r in _records(comm))
    # mixed: timed calls learn, calls with a timeout in between run the rules' or the winner
    for call in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm, timeout=30 if call % 2 else None)
        assert_matches_native(comm, x, out, MPI.SUM)
    _same_choices(comm)


def test_a_plan_with_a_default_timeout_never_learns(comm):
    x = contribution(comm, 200, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, timeout=30) as plan:
        for _ in range(_enough(comm)):
            plan.run()
            assert_matches_native(comm, x, out, MPI.SUM)
    assert all(r.learning_calls == 0 and r.winner is None for r in _records(comm))


def test_call_caches_that_differ_between_ranks_still_agree(comm):
    """Rank 0 keeps no call (every call binds afresh), the others keep theirs: the case's count
    of calls, not the cache, says which candidate runs, so every rank runs the same one."""
    state = _state.state(comm)
    if comm.rank == 0:
        state.calls.max_entries = 0
    a, b = contribution(comm, 777, "float64"), contribution(comm, 700, "float64", seed=1)
    out_a, out_b = np.empty_like(a), np.empty_like(b)
    for _ in range(_enough(comm)):  # two arrays of one case, alternating
        mar.allreduce(a, out_a, comm=comm)
        mar.allreduce(b, out_b, comm=comm)
        assert_matches_native(comm, a, out_a, MPI.SUM)
        assert_matches_native(comm, b, out_b, MPI.SUM)
    _same_choices(comm)


def test_a_non_commutative_op_learns_among_order_keeping_algorithms(comm):
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        x = affine_maps(comm, 5 * comm.size + 1)
        out = np.empty_like(x)
        for _ in range(_enough(comm)):
            mar.allreduce(x, out, op=op, comm=comm)
            assert_matches_native(comm, x, out, op)  # MPI keeps rank order too
    finally:
        op.Free()
    for record in _records(comm):
        assert not any(name in algorithms.REGISTRY and algorithms.REGISTRY[name].commutative_only
                       for name in record.candidates)
    _same_choices(comm)


def test_8_bit_sums_never_learn_a_saturating_native(comm):
    x = np.full(64, 100, dtype=np.int8)
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
        expected = (np.int64(100) * comm.size + 128) % 256 - 128  # C's modular sum
        problem = None if (out == expected).all() else f"rank {comm.rank}: {out[:4]}"
        assert_on_every_rank(comm, problem, out)
    if ops.native_deviates("SUM", np.dtype(np.int8)):
        assert all("native" not in r.candidates for r in _records(comm))


def test_relearning_times_the_case_again(comm, monkeypatch):
    monkeypatch.setenv(select.RELEARN_ENV, "3")
    x = contribution(comm, 64, "float64")
    out = np.empty_like(x)
    for _ in range(3 * _enough(comm)):
        mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)
    if comm.size > 1:
        (record,) = _records(comm)
        assert record.rounds >= 2
    _same_choices(comm)


@pytest.mark.parametrize("count", [1, 5, 1000])
def test_awkward_counts_and_learned_report(comm, count):
    if count not in awkward_counts(comm.size) and count != 5:
        pytest.skip("not awkward here")
    x = contribution(comm, count, "int64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)
    for row in learn.learned(comm):
        assert row["winner"] in row["candidates"] and row["learning_calls"] > 0


def test_save_writes_a_table_auto_reads(comm, tmp_path_factory, monkeypatch):
    x = contribution(comm, 512, "float64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
        mar.allreduce(MPI.IN_PLACE, out, comm=comm)
    path = comm.bcast(str(tmp_path_factory.mktemp("learned") / "tuning.json")
                      if comm.rank == 0 else None)
    learn.save(comm, path)
    if comm.size == 1:
        return
    with open(path, encoding="utf-8") as file:
        table = select.parse(json.load(file))
    winners = {r.key[1]: r.winner for r in _records(comm)}
    assert select.lookup(table, comm.size, 4096, True, False) == winners[False]
    assert select.lookup(table, comm.size, 4096, True, True) == winners[True]


@pytest.mark.parametrize("in_place", [False, True])
def test_learning_is_on_by_default_and_decides_within_its_budget(comm, monkeypatch, in_place):
    """Nothing set: a repeated call learns at the default runs, within LEARN_CALLS calls of its
    case, and every later call runs the pick; a case called once names no candidates; a case
    of calls too short to repay learning keeps the rules' choice, unmeasured."""
    monkeypatch.undo()  # the defaults, thresholds included (then no switch set at all)
    for name in (select.LEARN_ENV, select.LEARN_RUNS_ENV, select.RELEARN_ENV):
        monkeypatch.delenv(name, raising=False)
    once = contribution(comm, 20_000, "float64")  # 160 KB: a case called once
    mar.allreduce(once, np.empty_like(once), comm=comm)
    # 800 B: too short by its size; 80 KB: too short by the model's prediction (or, where it
    # cannot predict, by its size); 560 KB: long enough, at any rank count
    for count in (100, 10_000, 70_000):
        repeat_auto(comm, count, in_place, select.LEARN_CALLS + 5)
    if comm.size == 1:
        assert _records(comm) == []
        return
    by_size = {r.key[0]: r for r in _records(comm)}
    single = by_size[131072]  # its one call ran the rules' choice, nothing ranked
    assert single.winner is None and single.candidates == [single.ruled]
    assert single.seen and single.learning_calls == 0
    for bucket, seen in ((512, False), (65536, True)):
        # settled at the first call (by size) or the second (by the model): the rules' choice
        short = by_size[bucket]
        assert short.winner == short.ruled and short.learning_calls == 0, bucket
        assert short.verdict.reason == "too short to learn" and not short.verdict.decided
        assert short.seen is seen
        assert not select.learning_pays(comm.size, bucket, short.ruled, "<f8", in_place)
    assert not any(isinstance(e.plan, learn.Learner) and e.plan.recvbuf.size in (100, 10_000)
                   for e in _state.existing(comm).calls.entries.values())
    record = by_size[524288]  # 70,000 doubles: the bucket of 560,000 bytes
    assert select.learning_pays(comm.size, 560_000, record.ruled, "<f8", in_place)
    assert record.winner is not None and record.rounds == 1
    screened = len(record.screened) or len(record.candidates)
    if record.screened:  # a first round over more, then the finalists' other rounds
        assert record.ruled in record.candidates and set(record.candidates) <= set(record.screened)
        assert len(record.candidates) == min(select.LEARN_FINALISTS, screened)
        assert record.learning_calls == 2 * screened \
            + len(record.candidates) * (select.LEARN_RUNS - 1) * 2
    else:
        assert record.learning_calls == len(record.candidates) * select.LEARN_RUNS * 2
    assert all(len(times) == select.LEARN_RUNS for times in record.samples.values())
    assert len(record.candidates) >= 2 and record.learning_calls <= select.LEARN_CALLS
    assert record.learning_calls <= learn.calls_to_decide()
    # the finalists were the fastest of the first round, the rules' choice kept whatever it ran
    if record.screened:
        dropped = set(record.screened) - set(record.candidates)
        slowest_kept = max(record.screened[name] for name in record.candidates
                           if name != record.ruled)
        assert all(record.screened[name] >= slowest_kept for name in dropped)
    _same_choices(comm)


def test_learning_off_runs_the_rules_choice(comm, monkeypatch):
    monkeypatch.setenv(select.LEARN_ENV, "off")
    x = contribution(comm, 64, "float64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)
    assert _records(comm) == []
    assert learn.calls_to_decide() == 0


def test_reproducible_calls_never_learn(comm):
    x = contribution(comm, 1000, "float64")
    out = np.empty_like(x)
    reference = None
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm, reproducible=True)
        if reference is None:
            reference = out.copy()
        np.testing.assert_array_equal(out, reference)  # the same bits at every call
    assert _records(comm) == []


def test_one_run_per_candidate_keeps_the_rules_choice_and_says_within_noise(comm):
    """One timed run measures no spread: every rank keeps the rules' choice, and the record
    says "within noise"."""
    x = contribution(comm, 1000, "float64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)
    for row in learn.learned(comm):
        assert row["winner"] == row["ruled"] and row["decided"] is False
        assert row["verdict"].startswith(f"within noise: keeping {row['ruled']}")
    _same_choices(comm)


def test_rounds_agreed_before_deciding_give_one_verdict_on_every_rank(comm, monkeypatch):
    monkeypatch.setenv(select.LEARN_RUNS_ENV, "3")
    x = contribution(comm, 4096, "float64")
    out = np.empty_like(x)
    for _ in range(3 * _enough(comm)):
        mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)
    rows = [(r["winner"], r["decided"], r["verdict"], r["agreed_us"]) for r in learn.learned(comm)]
    assert_on_every_rank(comm, None if len(set(map(repr, comm.allgather(rows)))) == 1
                         else f"rank {comm.rank}: verdicts differ across ranks: {rows}")
    if comm.size > 1:
        assert rows and all(winner is not None for winner, *_ in rows)


def test_one_node_never_times_the_multi_node_algorithms(comm):
    from mpiallreduce.topology import Topology

    one_node = Topology.from_comm(comm).nnodes == 1
    x = contribution(comm, 1 << 16, "float64")
    out = np.empty_like(x)
    for _ in range(_enough(comm)):
        mar.allreduce(x, out, comm=comm)
    for record in _records(comm):
        assert record.one_node == one_node
        if one_node:
            assert not {"hierarchical", "cascade"} & set(record.candidates), record.candidates
