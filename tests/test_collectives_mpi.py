"""reduce_scatter, allgather, bcast and alltoall against MPI's own collectives, on every rank.
Run under mpirun with --with-mpi."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    affine_compose,
    affine_maps,
    assert_identical_across_ranks,
    assert_on_every_rank,
    awkward_counts,
    contribution,
    mismatch,
    reduction_bound,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.api import COLLECTIVE_ALGORITHMS
from mpiallreduce.partition import block, block_counts

pytestmark = pytest.mark.mpi

OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX, "BXOR": MPI.BXOR}


def _schedules_and_native(collective):
    # "auto" is "native" for these collectives (test_reduce_scatter_average_and_user_ops runs it)
    return [name for name in COLLECTIVE_ALGORITHMS[collective] if name != "auto"]


def _counts(comm):
    return [c for c in awkward_counts(comm.size) if c < 100_000] + [20_011]


@pytest.mark.parametrize("algorithm", _schedules_and_native("reduce_scatter"))
@pytest.mark.parametrize("op_name, dtype", [("SUM", "float64"), ("PROD", "complex64"),
                                            ("MAX", "int16"), ("BXOR", "uint8")])
def test_reduce_scatter_matches_native(comm, algorithm, op_name, dtype):
    for count in _counts(comm):
        x = contribution(comm, count, dtype, op_name)
        counts = block_counts(count, comm.size)
        ref = np.empty(counts[comm.rank], dtype=x.dtype)
        comm.Reduce_scatter(x, ref, counts, op=OPS[op_name])
        out = mar.reduce_scatter(x, op=OPS[op_name], comm=comm, algorithm=algorithm)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        # the dtype-derived bound of any summation order (exact for integers), on this rank's
        # block; every rank gathers every rank's verdict before asserting
        bound = reduction_bound(comm, x, OPS[op_name])
        lo, hi = block(count, comm.size, comm.rank)
        problem = mismatch(comm, out, ref, None if bound is None else bound[lo:hi])
        given = np.empty_like(ref)
        assert mar.reduce_scatter(x, given, op=OPS[op_name], comm=comm,
                                  algorithm=algorithm) is given
        problem = problem or mismatch(comm, given, out, None)
        # the blocks are disjoint, so ranks agree when the assembled vector is the same on all
        whole = np.empty(count, dtype=out.dtype)
        comm.Allgatherv(out, [whole, counts])
        assert_on_every_rank(comm, problem, whole)


def test_reduce_scatter_average_and_user_ops():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 1001, "float64")
    counts = block_counts(1001, comm.size)
    ref = np.empty(counts[comm.rank])
    comm.Reduce_scatter(x, ref, counts)
    bound = reduction_bound(comm, x, MPI.SUM, average=True)
    lo, hi = block(1001, comm.size, comm.rank)
    for algorithm in COLLECTIVE_ALGORITHMS["reduce_scatter"]:
        out = mar.reduce_scatter(x, op=mar.AVG, comm=comm, algorithm=algorithm)
        assert_on_every_rank(comm, mismatch(comm, out, ref / comm.size, bound[lo:hi]))
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        y = affine_maps(comm, 101)
        counts = block_counts(101, comm.size)
        ref = np.empty(counts[comm.rank], dtype=y.dtype)
        comm.Reduce_scatter(y, ref, counts, op=op)
        assert np.array_equal(mar.reduce_scatter(y, op=op, comm=comm, algorithm="native"), ref)
        for algorithm in ("ring", "recursive_halving"):
            with pytest.raises(ValueError, match="non-commutative op use one of native"):
                mar.reduce_scatter(y, op=op, comm=comm, algorithm=algorithm)
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", _schedules_and_native("allgather"))
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("dtype", ["float32", "bool"])
def test_allgather_matches_native(comm, algorithm, in_place, dtype):
    for count in _counts(comm):
        full = contribution(comm, count, dtype, seed=1)
        counts = block_counts(count, comm.size)
        lo, hi = block(count, comm.size, comm.rank)
        mine = contribution(comm, counts[comm.rank], dtype)
        ref = np.empty(count, dtype=mine.dtype)
        comm.Allgatherv(mine, [ref, counts])
        if in_place:
            out = full.copy()
            out[lo:hi] = mine
            result = mar.allgather(MPI.IN_PLACE, out, comm=comm, algorithm=algorithm)
        else:
            out = np.zeros(count, dtype=mine.dtype)
            result = mar.allgather(mine, out, comm=comm, algorithm=algorithm)
        assert result is out
        assert_on_every_rank(comm, mismatch(comm, out, ref, None), out)


@pytest.mark.parametrize("algorithm", _schedules_and_native("bcast"))
@pytest.mark.parametrize("dtype", ["float64", "uint16"])
def test_bcast_matches_native_from_several_roots(comm, algorithm, dtype):
    for count in _counts(comm):
        for root in sorted({0, 1 % comm.size, comm.size - 1}):
            x = contribution(comm, count, dtype)
            ref = x.copy()
            comm.Bcast(ref, root=root)
            buf = x.copy()
            assert mar.bcast(buf, root, comm=comm, algorithm=algorithm) is buf
            assert_on_every_rank(comm, mismatch(comm, buf, ref, None), buf)


@pytest.mark.parametrize("algorithm", _schedules_and_native("alltoall"))
@pytest.mark.parametrize("dtype", ["float64", "int8"])
def test_alltoall_matches_native(comm, algorithm, dtype):
    for per_rank in (0, 1, 3, 97, 2001):
        x = contribution(comm, per_rank * comm.size, dtype)
        ref = np.empty_like(x)
        comm.Alltoall(x, ref)
        out = mar.alltoall(x, comm=comm, algorithm=algorithm)
        assert np.array_equal(out, ref)
        given = np.empty_like(x).reshape(comm.size, -1) if per_rank else np.empty_like(x)
        assert mar.alltoall(x.reshape(given.shape), given, comm=comm,
                            algorithm=algorithm) is given
        assert np.array_equal(given.reshape(-1), ref)


def test_results_are_identical_across_ranks_for_the_schedules():
    comm = MPI.COMM_WORLD
    full = np.empty(999)
    mar.allgather(contribution(comm, block_counts(999, comm.size)[comm.rank], "float64"), full,
                  comm=comm, algorithm="recursive_doubling")
    assert_identical_across_ranks(comm, full)
    buf = contribution(comm, 999, "float64")
    mar.bcast(buf, comm.size - 1, comm=comm, algorithm="scatter_allgather")
    assert_identical_across_ranks(comm, buf)


def test_bad_input_raises_before_any_message():
    comm = MPI.COMM_WORLD
    p = comm.size
    with pytest.raises(ValueError, match="root must be a rank"):
        mar.bcast(np.zeros(4), root=p, comm=comm)
    with pytest.raises(ValueError, match="needs recvbuf"):
        mar.allgather(np.zeros(1), None, comm=comm)
    with pytest.raises(ValueError, match="sendbuf has 2 elements"):
        mar.allgather(np.zeros(2), np.zeros(p), comm=comm)
    with pytest.raises(ValueError, match="recvbuf has 6 elements; block"):
        mar.reduce_scatter(np.zeros(7 * p), np.zeros(6), comm=comm)
    with pytest.raises(ValueError, match="unknown allgather algorithm 'tree'"):
        mar.allgather(np.zeros(1), np.zeros(p), comm=comm, algorithm="tree")
    with pytest.raises(ValueError, match="IN_PLACE"):
        mar.reduce_scatter(MPI.IN_PLACE, np.zeros(p), comm=comm)
    with pytest.raises(TypeError, match="dtype"):
        mar.alltoall(np.zeros(p), np.zeros(p, dtype=np.int32), comm=comm)


@pytest.mark.mpi(min_size=2)
def test_mismatches_between_ranks_raise_on_every_rank():
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError, match="multiple of"):
        mar.alltoall(np.zeros(comm.size + 1), comm=comm, algorithm="pairwise")
    with pytest.raises(ValueError, match="root differs"):
        mar.bcast(np.zeros(4), root=comm.rank, comm=comm, algorithm="binomial")
    with pytest.raises(ValueError, match="algorithm differs"):
        mar.bcast(np.zeros(4), comm=comm,
                  algorithm="binomial" if comm.rank else "scatter_allgather")
