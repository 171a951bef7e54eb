"""The shared-memory transport (algorithm "shm"): every regime against comm.Allreduce and NumPy,
shared arrays and their lifetime, mismatches and misordered plans, timeouts, multi-node refusal."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import (
    GRID_KINDS,
    affine_compose,
    affine_maps,
    assert_identical_across_ranks,
    assert_matches_native,
    awkward_counts,
    contribution,
    time_out_or_hear,
    timed_out,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _agree, _plans, _state, select, shm
from mpiallreduce.topology import Topology

pytestmark = pytest.mark.mpi

OPS = ["SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"]
DTYPES = ["int8", "uint16", "int32", "uint64", "float32", "float64", "complex128", "bool"]
#: counts on both sides of the small regime's limits (float64: at 2 ranks, elsewhere), and one
#: of several windows
LARGE = [shm.SMALL_BYTES // 8 - 1, shm.SMALL_BYTES // 8 + 1, shm.small_bytes(2) // 8 - 1,
         shm.small_bytes(2) // 8 + 1, 300_007]


def _defined(op: str, dtype: str) -> bool:
    kind = np.dtype(dtype).kind
    if kind == "b":
        return op in ("LAND", "LOR", "LXOR")
    if kind in "fc":
        return op in ("SUM", "PROD") or (kind == "f" and op in ("MIN", "MAX"))
    return True


CASES = [(op, dtype) for op in OPS for dtype in DTYPES if _defined(op, dtype)]


def _counts(comm) -> list[int]:
    return sorted(set(awkward_counts(comm.size) + LARGE))


@pytest.mark.parametrize("comm", GRID_KINDS, indirect=True)
@pytest.mark.parametrize("op_name, dtype", CASES)
def test_every_op_and_dtype_matches_native(comm, op_name, dtype):
    op = getattr(MPI, op_name)
    for count in (1, comm.size + 1, 97, 5003):
        x = contribution(comm, count, dtype, op_name)
        out = mar.allreduce(x, op=op, comm=comm, algorithm="shm")
        assert_matches_native(comm, x, out, op)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("kind", ["one_shot", "plan"])
def test_awkward_counts_repeated_with_changing_inputs(comm, in_place, kind):
    """Stale slots (of the previous call, or two calls back) would show as wrong results."""
    for count in _counts(comm):
        buf = np.empty(count)
        out = np.empty(count)
        plan = None
        if kind == "plan":
            plan = (mar.plan(MPI.IN_PLACE, buf, comm=comm, algorithm="shm") if in_place
                    else mar.plan(buf, out, comm=comm, algorithm="shm"))
        for round_ in range(5):
            x = contribution(comm, count, "float64", seed=round_)
            buf[...] = x
            if plan is not None:
                plan.run()
            elif in_place:
                mar.allreduce(MPI.IN_PLACE, buf, comm=comm, algorithm="shm")
            else:
                mar.allreduce(buf, out, comm=comm, algorithm="shm")
            assert_matches_native(comm, x, buf if in_place else out, MPI.SUM)
        if plan is not None:
            plan.free()



@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1 KiB instead of 512 KiB, set alike on every rank before any plan binds: a
    large-regime message crosses many chunk boundaries, and the largest count takes chunks larger
    than CHUNK_BYTES. At most 160 chunks per call in a world of 2 ranks (the small regime ends at
    128 KiB there), 64 in larger worlds (it ends at 32 KiB): each chunk is a handshake, and at 8
    ranks on 2 cores 160 chunks took 16 s of CI, 256 took 36."""
    monkeypatch.setattr(shm, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(shm, "MAX_CHUNKS", 160 if MPI.COMM_WORLD.size <= 2 else 64)


def _chunk_counts(comm, itemsize: int) -> list[int]:
    """Counts past the small regime's limit, on and beside chunk boundaries (1 KiB chunks), and
    one whose chunks grow past CHUNK_BYTES (not a multiple of their size)."""
    smallest = shm.small_bytes(comm.size) // itemsize + 1
    per = 1024 // itemsize
    boundary = -(-smallest // per) * per
    # past the small regime and past MAX_CHUNKS chunks of 1 KiB, by 35 KiB and 3 bytes
    largest = (max(shm.small_bytes(comm.size) // 1024, shm.MAX_CHUNKS) + 35) * 1024 + 3
    counts = {smallest, boundary, boundary + 1, boundary + comm.size - 1, largest // itemsize}
    assert shm.chunk_bytes(max(counts) * itemsize) > 1024
    return sorted(counts)


@pytest.mark.parametrize("comm", GRID_KINDS, indirect=True)  # a grid: no Dup(), no COMM_SELF
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype, op_name", [("float64", "SUM"), ("int8", "SUM"),
                                            ("int32", "MAX"), ("complex128", "PROD")])
def test_chunked_large_regime_across_chunk_boundaries(comm, small_chunks, in_place, dtype,
                                                      op_name):
    """The large regime on a private result moves a chunk at a time through two buffers per
    parity slot: a chunk read from the wrong buffer, or a buffer reused too early, shows as a
    wrong result (inputs change every round; plans and one-shot calls interleave)."""
    op = getattr(MPI, op_name)
    for count in _chunk_counts(comm, np.dtype(dtype).itemsize):
        buf = np.empty(count, dtype=dtype)
        out = np.empty(count, dtype=dtype)
        plan = (mar.plan(MPI.IN_PLACE, buf, op=op, comm=comm, algorithm="shm") if in_place
                else mar.plan(buf, out, op=op, comm=comm, algorithm="shm"))
        assert comm.size == 1 or isinstance(plan, shm.ChunkedPlan)
        for round_ in range(3):
            x = contribution(comm, count, dtype, op_name, seed=round_)
            buf[...] = x
            if round_ == 1:  # a one-shot call between two runs of the plan
                if in_place:
                    mar.allreduce(MPI.IN_PLACE, buf, op=op, comm=comm, algorithm="shm")
                else:
                    mar.allreduce(buf, out, op=op, comm=comm, algorithm="shm")
            else:
                plan.run()
            result = buf if in_place else out
            if np.dtype(dtype).itemsize == 1:  # Open MPI saturates 8-bit sums: NumPy's
                expect = np.sum(comm.allgather(x), axis=0, dtype=dtype)
                assert all(comm.allgather(np.array_equal(result, expect))), count
            else:
                assert_matches_native(comm, x, result, op)
        plan.free()


def test_chunked_large_regime_keeps_rank_order_and_averages(comm, small_chunks):
    compose = MPI.Op.Create(affine_compose, commute=False)
    try:
        for count in _chunk_counts(comm, 8):
            x = affine_maps(comm, count, seed=count)
            every = comm.allgather(x)
            expect = every[-1].copy()
            for earlier in reversed(every[:-1]):
                affine_compose(earlier, expect, None)
            y = x.copy()
            mar.allreduce(MPI.IN_PLACE, y, op=compose, comm=comm, algorithm="shm")
            assert all(comm.allgather(np.array_equal(y, expect))), f"count {count}"
            z = contribution(comm, count, "float64")
            assert_matches_native(comm, z, mar.allreduce(z, op=mar.AVG, comm=comm,
                                                         algorithm="shm"),
                                  MPI.SUM, average=True)
    finally:
        compose.Free()


def _at_page_offset(count: int, dtype, offset: int) -> np.ndarray:
    """An array of ``count`` elements ``offset`` bytes past a page boundary (malloc puts large
    arrays 16 bytes past one)."""
    raw = np.empty(count * np.dtype(dtype).itemsize + 8192, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    return raw[start:start + count * np.dtype(dtype).itemsize].view(dtype)


def _bound_calls(programs):
    """Every bound call in a plan's programs (nested tuples of calls)."""
    for item in programs:
        if isinstance(item, tuple):
            yield from _bound_calls(item)
        else:
            yield item


def _memcpy_in_its_slow_band(call) -> bool:
    """Whether a bound call is a memcpy (np.copyto, or a memoryview's slice assignment) of 4 KiB
    or more whose target lies 1-63 bytes past its source modulo 4096 (glibc's rep movsb trap)."""
    func = getattr(call, "func", None)
    if func is np.copyto:
        target, source = call.args[:2]
    elif getattr(func, "__name__", None) == "__setitem__" and isinstance(
            getattr(func, "__self__", None), memoryview):
        target, source = func.__self__, call.args[1]
    else:
        return False
    target, source = np.frombuffer(target, np.uint8), np.frombuffer(source, np.uint8)
    return (target.nbytes >= shm.plan.LOOP_COPY_BYTES
            and 0 < (target.ctypes.data - source.ctypes.data) % 4096 < 64)


@pytest.mark.parametrize("dtype", ["float64", "int8", "complex128", "bool"])
def test_copy_call_copies_every_byte_at_every_alignment(dtype):
    """shm's one copy (``plan.copy_call``): the same bytes (NaN payloads, -0.0, odd sizes), on
    both sides of its memcpy limit, from and to any page offset."""
    for count in (0, 1, 7, shm.plan.LOOP_COPY_BYTES // np.dtype(dtype).itemsize + 3, 70_001):
        source = contribution(MPI.COMM_SELF, count, dtype, "SUM", seed=count)
        if np.dtype(dtype).kind == "f" and count > 2:
            source[:3] = [np.nan, -0.0, np.inf]
        for offset in (0, 8, 16, 24, 4088):
            target = _at_page_offset(count, dtype, offset)
            shm.plan.copy_call(target, source)()
            assert source.tobytes() == target.tobytes(), (count, offset)


@pytest.mark.parametrize("in_place", [False, True])
def test_small_regime_loads_avoid_memcpys_slow_band(comm, in_place):
    """The small regime's load (input into the rank's slot) of LOOP_COPY_BYTES or more goes
    through NumPy's byte loop where memcpy would be slow, as the large regime's copies do:
    slots start on a page, so an input ending 8-24 bytes before one puts its slot 8-24 bytes
    past it modulo 4096, where memcpy's rep movsb takes several times the call at 32 KiB.
    Results are checked with the input at page offsets 0, 16 and 4080."""
    count = min(shm.small_bytes(comm.size), 32768) // 8
    assert count * 8 >= shm.plan.LOOP_COPY_BYTES
    for offset in (0, 16, 4080):
        x = _at_page_offset(count, np.float64, offset)
        x[...] = contribution(comm, count, "float64", seed=offset)
        out = x if in_place else np.empty_like(x)
        plan = mar.plan(MPI.IN_PLACE if in_place else x, out, comm=comm, algorithm="shm")
        for _ in range(2):  # both parities
            if in_place:
                out[...] = contribution(comm, count, "float64", seed=offset)
            plan.run()
            assert_matches_native(comm, contribution(comm, count, "float64", seed=offset), out,
                                  MPI.SUM)
        if comm.size > 1:
            assert isinstance(plan, shm.SmallPlan)
            loads = [load for load, _ in plan._programs]
            assert not any(map(_memcpy_in_its_slow_band, loads)), (offset, loads)
            if offset == 4080:  # slots start on a page: 16 bytes past the input
                assert all(getattr(load, "func", None) is np.positive for load in loads)
        plan.free()


@pytest.mark.parametrize("in_place", [False, True])
def test_large_regime_copies_avoid_memcpys_slow_band(comm, in_place):
    """Copies between slots and a rank's arrays go through NumPy's byte loop where glibc's
    memcpy would be slow (5-15x on AMD Zen 3 where the target lies 1-31 bytes past the source
    modulo 4096, as a result array 16 bytes past a page lies past a slot; docs/performance.md),
    through memcpy elsewhere. Results are checked at page offsets 0, 16 and 24 of input and
    result."""
    count = shm.small_bytes(comm.size) // 8 * 3 + 5
    for offset in (0, 16, 24):
        x = _at_page_offset(count, np.float64, offset)
        x[...] = contribution(comm, count, "float64", seed=offset)
        out = _at_page_offset(count, np.float64, offset)
        if in_place:
            out[...] = x
        plan = mar.plan(MPI.IN_PLACE if in_place else x, out, comm=comm, algorithm="shm")
        plan.run()
        assert_matches_native(comm, x, out, MPI.SUM)
        if comm.size > 1:
            assert isinstance(plan, shm.ChunkedPlan)
            calls = list(_bound_calls((plan._chunks(0), plan._chunks(1))))
            slow = [call for call in calls if _memcpy_in_its_slow_band(call)]
            assert not slow, f"{len(slow)} bound memcpy calls in the slow band"
            # and the byte loop only there (the chunks' distances are computed from the
            # arrays' addresses once, not read per copy)
            looped = [call for call in calls if getattr(call, "func", None) is np.positive]
            assert all(shm.plan.trapped(call.args[1], call.args[0]) for call in looped)
            if offset:  # a result 16 or 24 bytes past a page, slots on one: the byte loop
                assert any(getattr(call, "func", None) is np.positive for call in calls)
        plan.free()


def test_chunked_large_regime_reads_a_shared_input_in_place(comm, small_chunks):
    count = _chunk_counts(comm, 8)[-1]
    with mar.shared_zeros(count, comm=comm) as send:
        out = np.empty(count)
        for round_ in range(3):
            x = contribution(comm, count, "float64", seed=round_)
            send[...] = x
            mar.allreduce(send, out, comm=comm, algorithm="shm")
            assert_matches_native(comm, x, out, MPI.SUM)
        comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_rank_stalled_between_chunks_times_out_on_every_other(monkeypatch, small_chunks):
    """A rank that stops in the middle of a chunked call: the others name it and the step."""
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)
    world = MPI.COMM_WORLD
    comm = world.Dup()
    count = _chunk_counts(comm, 8)[-1]
    x = contribution(comm, count, "float64")
    plan = mar.plan(x, comm=comm, algorithm="shm")
    assert len(plan._chunks(0)) > 2  # (each parity's chunks are bound at its first run)
    if comm.rank == 0:  # its second chunk stalls before reducing
        stalled = list(plan._chunks(1))
        _, reduce, pull = stalled[1]
        stalled[1] = (stalled[1][0], (lambda: time.sleep(0.8), *reduce), pull)
        plan._programs = (plan._programs[0], tuple(stalled))
    world.Barrier()
    if comm.rank == 0:  # still within its own timeout, it hears the others give up
        with pytest.raises(mar.CommunicatorRevoked):
            plan.run(timeout=1.5)  # epoch 1 (its parity: programs[1])
        message = None
    else:
        message = time_out_or_hear(lambda: plan.run(timeout=0.3), 0.3)
    messages = world.allgather(message)
    assert all("no answer from rank(s) 0 at the reduce of chunk 1" in m
               for m in timed_out(messages[1:])), messages
    plan.free()
    comm.Free()

def test_fortran_order_and_several_dimensions(comm):
    for shape in [(3, 5), (70, 40), (200, 61)]:
        x = np.asfortranarray(contribution(comm, int(np.prod(shape)), "float64").reshape(shape))
        out = np.asfortranarray(np.empty(shape))
        mar.allreduce(x, out, comm=comm, algorithm="shm")
        assert out.flags.f_contiguous
        memory = x.reshape(-1, order="F")  # compared in memory order, as MPI pairs elements
        assert_matches_native(comm, memory, out.reshape(-1, order="F"), MPI.SUM)
        y = x.copy(order="F")
        mar.allreduce(MPI.IN_PLACE, y, comm=comm, algorithm="shm")
        assert_matches_native(comm, memory, y.reshape(-1, order="F"), MPI.SUM)


def test_non_commutative_user_op_keeps_rank_order(comm):
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        for count in (1, comm.size + 1, 1000, 5000):  # both regimes (8-byte elements)
            for round_ in range(3):
                x = affine_maps(comm, count, seed=round_)
                every = comm.allgather(x)
                expect = every[-1].copy()
                for earlier in reversed(every[:-1]):  # x0 ∘ x1 ∘ … ∘ x(p-1)
                    affine_compose(earlier, expect, None)
                out = mar.allreduce(x, op=op, comm=comm, algorithm="shm")
                assert np.array_equal(out, expect), f"rank {comm.rank}, count {count}"
                y = x.copy()
                mar.allreduce(MPI.IN_PLACE, y, op=op, comm=comm, algorithm="shm")
                assert np.array_equal(y, expect)
    finally:
        op.Free()


def test_average(comm):
    for count in (1, 100, 5000):
        x = contribution(comm, count, "float64")
        out = mar.allreduce(x, op=mar.AVG, comm=comm, algorithm="shm")
        assert_matches_native(comm, x, out, MPI.SUM, average=True)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("op_name", ["SUM", "PROD"])
def test_narrow_integers_wrap_as_numpy(comm, dtype, op_name):
    """The 8/16-bit modular rule: NumPy's wrapping arithmetic, whatever the native op does."""
    info = np.iinfo(dtype)
    ufunc = np.add if op_name == "SUM" else np.multiply
    for count in (1, 7, 1031, 40_000):
        rng = np.random.default_rng([comm.rank, count])
        x = rng.integers(info.max // 2, info.max, count, endpoint=True).astype(dtype)
        every = comm.allgather(x)
        expect = every[0].copy()
        for other in every[1:]:
            ufunc(expect, other, out=expect)
        out = mar.allreduce(x, op=getattr(MPI, op_name), comm=comm, algorithm="shm")
        assert np.array_equal(out, expect)


@pytest.mark.parametrize("count", [0, 1, 1000, 100_003])
@pytest.mark.parametrize("where", ["in_place", "both_shared", "send_shared", "recv_shared"])
def test_shared_arrays(comm, count, where):
    send_shared = where in ("in_place", "both_shared", "send_shared")
    recv_shared = where in ("both_shared", "recv_shared")
    with mar.shared_zeros(count, comm=comm) as a, mar.shared_zeros(count, comm=comm) as b:
        send = a if send_shared else np.zeros(count)
        recv = b if recv_shared else np.zeros(count)
        assert isinstance(a, mar.SharedArray) and a.shape == (count,) and not a.any()
        for round_ in range(4):
            x = contribution(comm, count, "float64", seed=round_)
            send[...] = x
            if where == "in_place":
                mar.allreduce(MPI.IN_PLACE, send, comm=comm, algorithm="shm")
                result = send
            else:
                mar.allreduce(send, recv, comm=comm, algorithm="shm")
                result = recv
            assert_matches_native(comm, x, result, MPI.SUM)
        del send, recv
        comm.Barrier()


def test_shared_arrays_with_a_user_op_and_fortran_order(comm):
    op = MPI.Op.Create(affine_compose, commute=False)
    try:
        with mar.shared_empty((60, 70), np.uint64, comm=comm, order="F") as a:
            assert a.flags.f_contiguous
            for round_ in range(3):
                x = affine_maps(comm, a.size, seed=round_).reshape(a.shape, order="F")
                every = comm.allgather(x)
                expect = every[-1].copy(order="F")
                for earlier in reversed(every[:-1]):
                    affine_compose(earlier.reshape(-1, order="F"), expect.reshape(-1, order="F"),
                                   None)
                a[...] = x
                with mar.plan(MPI.IN_PLACE, a, op=op, comm=comm, algorithm="shm") as plan:
                    plan.run()
                assert np.array_equal(a, expect)
            comm.Barrier()
    finally:
        op.Free()


#: past the largest private array auto hands shm at 2 ranks (in place, 32 MiB)
PAST_PRIVATE_LIMIT = (33 << 20) // 8


@pytest.mark.mpi
def test_auto_runs_shm_on_a_shared_array_in_place_at_any_size():
    """In place on a shared array shm reads the peers' arrays where they are (no copy in or
    out): auto runs it past the size where it leaves private arrays (32 MiB in place at 2
    ranks, where shared arrays ran 0.25x native's time and 0.64x the ring's), with the result
    of comm.Allreduce; before, it ran the private arrays' choice there."""
    comm = MPI.COMM_WORLD
    x = contribution(comm, PAST_PRIVATE_LIMIT, "float64")
    with mar.shared_empty(PAST_PRIVATE_LIMIT, comm=comm) as a:
        a[...] = x
        with mar.plan(MPI.IN_PLACE, a, comm=comm) as plan:
            one_node = Topology.from_comm(comm).nnodes == 1
            assert plan.algorithm == "shm" or not one_node or comm.size == 1
            plan.run()
        assert_matches_native(comm, x, a, MPI.SUM)
        comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_auto_refuses_a_shared_array_on_some_ranks_and_a_private_one_on_others():
    """auto picks from whether the array is shared, so ranks that pass a shared array where
    others pass a private one would run different algorithms: the argument check names the
    difference on every rank instead of a hang."""
    comm = MPI.COMM_WORLD
    with mar.shared_zeros(PAST_PRIVATE_LIMIT, comm=comm) as a:
        private = np.zeros(PAST_PRIVATE_LIMIT)
        mine = a if comm.rank % 2 == 0 else private
        with pytest.raises(ValueError, match="recvbuf differs: .*shared array") as error:
            mar.allreduce(MPI.IN_PLACE, mine, comm=comm)
        assert "private array" in str(error.value)
        del mine
        comm.Barrier()


def test_freeing_a_shared_array_a_plan_uses_is_an_error(comm):
    a = mar.shared_zeros(1000, comm=comm)
    plan = mar.plan(MPI.IN_PLACE, a, comm=comm, algorithm="shm")
    with pytest.raises(ValueError, match="still used by 1 plan"):
        a.free()
    a[...] = comm.rank
    plan.run()
    assert (a == sum(range(comm.size))).all()
    plan.free()
    mar.allreduce(MPI.IN_PLACE, a, comm=comm, algorithm="shm")  # cached one-shot plans are let go
    a.free()
    assert a.freed
    a.free()  # idempotent
    with pytest.raises(ValueError, match="freed"):
        mar.plan(MPI.IN_PLACE, a, comm=comm, algorithm="shm")


def test_plans_run_in_different_orders_raise_on_every_rank():
    comm = MPI.COMM_WORLD.Dup()
    try:
        x, y = contribution(comm, 10, "float64"), contribution(comm, 10, "float64", seed=1)
        first = mar.plan(x, comm=comm, algorithm="shm")
        second = mar.plan(y, comm=comm, algorithm="shm")
        runs = [first, second] if comm.rank % 2 == 0 else [second, first]
        if comm.size == 1:
            for plan in runs:
                plan.run()
        else:
            for plan in runs:
                with pytest.raises(ValueError, match="plan differs"):
                    plan.run()
        # the communicator goes on working
        for plan, data in ((first, x), (second, y)):
            assert_matches_native(comm, data, plan.run(), MPI.SUM)
        first.free()
        second.free()
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_different_counts_raise_on_every_rank_without_the_check():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 10 + comm.rank % 2, "float64")
    with pytest.raises(ValueError, match=r"count differs: 10 on ranks? 0"):
        mar.allreduce(x, comm=comm, algorithm="shm", check=False)
    y = contribution(comm, 10, "float64")
    assert_matches_native(comm, y, mar.allreduce(y, comm=comm, algorithm="shm", check=False),
                          MPI.SUM)


@pytest.mark.mpi(min_size=2)
def test_a_missing_rank_times_out_on_every_other_and_the_communicator_is_refused(monkeypatch):
    # the timed-out ranks never free the node's windows: the healthy rank's close gives up
    # after CLOSE_SECONDS (0.5 s here, not 10: this test runs at every rank count)
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = contribution(comm, 100, "float64")
    mar.allreduce(x, comm=comm, algorithm="shm")  # the window exists: nothing collective left
    plan = mar.plan(x, comm=comm, algorithm="shm")
    world.Barrier()
    message = None
    if comm.rank != 0:
        message = time_out_or_hear(lambda: plan.run(timeout=0.5), 0.5)
        with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked"):
            plan.run()
        with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked"):
            mar.allreduce(x, comm=comm, algorithm="shm")
    messages = world.allgather(message)
    assert all("no answer from rank(s) 0 in step 0" in m for m in timed_out(messages)), messages
    plan.free()
    comm.Free()


def test_a_timeout_not_reached_changes_nothing(comm):
    for count in (1, 5000):
        x = contribution(comm, count, "float64")
        assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="shm", timeout=60),
                              MPI.SUM)


@pytest.mark.mpi(min_size=2)
def test_a_multi_node_communicator_is_refused():
    comm = MPI.COMM_WORLD
    x = contribution(comm, 10, "float64")
    with pytest.raises(ValueError, match="'hierarchical' or 'cascade'"):
        mar.allreduce(x, comm=comm, algorithm="shm", topology=Topology.simulated(comm, 1))


def test_growing_windows_keep_older_plans_working(comm):
    small = contribution(comm, 100, "float64")
    plan = mar.plan(small, comm=comm, algorithm="shm")
    big = contribution(comm, 200_000, "float64")
    for _ in range(2):
        assert_matches_native(comm, big, mar.allreduce(big, comm=comm, algorithm="shm"),
                              MPI.SUM)
        assert_matches_native(comm, small, plan.run(), MPI.SUM)
    plan.free()


def test_nonblocking_and_comm(comm):
    x = contribution(comm, 3000, "float64")
    request = mar.iallreduce(x, comm=comm, algorithm="shm")
    assert_matches_native(comm, x, request.wait(), MPI.SUM)
    with mar.plan(x, comm=comm, algorithm="shm") as plan:
        plan.start()
        assert_matches_native(comm, x, plan.wait(), MPI.SUM)
    drop_in = mar.Comm(comm, algorithm="shm")
    out = np.empty_like(x)
    drop_in.Allreduce(x, out)
    assert_matches_native(comm, x, out, MPI.SUM)
    assert_identical_across_ranks(comm, out)


@pytest.mark.mpi(min_size=2)
def test_the_check_over_shared_memory_reports_a_timeout_on_some_ranks_only():
    """Once the node's shared memory exists the argument check runs there, where a check with a
    timeout meets one without: every rank gets the same ValueError instead of a timeout."""
    comm = MPI.COMM_WORLD.Dup()
    x = contribution(comm, 10, "float64")
    mar.allreduce(x, comm=comm, algorithm="shm")
    with pytest.raises(ValueError, match="timeout differs: no timeout on rank"):
        mar.allreduce(x, comm=comm, algorithm="native", timeout=5 if comm.rank == 1 else None)
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm), MPI.SUM)
    comm.Free()


def test_auto_runs_shm_on_one_node(comm):

    one_node = Topology.from_comm(comm).nnodes == 1
    for count in (1, 1000, 100_000):
        x = contribution(comm, count, "float64")
        with mar.plan(x, comm=comm) as plan:
            if one_node and select.shm_fits(comm.size, x.nbytes, in_place=False):
                assert plan.algorithm == "shm"
            else:
                assert plan.algorithm != "shm"
            assert_matches_native(comm, x, plan.run(), MPI.SUM)


def test_a_request_in_flight_and_blocking_calls_keep_call_order(comm):
    """Epochs are taken in call order in the caller's thread, so a blocking call made while a
    request runs in the progress thread waits its turn instead of pairing with the wrong call."""
    x = contribution(comm, 2000, "float64")
    y = contribution(comm, 2000, "float64", seed=1)
    for _ in range(3):
        request = mar.iallreduce(x, comm=comm, algorithm="shm")
        out = mar.allreduce(y, comm=comm, algorithm="shm")
        assert_matches_native(comm, x, request.wait(), MPI.SUM)
        assert_matches_native(comm, y, out, MPI.SUM)


# -- the argument check folded into the run (check=True costs no epoch of its own) ---------------

def _others(comm, rank: int = 1) -> str:
    others = [r for r in range(comm.size) if r != rank]
    return ("rank " if len(others) == 1 else "ranks ") + ", ".join(map(str, others))


def _same_everywhere(comm, exc) -> str:
    messages = comm.allgather((type(exc).__name__, str(exc)))
    assert len(set(messages)) == 1, f"ranks raised different errors: {messages}"
    return str(exc)


@pytest.fixture
def dup():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


def test_a_repeated_checked_call_runs_one_epoch_and_no_separate_check(comm, monkeypatch):
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="shm")
    node = _state.existing(comm).private.Get_attr(shm.KEYVAL)  # None on one rank
    checks = []
    monkeypatch.setattr(_plans, "agree", lambda *args, **kwargs: checks.append(1))
    monkeypatch.setattr(_agree, "agree", lambda *args, **kwargs: checks.append(1))
    epoch = 0 if node is None else node.epoch
    for seed, check in ((1, True), (2, False), (3, True)):
        x[:] = contribution(comm, 10, "float64", seed=seed)
        mar.allreduce(x, out, comm=comm, algorithm="shm", check=check)
        assert_matches_native(comm, x, out, MPI.SUM)
    # a new call (a miss of the call cache) checks itself too
    y = contribution(comm, 7, "float64", seed=4)
    assert_matches_native(comm, y, mar.allreduce(y, comm=comm, algorithm="shm"), MPI.SUM)
    if comm.size > 1:
        assert node.epoch - epoch == 4
        assert checks == []
    else:  # no shared memory at one rank: the check (of nothing) runs as before
        assert len(checks) == 3


def test_a_repeated_checked_iallreduce_runs_one_epoch_and_no_separate_check(comm, monkeypatch):
    # iallreduce on shm runs whole at the call, with the check folded into its run as a
    # blocking call's; ranks whose caches differ (rank 0 keeps nothing) still pair their epochs
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    mar.iallreduce(x, out, comm=comm, algorithm="shm").wait()
    if comm.rank == 0:  # restored after the test: later tests on this comm expect a cache
        monkeypatch.setattr(_state.existing(comm).calls, "max_entries", 0)
    node = _state.existing(comm).private.Get_attr(shm.KEYVAL)  # None on one rank
    checks = []
    monkeypatch.setattr(_plans, "agree", lambda *args, **kwargs: checks.append(1))
    monkeypatch.setattr(_agree, "agree", lambda *args, **kwargs: checks.append(1))
    epoch = 0 if node is None else node.epoch
    for seed in (1, 2, 3):
        x[:] = contribution(comm, 10, "float64", seed=seed)
        assert mar.iallreduce(x, out, comm=comm, algorithm="shm").wait() is out
        assert_matches_native(comm, x, out, MPI.SUM)
    if comm.size > 1:
        assert node.epoch - epoch == 3
        assert checks == []
    else:  # no shared memory at one rank: the check (of nothing) runs as before
        assert len(checks) == 3


def test_a_rank_whose_cache_lost_the_call_still_meets_the_others(comm):
    """The call cache differs by rank (evictions by bytes): a rank that binds the call again
    checks it inside the run as the ranks that find it do, so their epochs stay paired."""
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    for round_ in range(4):
        if round_ and comm.rank == round_ % comm.size:
            _state.existing(comm).calls.clear()  # local: no message
        x[:] = contribution(comm, 10, "float64", seed=round_)
        mar.allreduce(x, out, comm=comm, algorithm="shm")
        assert_matches_native(comm, x, out, MPI.SUM)
        mar.allreduce(MPI.IN_PLACE, x, comm=comm, algorithm="shm")
        assert_matches_native(comm, contribution(comm, 10, "float64", seed=round_), x, MPI.SUM)


def test_check_on_some_ranks_only_is_harmless_on_the_shm_path(comm):
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="shm")  # the node exists: no collective left
    check = comm.rank % 2 == 0
    y = contribution(comm, 3000, "float64", seed=1)
    for _ in range(2):  # a miss of the call cache, then a hit
        assert_matches_native(comm, y, mar.allreduce(y, comm=comm, algorithm="shm", check=check),
                              MPI.SUM)
        mar.allreduce(x, out, comm=comm, algorithm="shm", check=check)
        assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("field", ["topology", "timeout", "algorithm"])
@pytest.mark.parametrize("entry", ["allreduce", "plan"])
def test_fields_only_the_argument_check_covered_raise_in_the_run(dup, field, entry):
    """Built and run without the separate check (check=False), ranks that differ in a field the
    data alone does not show raise the agreement's message on every rank from the run."""
    comm = dup
    # 1.28 MB: auto runs shm out of place at every size of one node, oversubscribed too
    # (select.one_node_choice: from 128 KiB oversubscribed, at 2 ranks below 16 MiB)
    x = contribution(comm, 160_000, "float64")
    assert select.shm_fits(comm.size, x.nbytes, in_place=False)
    mar.allreduce(x, comm=comm, algorithm="shm")  # node and topology exist: nothing collective
    topology = Topology.from_comm(comm)  # one node (collective: on every rank)
    odd = comm.rank == 1
    kwargs = dict(comm=comm, algorithm="shm", check=False)
    if field == "topology":
        kwargs["topology"] = topology if odd else None
        expected = f"topology differs: no topology on {_others(comm)}; a topology with checksum "
    elif field == "timeout":
        kwargs["timeout"] = 60 if odd else None
        expected = f"timeout differs: no timeout on {_others(comm)}; a timeout on rank 1"
    else:
        kwargs["algorithm"] = "auto" if odd else "shm"
        kwargs["topology"] = topology  # auto then runs shm where the rule allows: same size
        expected = f"algorithm differs: shm on {_others(comm)}; auto on rank 1"
    with pytest.raises(ValueError) as info:
        if entry == "allreduce":
            mar.allreduce(x, **kwargs)
        else:
            timeout = kwargs.pop("timeout", None)
            with mar.plan(x, **kwargs, timeout=timeout) as plan:
                plan.run()
    message = _same_everywhere(comm, info.value)
    assert message.startswith(f"{entry} called with different arguments on different ranks: "
                              + expected), message
    assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="shm"), MPI.SUM)


@pytest.mark.mpi(min_size=2)
def test_a_cached_checked_call_meets_bad_input_or_other_counts_with_the_agreements_message(dup):
    comm = dup
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="shm")  # cached: the others run it fused
    readonly = np.empty_like(x)
    readonly.flags.writeable = False
    with pytest.raises(ValueError) as info:  # rank 1 runs the separate check, with bad input
        mar.allreduce(x, readonly if comm.rank == 1 else out, comm=comm, algorithm="shm")
    assert _same_everywhere(comm, info.value) == (
        "allreduce: bad input on rank 1: recvbuf is read-only; the result needs a writable buffer")
    y = contribution(comm, 11, "float64")
    with pytest.raises(ValueError) as info:  # rank 1 binds another count: its run checks it
        if comm.rank == 1:
            mar.allreduce(y, comm=comm, algorithm="shm")
        else:
            mar.allreduce(x, out, comm=comm, algorithm="shm")
    assert _same_everywhere(comm, info.value) == (
        f"allreduce called with different arguments on different ranks: count differs: 10 on "
        f"{_others(comm)}; 11 on rank 1")
    mar.allreduce(x, out, comm=comm, algorithm="shm")
    assert_matches_native(comm, x, out, MPI.SUM)


@pytest.mark.mpi(min_size=2)
def test_a_plan_and_a_checked_call_in_different_orders_raise_on_every_rank(dup):
    comm = dup
    x = contribution(comm, 10, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="shm")
    plan = mar.plan(x, np.empty_like(x), comm=comm, algorithm="shm")
    runs = [plan.run, lambda: mar.allreduce(x, out, comm=comm, algorithm="shm")]
    if comm.rank == 0:
        runs.reverse()
    with pytest.raises(ValueError) as info:
        runs[0]()
    assert "plan differs: " in _same_everywhere(comm, info.value)
    plan.run()  # the same order everywhere: fine again
    mar.allreduce(x, out, comm=comm, algorithm="shm")
    assert_matches_native(comm, x, out, MPI.SUM)
    assert_matches_native(comm, x, plan.recvbuf, MPI.SUM)
    plan.free()


@pytest.mark.mpi(min_size=2)
def test_a_missing_rank_times_out_a_checked_cached_call(monkeypatch):
    """The run is the check: a checked call's timeout names the missing rank as a run does."""
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)
    world = MPI.COMM_WORLD
    comm = world.Dup()
    x = contribution(comm, 100, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="shm", timeout=30)  # cached
    if comm.size > 1:  # the cached call runs the small regime's timed closure
        from mpiallreduce import _state
        assert _state.LAST[id(out)].timed is not None
    world.Barrier()
    message = None
    if comm.rank != 0:
        message = time_out_or_hear(
            lambda: mar.allreduce(x, out, comm=comm, algorithm="shm", timeout=0.5), 0.5)
        with pytest.raises(mar.CommunicatorRevoked, match="the communicator is revoked"):
            mar.allreduce(x, out, comm=comm, algorithm="shm")
    messages = world.allgather(message)
    assert all("no answer from rank(s) 0 in step 0" in m for m in timed_out(messages)), messages
    comm.Free()


def test_setting_a_constant_of_the_package_sets_it_where_it_is_read(monkeypatch):
    """``shm.X = value`` (as tests patch CLOSE_SECONDS, CHUNK_BYTES, FENCE, STALLS) sets the
    package's name and the room's that reads it; names of no room stay the package's own."""
    monkeypatch.setattr(shm, "CLOSE_SECONDS", 2.5)
    monkeypatch.setattr(shm, "CHUNK_BYTES", 4096)
    assert shm.CLOSE_SECONDS == shm.node.CLOSE_SECONDS == 2.5
    assert shm.CHUNK_BYTES == shm.protocol.CHUNK_BYTES == 4096
    assert shm.chunk_bytes(1) == 4096
    monkeypatch.undo()
    assert shm.node.CLOSE_SECONDS == shm.CLOSE_SECONDS == 10.0
    assert shm.protocol.CHUNK_BYTES == 512 << 10


def test_shared_empty_refuses_what_is_no_live_intracommunicator():
    """shared_empty checks its communicator first, as every entry point does: the same errors
    as mar.allreduce, on every rank, before anything collective."""
    with pytest.raises(TypeError, match="must be an mpi4py communicator"):
        shm.shared_empty(4, comm="world")
    with pytest.raises(ValueError, match="COMM_NULL"):
        shm.shared_empty(4, comm=MPI.COMM_NULL)


def test_headers_start_at_zero_over_a_dirty_shared_window(monkeypatch):
    """MPI does not promise that a shared window starts zeroed: a node zeroes its own header
    before its first barrier. Here every window a node allocates is filled with 0x7f bytes
    first (counters that look far ahead, signatures that differ), and calls of every regime
    still give comm.Allreduce's result on every rank."""
    allocate = shm.node.Node._allocate

    def dirty(node, nbytes):
        window = allocate(node, nbytes)
        np.frombuffer(window.Shared_query(node.rank)[0], np.uint8)[:] = 0x7F  # its own segment
        return window

    monkeypatch.setattr(shm.node.Node, "_allocate", dirty)
    comm = MPI.COMM_WORLD.Dup()
    try:
        for count in (1, 1000, shm.SMALL_BYTES // 8 + 3):
            for seed in range(3):  # new inputs every call
                x = contribution(comm, count, "float64", seed=seed)
                out = mar.allreduce(x, comm=comm, algorithm="shm", timeout=60)
                assert_matches_native(comm, x, out, MPI.SUM)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_seen_while_waiting_for_a_late_rank_raises_on_every_rank():
    """Ranks that run different calls raise on every rank: the late rank compares the
    signatures at once, the others in their wait for it (the first arrival's comparison)."""
    comm = MPI.COMM_WORLD.Dup()
    try:
        x = contribution(comm, 10 + comm.rank % 2, "float64")
        for late in (0, 1):
            if comm.rank == late:
                time.sleep(0.2)  # past every wait's spin: the others compare while they wait
            with pytest.raises(ValueError, match="count differs"):
                mar.allreduce(x, comm=comm, algorithm="shm", check=False)
        y = contribution(comm, 10, "float64", seed=1)  # the communicator goes on working
        assert_matches_native(comm, y, mar.allreduce(y, comm=comm, algorithm="shm"), MPI.SUM)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_chunked_plan_bound_before_the_window_grows_still_runs():
    """The large regime binds each parity at its first run: a plan made before a larger call
    grew the node's window slices the window it was made on, not the new one (it raised
    ValueError, offset past the buffer, and so revoked the communicator)."""
    comm = MPI.COMM_WORLD.Dup()  # a window of its own, at its smallest
    x = contribution(comm, 1 << 15, "float64")  # 256 KiB: the large regime, a 512 KiB window
    out = np.empty_like(x)
    plan = mar.plan(x, out, comm=comm, algorithm="shm")
    node = plan._node
    before = node.capacity
    big = contribution(comm, 1 << 19, "float64")  # 4 MiB: two 512 KiB chunks a slot
    mar.allreduce(big, comm=comm, algorithm="shm")
    assert node.capacity > before
    for _ in range(2):  # both parities, each bound now
        plan.run()
        assert_matches_native(comm, x, out, MPI.SUM)
    plan.free()
    comm.Free()
