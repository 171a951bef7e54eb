"""The k-nomial allreduce and the k-nomial phases, through the verifier (no MPI)."""

import pytest

from mpiallreduce import ScheduleError
from mpiallreduce.algorithms import REGISTRY, build
from mpiallreduce.algorithms.knomial import RADIX
from mpiallreduce.algorithms.phases import knomial_bcast, knomial_rounds
from mpiallreduce.schedule import COPY, LOCAL_FIRST, REDUCE, Recv, Schedule, Send, step
from mpiallreduce.verify import collective_states, verify


def awkward(p):
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 3, 97, 100_003})


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("p", range(1, 18))
def test_knomial_keeps_rank_order_for_small_p_and_awkward_counts(k, p):
    for count in awkward(p):
        verify(build("knomial", p, count, k=k), ordered=True)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_knomial_keeps_rank_order_for_every_p_up_to_64(k):
    for p in range(18, 65):
        for count in (1, p - 1, p + 1, 1009):
            verify(build("knomial", p, count, k=k), ordered=True)


def test_knomial_is_registered_as_order_keeping_with_its_default_radix():
    assert not REGISTRY["knomial"].commutative_only
    assert REGISTRY["knomial"].params == {"k": RADIX}
    assert build("knomial", 5, 10).ordered


def test_radix_two_is_the_binomial_tree():
    for p in (1, 2, 5, 8, 13):
        assert build("knomial", p, 7, k=2).ranks == build("tree", p, 7).ranks


@pytest.mark.parametrize("p, k, rounds", [(1, 2, 0), (2, 4, 1), (4, 4, 1), (5, 4, 2), (16, 4, 2),
                                          (17, 4, 3), (9, 3, 2), (10, 3, 3), (64, 2, 6)])
def test_rounds_are_ceil_log_k_p(p, k, rounds):
    assert knomial_rounds(p, k) == rounds
    if p > 1:
        assert build("knomial", p, 3, k=k).nsteps == 2 * rounds


def test_a_parent_reduces_its_children_in_one_step_in_rank_order():
    root = build("knomial", 9, 5, k=3).ranks[0]
    assert root[0] == step([], [Recv(1, 0, 5, REDUCE, LOCAL_FIRST), Recv(2, 0, 5, REDUCE, LOCAL_FIRST)])
    assert root[1] == step([], [Recv(3, 0, 5, REDUCE, LOCAL_FIRST), Recv(6, 0, 5, REDUCE, LOCAL_FIRST)])
    assert root[2] == step([Send(3, 0, 5), Send(6, 0, 5)])


@pytest.mark.parametrize("k", [0, 1, -3, 2.0, "4", True, None])
def test_bad_radix_is_a_value_error_that_says_what_is_valid(k):
    with pytest.raises(ValueError, match=r"integer radix k >= 2 \(2 is the binomial tree\), got k="):
        build("knomial", 4, 10, k=k)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("p", [1, 2, 5, 9, 16, 17])
def test_knomial_bcast_and_scatter_from_any_root(k, p):
    for root in sorted({0, p // 2, p - 1}):
        whole = lambda lo, hi, count=7: (0, count)  # noqa: E731
        ranks = tuple(tuple(knomial_bcast(r, p, root, whole, radix=k)) for r in range(p))
        verify(Schedule("bcast", p, 7, ranks), *collective_states("bcast", p, root))


def test_receives_may_share_a_range_only_when_both_reduce():
    two_reduces = (step([], [Recv(1, 0, 2, REDUCE, LOCAL_FIRST), Recv(2, 0, 2, REDUCE, LOCAL_FIRST)]),)
    sends = lambda: (step([Send(0, 0, 2)]),)  # noqa: E731
    verify(Schedule("ok", 3, 2, (two_reduces, sends(), sends())),
           expected=lambda rank, count: [(0, 2, (0, 1, 2) if rank == 0 else None)], ordered=True)
    copy_and_reduce = (step([], [Recv(1, 0, 2, REDUCE, LOCAL_FIRST), Recv(2, 0, 2, COPY)]),)
    with pytest.raises(ScheduleError, match=r"rank 0, step 0: receives into \[0, 2\) overlap "
                                            r"\[0, 2\) of the same step \(only reduces"):
        verify(Schedule("bad", 3, 2, (copy_and_reduce, sends(), sends())))
