"""Every algorithm against MPI's own Allreduce, on every rank, across dtypes, ops, counts,
in-place or not, and communicator kinds. Run under mpirun with --with-mpi.

The grid runs the registered schedules: ``native`` appears once, as the sanity row of the
communicator-kind test (MPI against itself), and ``auto`` where it resolves to a schedule
(``test_auto_runs_the_schedule_it_picks``), not where it would only repeat native. Each case
notes whether it ran a schedule on more than one rank; the summary line "grid: N of M cases ran
a schedule" gives the count per run (none at -n 1, where every algorithm is a copy).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from conftest import (
    GRID_CASES,
    DLPackOnly,
    affine_compose,
    affine_maps,
    assert_identical_across_ranks,
    assert_matches_native,
    assert_on_every_rank,
    awkward_counts,
    contribution,
    mismatch,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import select

pytestmark = pytest.mark.mpi

#: the registered schedules; "native" runs once as a sanity row, "auto" where it picks a schedule
SCHEDULES = list(mar.algorithms.REGISTRY)


@pytest.fixture(autouse=True)
def _grid_case(request):
    """Enter this case in the grid count; :func:`_ran` marks it as having run a schedule."""
    GRID_CASES.setdefault(request.node.nodeid, False)
    yield


def _ran(comm, algorithm: str, count: int = 1) -> None:
    """Note that the current case ran ``algorithm`` on ``comm`` (a schedule if p > 1)."""
    if comm.size > 1 and count > 0 and algorithm in mar.algorithms.REGISTRY:
        GRID_CASES[os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]] = True
OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX, "LAND": MPI.LAND,
       "LOR": MPI.LOR, "LXOR": MPI.LXOR, "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float32", "float64"]
COMPLEX = ["complex64", "complex128"]
VALID = {"SUM": INTS + FLOATS + COMPLEX, "PROD": INTS + FLOATS + COMPLEX,
         "MIN": INTS + FLOATS, "MAX": INTS + FLOATS,
         "LAND": INTS + ["bool"], "LOR": INTS + ["bool"], "LXOR": INTS + ["bool"],
         "BAND": INTS, "BOR": INTS, "BXOR": INTS}
OP_DTYPE = [(op, dtype) for op, dtypes in VALID.items() for dtype in dtypes]


def _params(comm, x, algorithm):
    # Segments of about a quarter ring block, so the grid runs the pipelined path at every count
    # (the default 256 KiB would give one segment: the plain ring).
    if algorithm == "ring_segmented":
        return {"segment_bytes": max(x.itemsize, x.nbytes // (4 * comm.size))}
    # Simulated nodes, so the grid crosses "nodes" (from_comm would see one node here); nodes of
    # 3 leave a smaller last node at most sizes, which cascade handles with its extra ranks.
    if algorithm == "hierarchical":
        return {"topology": mar.Topology.simulated(comm, ranks_per_node=2)}
    if algorithm == "cascade":
        return {"topology": mar.Topology.simulated(comm, ranks_per_node=3)}
    return {}


def _run(comm, x, op, algorithm, in_place):
    params = _params(comm, x, algorithm)
    _ran(comm, algorithm, x.size)
    if in_place:
        buf = x.copy()
        out = mar.allreduce(MPI.IN_PLACE, buf, op=op, comm=comm, algorithm=algorithm, **params)
        assert out is buf
        return out
    out = mar.allreduce(x, None, op=op, comm=comm, algorithm=algorithm, **params)
    return out


@pytest.mark.parametrize("algorithm", SCHEDULES)
@pytest.mark.parametrize("op_name, dtype", OP_DTYPE)
def test_every_op_and_dtype(algorithm, op_name, dtype):
    comm = MPI.COMM_WORLD
    for count in (comm.size + 1, 1000):
        x = contribution(comm, count, dtype, op_name)
        out = _run(comm, x, OPS[op_name], algorithm, in_place=False)
        assert_matches_native(comm, x, out, OPS[op_name])


@pytest.mark.parametrize("algorithm", SCHEDULES + ["native"])  # native: the sanity row
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("dtype", ["float64", "int32", "complex64"])
def test_awkward_counts_on_every_communicator_kind(comm, algorithm, in_place, dtype):
    for count in awkward_counts(comm.size):
        x = contribution(comm, count, dtype)
        out = _run(comm, x, MPI.SUM, algorithm, in_place)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_multidimensional_buffers_keep_their_shape(algorithm):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 60, "float64").reshape(3, 4, 5)
    out = np.zeros_like(x)
    result = mar.allreduce(x, out, comm=comm, algorithm=algorithm)
    _ran(comm, algorithm)
    assert result is out and out.shape == (3, 4, 5)
    assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", SCHEDULES)
@pytest.mark.parametrize("dtype", FLOATS + COMPLEX)
def test_average(algorithm, dtype):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 1001, dtype)
    out = mar.allreduce(x, op=mar.AVG, comm=comm, algorithm=algorithm)
    _ran(comm, algorithm)
    assert_matches_native(comm, x, out, MPI.SUM, average=True)


def _maxabs(inbuf, inoutbuf, datatype):
    # a commutative user op: elementwise max of absolute values
    a = np.frombuffer(inbuf, dtype=np.float64)
    b = np.frombuffer(inoutbuf, dtype=np.float64)
    np.maximum(np.abs(a), np.abs(b), out=b)


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_commutative_user_op(algorithm):
    comm = MPI.COMM_WORLD
    op = MPI.Op.Create(_maxabs, commute=True)
    try:
        x = contribution(comm, 333, "float64")
        out = mar.allreduce(x, op=op, comm=comm, algorithm=algorithm)
        _ran(comm, algorithm)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref, op=op)
        assert_on_every_rank(comm, mismatch(comm, out, ref, None), out)
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_non_commutative_user_op_keeps_rank_order_or_is_refused(algorithm):
    comm = MPI.COMM_WORLD
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        needs_commutative = (algorithm not in ("native", "auto", "shm")
                             and mar.algorithms.get(algorithm).commutative_only)
        for count in sorted({1, comm.size + 1, 2 * comm.size - 1, 97, 1000}):
            x = affine_maps(comm, count)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref, op=op)
            if needs_commutative:
                keep = [name for name, a in mar.algorithms.REGISTRY.items()
                        if not a.commutative_only]
                with pytest.raises(ValueError, match="commutative op; for a non-commutative op "
                                                     f"use one of {', '.join(keep)}, shm, native"):
                    mar.allreduce(x, op=op, comm=comm, algorithm=algorithm)
            else:
                out = mar.allreduce(x, op=op, comm=comm, algorithm=algorithm)
                _ran(comm, algorithm)
                assert_on_every_rank(comm, mismatch(comm, out, ref, None), out)
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_plan_runs_repeatedly_and_sees_new_input(comm, algorithm):
    x = contribution(comm, 1234, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as p:
        for round_ in range(3):
            x[:] = contribution(comm, 1234, "float64", seed=round_)
            p.run()
            _ran(comm, algorithm)
            assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_plan_in_place(algorithm):
    comm = MPI.COMM_WORLD
    buf = np.empty(777, dtype=np.int64)
    p = mar.plan(MPI.IN_PLACE, buf, comm=comm, algorithm=algorithm)
    for round_ in range(2):
        x = contribution(comm, 777, "int64", seed=round_)
        buf[:] = x
        p.run()
        _ran(comm, algorithm)
        assert_matches_native(comm, x, buf, MPI.SUM)
    p.free()
    p.free()  # idempotent
    with pytest.raises(ValueError, match="freed"):
        p.run()


@pytest.mark.parametrize("algorithm", SCHEDULES)
@pytest.mark.parametrize("how", ["same_arrays", "fresh_arrays", "in_place", "timeout"])
def test_repeated_calls_see_new_input(algorithm, how):
    """Repeated one-shot calls go through the call caches (a plan per array pair, a staged
    plan per shape for fresh arrays of a shape seen before): each must read this call's input
    and write this call's output, never stale data."""
    comm = MPI.COMM_WORLD
    x = contribution(comm, 257, "float64")
    out = np.empty_like(x)
    for round_ in range(4):
        new = contribution(comm, 257, "float64", seed=round_)
        if how == "fresh_arrays":
            x, out = new.copy(), np.full_like(new, np.nan)
            result = mar.allreduce(x, out, comm=comm, algorithm=algorithm)
        elif how == "in_place":
            out[:] = new
            result = mar.allreduce(MPI.IN_PLACE, out, comm=comm, algorithm=algorithm)
        else:
            x[:] = new
            timeout = 300.0 if how == "timeout" else None  # only a hang reaches it
            result = mar.allreduce(x, out, comm=comm, algorithm=algorithm, timeout=timeout)
        assert result is out
        _ran(comm, algorithm)
        assert_matches_native(comm, new, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_a_plan_used_as_a_context_is_freed_on_exit(algorithm):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 100, "int64")
    with mar.plan(x, comm=comm, algorithm=algorithm) as p:
        _ran(comm, algorithm)
        assert_matches_native(comm, x, p.run(), MPI.SUM)
    with pytest.raises(ValueError, match="freed"):
        p.run()


def test_buffer_protocol_and_dlpack_inputs():
    import array
    comm = MPI.COMM_WORLD
    x = array.array("d", [float(comm.rank)] * 5)
    out = mar.allreduce(x, algorithm="ring", comm=comm)
    assert out.tolist() == [float(sum(range(comm.size)))] * 5

    y = DLPackOnly(np.full(4, comm.rank + 1, dtype=np.int32))
    out = np.zeros(4, dtype=np.int32)
    mar.allreduce(y, out, algorithm="ring", comm=comm)
    assert out.tolist() == [comm.size * (comm.size + 1) // 2] * 4

@pytest.mark.parametrize("segment_bytes", [24])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_ring_segmented_with_many_segments(comm, segment_bytes, in_place):
    """Small segments force many pipelined steps (and deferred combines) on small counts."""
    for count in sorted({1, comm.size - 1, comm.size + 1, 97, 1000}):
        for dtype in ("float64", "int32"):
            x = contribution(comm, count, dtype)
            if in_place:
                out = x.copy()
                mar.allreduce(MPI.IN_PLACE, out, comm=comm, algorithm="ring_segmented",
                              segment_bytes=segment_bytes)
            else:
                out = mar.allreduce(x, comm=comm, algorithm="ring_segmented",
                                    segment_bytes=segment_bytes)
            _ran(comm, "ring_segmented", count)
            assert_matches_native(comm, x, out, MPI.SUM)


def test_ring_segmented_plan_with_small_segments_repeats():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 2000, "float64")
    out = np.empty_like(x)
    with mar.plan(x, out, comm=comm, algorithm="ring_segmented", segment_bytes=256) as p:
        for round_ in range(3):
            x[:] = contribution(comm, 2000, "float64", seed=round_)
            p.run()
            _ran(comm, p.algorithm)
            assert_matches_native(comm, x, out, MPI.SUM)


def test_algorithm_parameters_are_checked():
    comm = MPI.COMM_WORLD
    x = np.ones(10)
    with pytest.raises(TypeError, match="'ring' got unexpected parameter.*segment_bytes.*takes no"):
        mar.allreduce(x, comm=comm, algorithm="ring", segment_bytes=64)
    with pytest.raises(TypeError, match="takes segment_bytes"):
        mar.allreduce(x, comm=comm, algorithm="ring_segmented", segment=64)


def test_auto_above_the_crossover_runs_the_pipelined_ring_and_matches_native():
    from mpiallreduce.select import LARGE_MESSAGE_BYTES, shm_fits
    comm = MPI.COMM_WORLD
    x = contribution(comm, LARGE_MESSAGE_BYTES // 4 + 3, "int32")
    one_node = mar.Topology.from_comm(comm).nnodes == 1
    p = mar.plan(x, comm=comm, algorithm="auto")
    try:
        # on one node of 3-8 ranks the shared-memory transport is faster still (at 2 ranks
        # it stops at 16 MiB out of place: select.SHM_RULES)
        expected = "native" if comm.size == 1 else "shm" if one_node and shm_fits(
            comm.size, x.nbytes, in_place=False) else "ring_segmented"
        assert p.algorithm == expected
        _ran(comm, p.algorithm)
        assert_matches_native(comm, x, p.run(), MPI.SUM)
    finally:
        p.free()


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_knomial_every_radix_on_every_communicator_kind(comm, k, in_place):
    """Each radix, awkward counts, a non-commutative op exact in rank order."""
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        for count in sorted({1, comm.size - 1, comm.size + 1, 97}):
            x = contribution(comm, count, "float64")
            if in_place:
                out = x.copy()
                mar.allreduce(MPI.IN_PLACE, out, comm=comm, algorithm="knomial", k=k)
            else:
                out = mar.allreduce(x, comm=comm, algorithm="knomial", k=k)
            _ran(comm, "knomial", count)
            assert_matches_native(comm, x, out, MPI.SUM)
            maps = affine_maps(comm, count)
            ref = np.empty_like(maps)
            comm.Allreduce(maps, ref, op=op)
            out = mar.allreduce(maps, op=op, comm=comm, algorithm="knomial", k=k)
            assert np.array_equal(out, ref)
            assert_identical_across_ranks(comm, out)
    finally:
        op.Free()


def test_knomial_bad_radix_is_refused_before_any_message():
    with pytest.raises(ValueError, match="integer radix k >= 2"):
        mar.allreduce(np.ones(4), comm=MPI.COMM_WORLD, algorithm="knomial", k=1)


def _table(nranks: int, commutative: str, noncommutative: str) -> dict:
    """A tuning table giving ``auto`` one algorithm per op class at every size, for ``nranks``."""
    return {"format": select.FORMAT, "tables": [{"nranks": nranks, "classes": {
        "commutative": [{"min_bytes": 0, "max_bytes": None, "algorithm": commutative}],
        "noncommutative": [{"min_bytes": 0, "max_bytes": None, "algorithm": noncommutative}]}}]}


@pytest.fixture
def table_of(monkeypatch):
    """Make ``auto`` read the table given (every rank writes the same bytes), then forget it."""
    folder = tempfile.mkdtemp(prefix="mar-tuning-")

    def use(table: dict) -> None:
        path = os.path.join(folder, "tuning.json")
        with open(path, "w", encoding="utf-8") as file:
            json.dump(table, file)
        monkeypatch.setenv(select.TUNING_ENV, path)
        select.reload()

    yield use
    monkeypatch.undo()
    select.reload()
    shutil.rmtree(folder, ignore_errors=True)


def _rule_pick(p: int) -> tuple[int, str] | None:
    """A float64 count at which auto's built-in rule picks a schedule at p ranks, or None."""
    from mpiallreduce.ops import reducer
    red = reducer(MPI.SUM, np.dtype("float64"))
    for nbytes in (2 << 10, 16 << 10, 32 << 10):
        picked = select.choose(p, nbytes, red)
        if picked != "native":
            return nbytes // 8 + 3, picked
    return None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("source", ["rule", "table"])
def test_auto_runs_the_schedule_it_picks(source, table_of):
    """auto resolves to a schedule (the built-in rule's at 2 to 5 ranks, a table's at any p)
    and runs it: the plan names it and the result is MPI's."""
    world = MPI.COMM_WORLD
    if source == "table":
        table_of(_table(world.size, "tree", "native"))
        count, expected = 1001, "tree"
    else:
        found = _rule_pick(world.size)
        if found is None:  # the same on every rank: it depends on p only
            pytest.skip(f"the built-in rule picks native at every small size at p = {world.size}")
        count, expected = found
    comm = world.Dup()  # a communicator no earlier auto call has seen
    # the built-in rule is for ranks on several nodes (on one, auto runs shm): one rank a node
    topology = mar.Topology.simulated(comm, ranks_per_node=1) if source == "rule" else None
    try:
        x = contribution(comm, count, "float64")
        with mar.plan(x, comm=comm, algorithm="auto", topology=topology) as p:
            assert p.algorithm == expected
            out = p.run()
            _ran(comm, p.algorithm)
            assert_matches_native(comm, x, out, MPI.SUM)
        out = mar.allreduce(x, comm=comm, algorithm="auto", topology=topology)
        assert_matches_native(comm, x, out, MPI.SUM)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_table_that_names_shm_is_followed_on_one_node_and_not_across_nodes(table_of):
    """``tune`` measures shm on one node; a communicator of the same size spread over nodes
    gets the built-in choice instead of shm's refusal."""
    world = MPI.COMM_WORLD
    table_of(_table(world.size, "shm", "shm"))
    comm = world.Dup()
    try:
        x = contribution(comm, 100, "float64")
        across = mar.Topology.simulated(comm, ranks_per_node=1)
        with mar.plan(x, comm=comm, algorithm="auto", topology=across) as p:
            assert p.algorithm not in ("shm", "auto")
            assert_matches_native(comm, x, p.run(), MPI.SUM)
        if mar.Topology.from_comm(comm).nnodes == 1:  # the same on every rank
            with mar.plan(x, comm=comm, algorithm="auto") as p:
                assert p.algorithm == "shm"
                assert_matches_native(comm, x, p.run(), MPI.SUM)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_auto_never_runs_an_algorithm_that_refuses_the_op(table_of):
    """Where auto picks a commutative-only schedule (the ring) for SUM, a non-commutative op of
    the same size gets the order-keeping algorithm of its class and MPI's exact result."""
    world = MPI.COMM_WORLD
    table_of(_table(world.size, "ring", "recursive_doubling"))
    assert mar.algorithms.get("ring").commutative_only
    comm = world.Dup()
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        maps = affine_maps(comm, 37)
        with mar.plan(maps, op=MPI.BXOR, comm=comm, algorithm="auto") as p:
            assert p.algorithm == "ring"  # the op class is what keeps the ring away below
        with mar.plan(maps, op=op, comm=comm, algorithm="auto") as p:
            assert p.algorithm == "recursive_doubling"
            out = p.run()
            _ran(comm, p.algorithm)
        ref = np.empty_like(maps)
        comm.Allreduce(maps, ref, op=op)
        assert_on_every_rank(comm, mismatch(comm, out, ref, None), out)
        out = mar.allreduce(maps, op=op, comm=comm, algorithm="auto")
        assert_on_every_rank(comm, mismatch(comm, out, ref, None), out)
    finally:
        op.Free()
        comm.Free()
