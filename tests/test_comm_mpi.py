"""mar.Comm, the mpi4py drop-in: mpi4py-style collective checks through it for every algorithm,
each result compared on every rank with the same call on a plain mpi4py communicator (or NumPy).
Run under mpirun with --with-mpi."""

from __future__ import annotations

import array
import re

import numpy as np
import pytest
from conftest import (
    COMM_KINDS,
    DLPackOnly,
    affine_compose,
    affine_maps,
    assert_identical_across_ranks,
    assert_matches_native,
    contribution,
    free_comm,
    make_comm,
)
from mpi4py import MPI

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

ALGORITHMS = list(mar.ALGORITHMS)
ORDERED = ["tree", "recursive_doubling", "rabenseifner", "native", "auto"]


def options(comm, algorithm):
    """Small segments for the pipelined ring; simulated nodes for the hierarchical ones."""
    if algorithm == "ring_segmented":
        return {"segment_bytes": 64}
    if algorithm in ("hierarchical", "cascade"):
        return {"topology": mar.Topology.simulated(comm, ranks_per_node=2)}
    return {}


@pytest.fixture(params=COMM_KINDS)
def base(request):
    comm = make_comm(request.param)
    yield comm
    free_comm(comm)


def wrap(comm, algorithm, **extra):
    return mar.Comm(comm, algorithm, **options(comm, algorithm), **extra)


def reference(comm, x, op=MPI.SUM):
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op)
    return ref


# -- Allreduce ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_on_every_communicator_kind(base, algorithm):
    comm = wrap(base, algorithm)
    assert isinstance(comm, MPI.Intracomm) and comm == base
    for count in (0, 1, comm.size + 1, 1000):
        for dtype in ("float64", "int32", "complex64"):
            x = contribution(base, count, dtype)
            out = np.empty_like(x)
            comm.Allreduce(x, out, op=MPI.SUM)
            assert_matches_native(base, x, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_in_place(base, algorithm):
    comm = wrap(base, algorithm)
    for op_name, op in (("MAX", MPI.MAX), ("SUM", MPI.SUM), ("BXOR", MPI.BXOR)):
        x = contribution(base, 2 * comm.size + 1, "int64", op_name)
        buf = x.copy()
        comm.Allreduce(MPI.IN_PLACE, buf, op)
        assert_matches_native(base, x, buf, op)


OP_DTYPE = [("SUM", "int8"), ("SUM", "uint16"), ("PROD", "float32"), ("MIN", "int64"),
            ("MAX", "float64"), ("LAND", "bool"), ("LOR", "int32"), ("LXOR", "uint8"),
            ("BAND", "uint64"), ("BOR", "int16"), ("BXOR", "uint32"), ("SUM", "complex128")]


@pytest.mark.parametrize("op_name, dtype", OP_DTYPE)
def test_every_predefined_op(op_name, dtype):
    comm = mar.Comm(MPI.COMM_WORLD, "recursive_doubling")
    op = getattr(MPI, op_name)
    x = contribution(MPI.COMM_WORLD, 37, dtype, op_name)
    out = np.empty_like(x)
    comm.Allreduce(x, out, op)
    assert_matches_native(MPI.COMM_WORLD, x, out, op)


@pytest.mark.mpi(min_size=2)
def test_small_integer_sums_wrap_as_c_does():
    # Open MPI's op/avx saturates 8/16-bit sums and MPICH wraps; compare with NumPy (C arithmetic).
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    x = np.full(64, 100, dtype=np.int8)
    out = np.empty_like(x)
    comm.Allreduce(x, out)
    assert np.array_equal(out, np.full(64, 100 * world.size, dtype=np.int64).astype(np.int8))


# -- buffer specs and buffer kinds ------------------------------------------------------------------

def _specs(x):
    """mpi4py's buffer spec forms, each describing all of ``x``."""
    n = x.size
    return {"buf": x, "[buf, MPI.DOUBLE]": [x, MPI.DOUBLE], "[buf, 'd']": [x, "d"],
            "[buf, count]": [x, n], "[buf, count, MPI.DOUBLE]": [x, n, MPI.DOUBLE],
            "(buf, count, MPI.DOUBLE)": (x, n, MPI.DOUBLE),
            "[buf, (count, 0), MPI.DOUBLE]": [x, (n, 0), MPI.DOUBLE],
            "[buf, count, 0, MPI.DOUBLE]": [x, n, 0, MPI.DOUBLE]}


SPEC_FORMS = list(_specs(np.zeros(1)))


@pytest.mark.parametrize("form", SPEC_FORMS)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "native"])
def test_every_buffer_spec_form(form, algorithm):
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, algorithm)
    x = contribution(world, 23, "float64")
    out = np.zeros_like(x)
    comm.Allreduce(_specs(x)[form], _specs(out)[form], MPI.SUM)
    assert_matches_native(world, x, out, MPI.SUM)


def test_count_and_displacement_select_part_of_the_buffer():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    x = contribution(world, 20, "float64")
    out = np.full(20, -1.0)
    comm.Allreduce([x, (10, 5), MPI.DOUBLE], [out, (10, 3), MPI.DOUBLE], MPI.SUM)
    expected = np.full(20, -1.0)
    world.Allreduce([x, (10, 5), MPI.DOUBLE], [expected, (10, 3), MPI.DOUBLE], MPI.SUM)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    assert (out[:3] == -1).all() and (out[13:] == -1).all()


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                   "uint64", "float32", "float64", "complex64", "complex128",
                                   "bool"])
def test_numpy_dtypes_and_layouts(dtype, order):
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "rabenseifner")
    op_name = "LOR" if dtype == "bool" else "SUM"
    x = np.asarray(contribution(world, 24, dtype, op_name).reshape(4, 6), order=order)
    out = np.zeros_like(x, order=order)
    comm.Allreduce(x, out, getattr(MPI, op_name))
    assert_matches_native(world, x, out, getattr(MPI, op_name))


def test_array_array_bytearray_memoryview():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "recursive_doubling")
    ref = np.full(5, world.size * (world.size + 1) // 2, dtype=np.int32)
    a = array.array("i", [world.rank + 1] * 5)
    out = array.array("i", [0] * 5)
    comm.Allreduce(a, out)
    assert np.array_equal(np.frombuffer(out, dtype=np.int32), ref)
    raw = bytearray(np.full(5, world.rank + 1, dtype=np.int32).tobytes())
    result = bytearray(20)
    comm.Allreduce([raw, MPI.INT], [memoryview(result), MPI.INT])
    assert np.array_equal(np.frombuffer(result, dtype=np.int32), ref)
    doubles = bytearray(np.full(3, 0.5).tobytes())
    comm.Allreduce(MPI.IN_PLACE, [doubles, 3, MPI.DOUBLE], MPI.SUM)
    assert np.array_equal(np.frombuffer(doubles), np.full(3, 0.5 * world.size))




def test_dlpack_without_a_copy():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    x = contribution(world, 11, "float32")
    storage = np.zeros_like(x)
    comm.Allreduce(DLPackOnly(x), DLPackOnly(storage), MPI.SUM)
    assert_matches_native(world, x, storage, MPI.SUM)  # written into the producer's memory


# -- datatypes and ops mpiallreduce does not reduce go to MPI ---------------------------------------

def test_pair_types_and_maxloc_fall_back_to_native():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    pairs = np.zeros(3, dtype=np.dtype([("value", "f8"), ("rank", "i4")], align=True))
    pairs["value"] = [world.rank, -world.rank, 7.0]
    pairs["rank"] = world.rank
    out = np.zeros_like(pairs)
    comm.Allreduce([pairs, MPI.DOUBLE_INT], [out, MPI.DOUBLE_INT], MPI.MAXLOC)
    ref = np.zeros_like(pairs)
    world.Allreduce([pairs, MPI.DOUBLE_INT], [ref, MPI.DOUBLE_INT], MPI.MAXLOC)
    assert np.array_equal(out["value"], ref["value"]) and np.array_equal(out["rank"], ref["rank"])


def test_derived_datatype_falls_back_to_native():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "tree")
    pair = MPI.DOUBLE.Create_contiguous(2).Commit()
    try:
        x = np.full(2, world.rank + 1.0)
        gathered = np.zeros(2 * world.size)
        comm.Allgather([x[:2], 1, pair], [gathered, 1, pair])
        assert np.array_equal(gathered, np.repeat(np.arange(1.0, world.size + 1), 2))
    finally:
        pair.Free()


# -- user ops -------------------------------------------------------------------------------------

def _add(inbuf, inoutbuf, datatype):
    a = np.frombuffer(inbuf, dtype=np.float64)
    b = np.frombuffer(inoutbuf, dtype=np.float64)
    b += a


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_user_op_commutative(algorithm):
    world = MPI.COMM_WORLD
    op = MPI.Op.Create(_add, commute=True)
    try:
        comm = wrap(world, algorithm)
        x = contribution(world, world.size + 3, "float64")
        out = np.empty_like(x)
        comm.Allreduce(x, out, op)
        assert_matches_native(world, x, out, MPI.SUM)
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", ORDERED + ["hierarchical"])
def test_user_op_not_commutative_keeps_rank_order(algorithm):
    world = MPI.COMM_WORLD
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        comm = wrap(world, algorithm)
        x = affine_maps(world, 2 * world.size + 1)
        out = np.empty_like(x)
        comm.Allreduce(x, out, op)
        assert np.array_equal(out, reference(world, x, op))
        assert_identical_across_ranks(world, out)
    finally:
        op.Free()


def test_user_op_not_commutative_refused_by_a_reordering_algorithm():
    world = MPI.COMM_WORLD
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        comm = mar.Comm(world, "ring")
        x = affine_maps(world, 5)
        with pytest.raises(ValueError, match="commutative"):
            comm.Allreduce(x, np.empty_like(x), op)
    finally:
        op.Free()


# -- errors: mpi4py's kinds for bad arguments, mpiallreduce's message for cross-rank mismatch ----

def _raised(call):
    """The kind and text of what ``call`` raises (None if nothing), buffer addresses masked:
    MPICH's error stack prints them, and each call here makes new arrays."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the kind and the text are what is compared
        return type(exc), re.sub(r"0x[0-9a-fA-F]+", "0x...", str(exc))
    return None


@pytest.mark.parametrize("case", ["count", "datatype", "readonly", "strided", "spec", "op",
                                  "op_for_type", "items"])
def test_bad_arguments_raise_what_mpi4py_raises(case):
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")

    def args():
        x, out = np.ones(4), np.zeros(4)
        return {"count": (x, np.zeros(5), MPI.SUM),
                "datatype": ([x, MPI.DOUBLE], [np.zeros(8, "f4"), MPI.FLOAT], MPI.SUM),
                "readonly": (x, np.frombuffer(bytes(32)), MPI.SUM),
                "strided": (np.ones(8)[::2], out, MPI.SUM),
                "spec": ([x, "no such type"], out, MPI.SUM),
                "op": (x, out, 3),
                "op_for_type": (x, out, MPI.BAND),
                "items": ([x, 4, 0, MPI.DOUBLE, 1], out, MPI.SUM)}[case]

    expected = _raised(lambda: world.Allreduce(*args()))
    assert expected is not None
    assert _raised(lambda: comm.Allreduce(*args())) == expected  # the kind and the message


@pytest.mark.mpi(min_size=2)
def test_count_mismatch_between_ranks_is_the_clear_error_of_mar_allreduce():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    x = np.ones(10 + (world.rank == 1))
    with pytest.raises(ValueError) as raised:
        comm.Allreduce(x, np.empty_like(x))
    with pytest.raises(ValueError) as direct:
        mar.allreduce(x, comm=world, algorithm="ring")
    assert str(raised.value) == str(direct.value)
    assert "count differs" in str(raised.value)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="choose one of"):
        mar.Comm(MPI.COMM_WORLD, "bogus")


# -- non-blocking and persistent --------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_iallreduce_wait(base, algorithm):
    comm = wrap(base, algorithm)
    x = contribution(base, 3 * comm.size + 2, "float64")
    out = np.empty_like(x)
    request = comm.Iallreduce(x, out, MPI.SUM)
    request.Wait()
    assert_matches_native(base, x, out, MPI.SUM)
    buf = x.copy()
    request = comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
    while not request.Test():
        pass
    assert_matches_native(base, x, buf, MPI.SUM)


def test_iallreduce_several_in_flight_complete_in_start_order_whatever_the_wait_order():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "tree")
    xs = [contribution(world, 5 + k, "int64", seed=k) for k in range(3)]
    outs = [np.empty_like(x) for x in xs]
    requests = [comm.Iallreduce(x, out) for x, out in zip(xs, outs)]
    order = [2, 0, 1] if world.rank % 2 else [1, 2, 0]
    for k in order:
        requests[k].Wait()
    for x, out in zip(xs, outs):
        assert_matches_native(world, x, out, MPI.SUM)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_init_start_wait_free(base, algorithm):
    comm = wrap(base, algorithm)
    x = contribution(base, 2 * comm.size + 3, "float64")
    send, out = x.copy(), np.empty_like(x)
    request = comm.Allreduce_init(send, out, MPI.SUM)
    for round_ in range(3):
        send[:] = x * (round_ + 1)
        request.Start()
        request.Wait()
        assert_matches_native(base, send, out, MPI.SUM)
    request.Free()


def test_auto_allreduce_init_hands_small_shm_requests_to_mpi_and_keeps_the_rest():
    """Where auto would run shm on a small message at 2 ranks, Allreduce_init returns MPI's own
    persistent request (it measured faster there); elsewhere (larger messages, 8/16-bit sums
    where the MPI saturates them, as Open MPI does, a timeout) a plan. Every result matches
    comm.Allreduce, and bad input still raises on every rank."""
    world = MPI.COMM_WORLD
    comm = mar.Comm(world)
    cases = [(1, "float64", MPI.SUM), (100, "float32", MPI.MAX), (2 * world.size + 1, "int64",
             MPI.SUM), (5000, "float64", MPI.SUM), (7, "int8", MPI.SUM)]
    for count, dtype, op in cases:
        x = contribution(world, count, dtype)
        send, out = x.copy(), np.empty_like(x)
        request = comm.Allreduce_init(send, out, op)
        small = x.nbytes < 4096 and not mar.ops.native_deviates("SUM", x.dtype)
        is_mpi = not isinstance(request, mar.comm.CommPrequest)
        if world.size == 2 and mar.select.one_node_choice(2, x.nbytes, False) == "shm":
            assert is_mpi == small, (count, dtype)
        elif world.size != 2:
            assert not is_mpi, (count, dtype)
        for round_ in range(2):
            send[:] = x + round_
            request.Start()
            request.Wait()
            if dtype == "int8":  # Open MPI's op/avx saturates 8-bit sums: NumPy's is C's
                want = np.add.reduce(np.array(world.allgather(send)), axis=0, dtype=np.int8)
                assert np.array_equal(out, want), (count, dtype)
            else:
                assert_matches_native(world, send, out, op)
        request.Free()
    timed = mar.Comm(world, timeout=30.0)
    request = timed.Allreduce_init(np.ones(1), np.empty(1))
    assert isinstance(request, mar.comm.CommPrequest)
    request.Free()
    if world.size > 1:
        with pytest.raises(ValueError):  # the plan's check ran first: on every rank
            count = 2 if world.rank == 0 else 1
            comm.Allreduce_init(np.ones(count), np.empty(count))


# -- the related collectives ------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_block_and_in_place(base, algorithm):
    comm = wrap(base, algorithm)
    p, rank = comm.size, comm.rank
    for block in (0, 1, 3):
        x = contribution(base, p * block, "int32")
        full = reference(base, x)
        out = np.full(block, -1, dtype=np.int32)
        comm.Reduce_scatter_block(x, out, MPI.SUM)
        assert np.array_equal(out, full[rank * block:(rank + 1) * block])
        buf = x.copy()
        comm.Reduce_scatter_block(MPI.IN_PLACE, buf, MPI.SUM)
        assert np.array_equal(buf[:block], full[rank * block:(rank + 1) * block])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_block_layout_and_other_counts(base, algorithm):
    comm = wrap(base, algorithm)
    p, rank = comm.size, comm.rank
    for counts in (mar.partition.block_counts(2 * p + 1, p), [1] * (p - 1) + [3]):
        total = sum(counts)
        x = contribution(base, total, "float64")
        ref = np.empty(counts[rank])
        base.Reduce_scatter(x, ref, counts, MPI.SUM)
        out = np.empty(counts[rank])
        comm.Reduce_scatter(x, out, counts, MPI.SUM)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-9)
        buf = x.copy()
        comm.Reduce_scatter(MPI.IN_PLACE, buf, counts, MPI.SUM)
        np.testing.assert_allclose(buf[:counts[rank]], ref, rtol=1e-12, atol=1e-9)
    x = contribution(base, 2 * p, "int64")
    out = np.empty(2, dtype=np.int64)
    comm.Reduce_scatter(x, out, None, MPI.SUM)  # mpi4py: every rank's count is recvbuf's
    assert np.array_equal(out, reference(base, x)[2 * rank:2 * rank + 2])


def test_reduce_scatter_not_commutative_keeps_rank_order():
    world = MPI.COMM_WORLD
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        comm = mar.Comm(world, "ring")
        x = affine_maps(world, 2 * world.size)
        out = np.empty(2, dtype=np.uint64)
        comm.Reduce_scatter_block(x, out, op)
        rank = world.rank
        assert np.array_equal(out, reference(world, x, op)[2 * rank:2 * rank + 2])
    finally:
        op.Free()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allgather_and_in_place(base, algorithm):
    comm = wrap(base, algorithm)
    p, rank = comm.size, comm.rank
    for block in (0, 1, 4):
        mine = np.arange(block, dtype=np.float32) + 100 * rank
        expected = np.concatenate([np.arange(block, dtype=np.float32) + 100 * r
                                   for r in range(p)])
        out = np.full(p * block, -1, dtype=np.float32)
        comm.Allgather(mine, out)
        assert np.array_equal(out, expected)
        buf = np.full(p * block, -1, dtype=np.float32)
        buf[rank * block:(rank + 1) * block] = mine
        comm.Allgather(MPI.IN_PLACE, buf)
        assert np.array_equal(buf, expected)
        counted = np.full(p * block + 1, -1, dtype=np.float32)
        comm.Allgather([mine, MPI.FLOAT], [counted, (block, 1), MPI.FLOAT])  # count per block
        assert np.array_equal(counted[1:], expected) and counted[0] == -1


# -- communicators made from a Comm ----------------------------------------------------------------

def test_dup_split_create_keep_routing_with_the_same_options():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring_segmented", segment_bytes=64, timeout=60)
    idup, request = comm.Idup()
    request.Wait()
    group = comm.Get_group()
    made = [comm.Dup(), comm.Clone(), comm.Split(world.rank % 2, world.rank),
            comm.Split_type(MPI.COMM_TYPE_SHARED), comm.Create(group), comm.Create_group(group),
            idup, comm.Dup_with_info(MPI.INFO_NULL)]
    group.Free()
    try:
        for sub in made:
            assert type(sub) is mar.Comm
            assert sub.algorithm == "ring_segmented" and sub._options == comm._options
            x = contribution(sub, 50, "float64")
            out = np.empty_like(x)
            sub.Allreduce(x, out)
            assert_matches_native(MPI.Intracomm(sub), x, out, MPI.SUM)
    finally:
        for sub in made:
            sub.Free()
    assert comm.Split(MPI.UNDEFINED, 0) == MPI.COMM_NULL


def test_everything_else_is_plain_mpi4py():
    world = MPI.COMM_WORLD
    comm = mar.Comm(world, "ring")
    assert comm.Get_size() == world.size and comm.rank == world.rank
    assert comm.allreduce(world.rank) == world.size * (world.size - 1) // 2
    buf = np.array([world.rank], dtype=np.int64)
    comm.Bcast(buf, root=0)
    assert buf[0] == 0
    comm.Barrier()


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_repeated_allreduce_reuses_one_cached_plan(algorithm):
    """The drop-in hands the caller's own arrays to mar.allreduce, whose plan cache then hits."""
    from conftest import assert_matches_native

    from mpiallreduce import _state

    world = MPI.COMM_WORLD.Dup()
    comm = mar.Comm(world, algorithm=algorithm)
    x = np.arange(6.0) + comm.rank
    out = np.empty_like(x)
    for _ in range(3):
        comm.Allreduce(x, out, op=MPI.SUM)
        assert_matches_native(world, x, out, MPI.SUM)
    assert len(_state.existing(world).calls.entries) == 1
    x.dtype = out.dtype = np.int32  # same objects, another element type: parsed again
    x[:] = comm.rank
    comm.Allreduce(x, out, op=MPI.SUM)
    assert_matches_native(world, x, out, MPI.SUM)
    before = out.copy()
    comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)
    assert_matches_native(world, before, out, MPI.SUM)
    world.Free()


@pytest.mark.parametrize("algorithm", ["auto", "native", "ring", "shm"])
@pytest.mark.parametrize("in_place", [True, False])
def test_fresh_arrays_per_call_run_their_shape_without_the_call_path(monkeypatch, algorithm,
                                                                     in_place):
    """``local = np.array([np.vdot(a, b)]); comm.Allreduce(IN_PLACE, local)``, as a solver's dot
    products are written: from the second call the shape mar.allreduce remembered runs on the
    new arrays directly instead of through mar.allreduce's lookups; a shape the cache
    dropped is never run."""
    from conftest import assert_matches_native

    from mpiallreduce import _state
    from mpiallreduce import comm as comm_module

    world = MPI.COMM_WORLD.Dup()
    comm = mar.Comm(world, algorithm=algorithm)
    routed = []
    real = comm_module.allreduce
    monkeypatch.setattr(comm_module, "allreduce", lambda *a, **k: routed.append(1) or real(*a, **k))

    def call(round_):
        local = np.array([float(comm.rank + round_), 0.5 * comm.rank - round_])
        original = local.copy()
        if in_place:
            comm.Allreduce(MPI.IN_PLACE, local, op=MPI.SUM)
            out = local
        else:
            out = np.empty(2)
            comm.Allreduce(local, out, op=MPI.SUM)
            assert np.array_equal(local, original)
        assert_matches_native(world, original, out, MPI.SUM)
        return out

    results = [call(k) for k in range(4)]
    assert len(routed) == 1
    for k, out in enumerate(results):  # each call's own result, not overwritten by later ones
        assert out[0] == sum(range(comm.size)) + k * comm.size
    _state.existing(world).calls.clear()  # the shape is freed: the next call takes the path
    call(9)
    assert len(routed) == 2
    call(10)
    assert len(routed) == 2  # and found the new shape
    world.Free()
