"""The verifier accepts correct schedules for every p and count, and rejects broken ones."""

import dataclasses

import pytest

from mpiallreduce import ScheduleError
from mpiallreduce.algorithms import REGISTRY, build
from mpiallreduce.schedule import COPY, LOCAL_FIRST, REDUCE, Recv, Schedule, Send, step
from mpiallreduce.verify import verify


def awkward(p):
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 3, 97, 100_003})


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("p", range(1, 18))
def test_every_algorithm_is_correct_for_small_p_and_awkward_counts(name, p):
    for count in awkward(p):
        verify(build(name, p, count))


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("p", [24, 31, 32, 33, 48, 63, 64])
def test_every_algorithm_is_correct_up_to_64_ranks(name, p):
    for count in (1, p - 1, p + 1, 1009):
        verify(build(name, p, count))


def test_ring_for_every_p_up_to_64_at_a_count_below_p_and_one_not_divisible():
    for p in range(1, 65):
        verify(build("ring", p, max(p // 2, 1)))
        verify(build("ring", p, 3 * p + 1))


def _replace_step(schedule, rank, index, new_step):
    ranks = [list(steps) for steps in schedule.ranks]
    ranks[rank][index] = new_step
    return dataclasses.replace(schedule, ranks=tuple(tuple(s) for s in ranks))


def test_rejects_a_missing_receive():
    schedule = build("ring", 4, 8)
    broken = _replace_step(schedule, 2, 1, step(schedule.ranks[2][1].sends, []))
    with pytest.raises(ScheduleError, match=r"rank 1, step 1: send of \[\d+, \d+\) to rank 2 "
                                            r"has no matching receive"):
        verify(broken)


def test_rejects_a_missing_send():
    schedule = build("ring", 4, 8)
    broken = _replace_step(schedule, 0, 0, step([], schedule.ranks[0][0].recvs))
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: receive into .* from rank 0 has "
                                            r"no matching send"):
        verify(broken)


def test_rejects_a_size_mismatch():
    schedule = build("ring", 3, 9)
    send = schedule.ranks[0][0].sends[0]
    bigger = Send(send.peer, send.start, send.stop - 1)
    broken = _replace_step(schedule, 0, 0, step([bigger], schedule.ranks[0][0].recvs))
    with pytest.raises(ScheduleError, match="rank 0, step 0: sends 2 elements to rank 1, "
                                            "which receives 3"):
        verify(broken)


def test_rejects_a_doubled_contribution():
    # Two ranks exchange and reduce, then rank 1 reduces rank 0's (already combined) data again.
    steps0 = (step([Send(1, 0, 4)], [Recv(1, 0, 4, REDUCE)]), step([Send(1, 0, 4)], []))
    steps1 = (step([Send(0, 0, 4)], [Recv(0, 0, 4, REDUCE)]), step([], [Recv(0, 0, 4, REDUCE)]))
    with pytest.raises(ScheduleError, match=r"rank 1, step 1: .*doubled"):
        verify(Schedule("bad", 2, 4, (steps0, steps1)))


def test_rejects_a_missing_contribution():
    # Rank 1 copies rank 0's data instead of reducing: rank 1's contribution is lost.
    steps0 = (step([Send(1, 0, 4)], [Recv(1, 0, 4, COPY)]),)
    steps1 = (step([Send(0, 0, 4)], [Recv(0, 0, 4, COPY)]),)
    with pytest.raises(ScheduleError, match=r"rank 0, end: range \[0, 4\) holds ranks \(1,\), "
                                            r"expected all of 0..1"):
        verify(Schedule("bad", 2, 4, (steps0, steps1)))


def test_rejects_broken_rank_order_when_order_matters():
    # Rank 1 computes x1 ∘ x0 instead of x0 ∘ x1.
    steps0 = (step([Send(1, 0, 2)], [Recv(1, 0, 2, REDUCE, LOCAL_FIRST)]),)
    steps1 = (step([Send(0, 0, 2)], [Recv(0, 0, 2, REDUCE, LOCAL_FIRST)]),)
    schedule = Schedule("bad", 2, 2, (steps0, steps1), ordered=True)
    with pytest.raises(ScheduleError, match="rank 1, step 0: .*breaks MPI's rank order"):
        verify(schedule)
    verify(schedule, ordered=False)  # fine for a commutative op


def test_rejects_out_of_range_and_bad_peers():
    with pytest.raises(ScheduleError, match="outside"):
        verify(Schedule("bad", 2, 4, ((step([Send(1, 0, 5)]),), (step([], [Recv(0, 0, 5)]),))))
    with pytest.raises(ScheduleError, match="invalid peer 2"):
        verify(Schedule("bad", 2, 4, ((step([Send(2, 0, 1)]),), ())))


def test_ring_refuses_rank_order():
    with pytest.raises(ScheduleError, match="rank order"):
        verify(build("ring", 4, 8), ordered=True)
