"""What ``auto`` picks: a schedule only in the measured ranges, never an algorithm that refuses the op."""

import numpy as np
import pytest
from mpi4py import MPI

from mpiallreduce import algorithms
from mpiallreduce.ops import reducer
from mpiallreduce.select import LARGE_MESSAGE_BYTES, choose


def _noncommutative(inbuf, inoutbuf, datatype):
    pass


@pytest.mark.parametrize("nranks", [1, 2, 3, 8])
@pytest.mark.parametrize("nbytes", [0, 8, 1 << 20, LARGE_MESSAGE_BYTES - 1,
                                    LARGE_MESSAGE_BYTES, 1 << 31])
def test_auto_picks_the_pipelined_ring_above_the_crossover(nranks, nbytes):
    picked = choose(nranks, nbytes, reducer(MPI.SUM, np.dtype("float32")))
    # at 2 ranks the measured range of the pipelined ring starts lower, at 4 MiB (RULES)
    crossover = 4 << 20 if nranks == 2 else LARGE_MESSAGE_BYTES
    assert (picked == "ring_segmented") == (nranks > 1 and nbytes >= crossover), picked


# the measured ranges of select.RULES, written out: (ranks, bytes, pick)
PICKS = [(1, 64 << 10, "native"), (2, 8, "native"), (2, 8 << 10, "native"),
         (2, 16 << 10, "recursive_doubling"), (2, (128 << 10) - 1, "recursive_doubling"),
         (2, 128 << 10, "native"), (2, 2 << 20, "native"), (2, 4 << 20, "ring_segmented"),
         (3, 1 << 10, "native"), (3, 2 << 10, "knomial"), (4, 32 << 10, "knomial"),
         (5, (64 << 10) - 1, "knomial"), (5, 64 << 10, "native"), (6, 16 << 10, "native"),
         (8, 1 << 20, "native"), (8, 32 << 20, "ring_segmented")]


@pytest.mark.parametrize("nranks, nbytes, expected", PICKS)
def test_auto_picks_a_schedule_only_where_one_was_measured_faster(nranks, nbytes, expected):
    assert choose(nranks, nbytes, reducer(MPI.SUM, np.dtype("float64"))) == expected


def test_auto_never_picks_an_order_breaking_algorithm_for_a_non_commutative_op():
    op = MPI.Op.Create(_noncommutative, commute=False)
    try:
        red = reducer(op, np.dtype("int64"))
        for nranks in (2, 5, 16):
            for nbytes in (8, LARGE_MESSAGE_BYTES, 1 << 33):
                picked = choose(nranks, nbytes, red)
                assert picked == "native" or not algorithms.get(picked).commutative_only
    finally:
        op.Free()


def test_one_node_runs_shm_up_to_the_measured_sizes_at_two_ranks(monkeypatch):
    """At 2 ranks (not outnumbering the cores) the chunked large regime won below 16 MiB in
    both modes, in place up to 32 MiB (select.SHM_RULES, SHM_IN_PLACE_RULES); from 32 MiB
    neither mode runs it."""
    from mpiallreduce import select

    monkeypatch.setattr(select, "tables", lambda: {})
    monkeypatch.setattr(select.os, "cpu_count", lambda: 2)
    for nbytes in (8, 64 << 10, 8 << 20, (16 << 20) - 8):
        assert select.one_node_choice(2, nbytes, in_place=True) == "shm"
        assert select.one_node_choice(2, nbytes, in_place=False) == "shm"
    for nbytes in (16 << 20, (32 << 20) - 8):
        assert select.one_node_choice(2, nbytes, in_place=True) == "shm"
        assert select.one_node_choice(2, nbytes, in_place=False) is None
    for nbytes in (32 << 20, 1 << 30):
        assert select.one_node_choice(2, nbytes, in_place=True) is None
        assert select.one_node_choice(2, nbytes, in_place=False) is None
