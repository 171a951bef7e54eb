"""What ``auto`` picks: native below the measured crossover, never an algorithm that refuses the op."""

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
def test_auto_picks_native_below_the_crossover_and_the_pipelined_ring_above(nranks, nbytes):
    picked = choose(nranks, nbytes, reducer(MPI.SUM, np.dtype("float32")))
    large = nranks > 1 and nbytes >= LARGE_MESSAGE_BYTES
    assert picked == ("ring_segmented" if large else "native")


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
