"""The verifier accepts correct schedules for every p and count, and rejects broken ones."""

import dataclasses

import pytest

from mpiallreduce import ScheduleError
from mpiallreduce.algorithms import COLLECTIVES, REGISTRY, build
from mpiallreduce.algorithms.phases import owned_slots
from mpiallreduce.algorithms.ring import ring_reduce_scatter
from mpiallreduce.executor import _scratch_plan, scratch_size
from mpiallreduce.schedule import COPY, LOCAL_FIRST, REDUCE, Recv, Schedule, Send, step
from mpiallreduce.verify import collective_states, verify


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


@pytest.mark.parametrize("p", range(1, 18))
@pytest.mark.parametrize("segment", [1, 3, 16])
def test_ring_segmented_with_many_segments(p, segment):
    # segment elements of 8 bytes: small counts get several segments per ring block
    for count in (0, 1, max(p - 1, 0), p, p + 1, 2 * p + 3, 97, 16 * p + 5):
        verify(build("ring_segmented", p, count, segment_bytes=8 * segment))


def test_ring_segmented_cuts_blocks_into_segments():
    one = build("ring_segmented", 4, 1000, segment_bytes=8 * 1000)
    many = build("ring_segmented", 4, 1000, segment_bytes=8 * 10)
    assert one.nsteps == build("ring", 4, 1000).nsteps == 6
    assert many.nsteps == 3 * 25 + 3  # 250-element blocks in 25 segments, then the allgather
    assert max(r.size for steps in many.ranks for s in steps for r in s.recvs if r.action == REDUCE) == 10
    with pytest.raises(ScheduleError, match="rank order"):
        verify(many, ordered=True)


def test_executor_defers_combines_only_where_the_next_step_leaves_them_alone():
    need, defer = _scratch_plan(build("ring_segmented", 4, 1000, segment_bytes=80).ranks[0])
    assert need == 10 and defer[:74] == [True] * 74 and not any(defer[74:])
    assert scratch_size(build("ring_segmented", 4, 1000, segment_bytes=80).ranks[0]) == 20
    for name in ("ring", "tree", "recursive_doubling", "rabenseifner"):
        steps = build(name, 5, 1000).ranks[1]
        assert not any(_scratch_plan(steps)[1])
        assert scratch_size(steps) == _scratch_plan(steps)[0]


@pytest.mark.parametrize("name", ["tree", "recursive_doubling", "rabenseifner"])
def test_order_keeping_algorithms_keep_rank_order(name):
    assert not REGISTRY[name].commutative_only
    for p in (3, 6, 8, 13):
        assert build(name, p, 2 * p + 1).ordered
        verify(build(name, p, 2 * p + 1), ordered=True)


def test_rabenseifner_distance_doubling_owns_bit_reversed_slots():
    assert [owned_slots(v, 8, keep_order=True)[0] for v in range(8)] == [0, 4, 2, 6, 1, 5, 3, 7]
    assert [owned_slots(v, 8, keep_order=False)[0] for v in range(8)] == list(range(8))


def test_rabenseifner_and_recursive_doubling_step_counts():
    assert build("recursive_doubling", 8, 10).nsteps == 3
    assert build("recursive_doubling", 6, 10).nsteps == 2 + 2  # fold in, lg 4, fold out
    assert build("rabenseifner", 8, 10).nsteps == 6
    assert build("rabenseifner", 12, 10).nsteps == 2 * 3 + 2
    assert build("tree", 5, 10).nsteps == 6


def _collective_cases():
    for collective, registry in COLLECTIVES.items():
        if collective != "allreduce":
            for name in registry:
                yield collective, name


@pytest.mark.parametrize("collective, name", list(_collective_cases()))
@pytest.mark.parametrize("p", [*range(1, 18), 31, 32, 33, 64])
def test_every_related_collective_is_correct(collective, name, p):
    counts = awkward(p) if p <= 17 else (1, p - 1, p + 1, 1009)
    roots = [0]
    if collective == "bcast":
        roots = sorted({0, 1 % p, p // 2, p - 1}) if p <= 17 else [p - 1]
    for count in counts:
        for root in roots:
            params = {"root": root} if collective == "bcast" else {}
            space = 2 * p * count if collective == "alltoall" else count  # send then receive
            verify(build(name, p, space, collective=collective, **params),
                   *collective_states(collective, p, root))


def test_reduce_scatter_check_catches_the_wrong_owner():
    # The allreduce ring's reduce-scatter leaves block r+1 on rank r, not MPI's block r.
    schedule = Schedule("rs", 4, 12, tuple(tuple(ring_reduce_scatter(r, 4, 12)) for r in range(4)))
    verify(schedule, expected=lambda rank, count: [])
    with pytest.raises(ScheduleError, match=r"rank 0, end: range \[0, 3\) holds ranks \(0,\)"):
        verify(schedule, *collective_states("reduce_scatter", 4))


def test_alltoall_check_catches_a_misplaced_block():
    schedule = build("pairwise", 3, 18, collective="alltoall")
    swapped = [list(steps) for steps in schedule.ranks]
    first = swapped[0][0]
    recv = first.recvs[0]
    swapped[0][0] = step(first.sends, [Recv(recv.peer, 9, 12)])  # lands in rank 0's own block
    broken = dataclasses.replace(schedule, ranks=tuple(tuple(s) for s in swapped))
    with pytest.raises(ScheduleError, match="rank 0, end"):
        verify(broken, *collective_states("alltoall", 3))
