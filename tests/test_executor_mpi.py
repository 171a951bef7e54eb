"""The executor's data movement: out of place it never copies sendbuf first and never writes it;
segments of one element; run() allocates nothing. Results against comm.Allreduce on every rank."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import affine_compose, affine_maps, assert_matches_native, awkward_counts, contribution
from mpi4py import MPI

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

SCHEDULES = [name for name in mar.ALGORITHMS if name not in ("native", "auto")]
RUNS = 200


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_out_of_place_leaves_sendbuf_alone_at_awkward_counts(algorithm):
    comm = MPI.COMM_WORLD
    for count in awkward_counts(comm.size):
        x = contribution(comm, count, "float64", seed=count)
        original = x.copy()
        x.flags.writeable = False  # any write into sendbuf would raise
        out = np.full_like(x, np.nan)  # a range the plan forgot would stay NaN
        with mar.plan(x, out, comm=comm, algorithm=algorithm) as p:
            for _ in range(2):
                p.run()
                assert_matches_native(comm, x, out, MPI.SUM)
        assert np.array_equal(x, original)


@pytest.mark.parametrize("algorithm", ["ring_segmented"])
@pytest.mark.parametrize("in_place", [False, True])
def test_segments_of_one_element(algorithm, in_place):
    comm = MPI.COMM_WORLD
    for count in (1, comm.size + 1, 3 * comm.size + 2):
        x = contribution(comm, count, "int64", seed=count)
        if in_place:
            out = x.copy()
            mar.allreduce(MPI.IN_PLACE, out, comm=comm, algorithm=algorithm, segment_bytes=8)
        else:
            out = mar.allreduce(x, comm=comm, algorithm=algorithm, segment_bytes=8)
        assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", [a for a in SCHEDULES if a not in ("ring", "ring_segmented",
                                                                         "cascade")])
def test_out_of_place_with_a_non_commutative_op_keeps_rank_order(algorithm):
    """The first reduction of a range reads received ∘ sendbuf: the operand order must hold."""
    comm = MPI.COMM_WORLD
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        for count in (1, 5, 33):
            x = affine_maps(comm, count)
            out = mar.allreduce(x, comm=comm, op=op, algorithm=algorithm)
            assert_matches_native(comm, x, out, op)
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", SCHEDULES + ["native"])
@pytest.mark.parametrize("in_place", [False, True])
def test_run_allocates_nothing(algorithm, in_place):
    """Nothing a run allocates outlives it: RUNS runs leave the traced memory where it was."""
    comm = MPI.COMM_WORLD
    x = contribution(comm, 1000, "float64")
    out = x.copy()
    sendbuf = MPI.IN_PLACE if in_place else x
    with mar.plan(sendbuf, out, comm=comm, algorithm=algorithm) as p:
        tracemalloc.start()
        try:
            for _ in range(100):  # first calls fill NumPy's and CPython's caches and free lists
                p.run()
            before = tracemalloc.take_snapshot()
            for _ in range(RUNS):
                p.run()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename")
                if stat.size_diff > 0 and "mpiallreduce" in str(stat.traceback))
    # CPython's free lists may keep an object or two; a per-run allocation would keep RUNS
    assert grown < 8 * RUNS, [str(s) for s in after.compare_to(before, "lineno")[:5]]


@pytest.mark.parametrize("algorithm", SCHEDULES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("op_name", ["SUM", "MAX", "PROD"])
def test_combines_through_scratch_and_the_flat_run(algorithm, in_place, op_name):
    """Ranges a peer reads are combined into scratch then copied (results up to 1 MiB, see
    ops.SCRATCH_COMBINE): exact against native over runs whose inputs change, and the flat
    run() gives the same bits as the stepwise loop a deadline takes."""
    comm, op = MPI.COMM_WORLD, getattr(MPI, op_name)
    dtype = "int64" if op_name == "SUM" else "float64"
    for count in (511, 4096 * comm.size + 3, 40_000):
        base = contribution(comm, count, dtype, op_name, seed=count)
        x, out = base.copy(), np.empty_like(base)
        with mar.plan(MPI.IN_PLACE if in_place else x, out, op=op, comm=comm,
                      algorithm=algorithm) as p:
            for run in range(3):
                x[...] = base if op_name == "PROD" else base + run  # a stale range would show
                if in_place:
                    out[...] = x
                result = p.run() if run != 1 else p.run(timeout=60)
                assert_matches_native(comm, x, result, op)
                if run == 0:
                    flat = result.copy()
                if run == 1 and op_name == "PROD":
                    assert np.array_equal(flat, result)  # same inputs: flat and stepwise agree
