"""The compiled and the pure-Python call path give the same bits and the same errors.

Run in either form (``MPIALLREDUCE_COMPILED=0`` selects Python; ``make test`` runs these files
in both): every case here is checked against a reference computed from every rank's input in
rank order with NumPy (the Python form's own arithmetic), so both forms meet the same bits."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _form

pytestmark = pytest.mark.mpi

#: inputs whose sum and product depend on the order of the operations (rounding), with signed
#: zeros, infinities and a NaN where asked
SPECIAL = [0.0, -0.0, 1e16, -1e16, 1.0, 3.0, 1e-300, 7.5, np.inf]


def _inputs(comm, count: int, dtype, special: bool) -> np.ndarray:
    rng = np.random.default_rng(1234 + 17 * comm.rank + count)
    x = (rng.standard_normal(count) * 10.0 ** rng.integers(-8, 9, count)).astype(dtype)
    if special:
        x[: len(SPECIAL)] = np.array(SPECIAL[:count], dtype=dtype)[: min(count, len(SPECIAL))]
        if comm.rank == comm.size - 1 and count > 2:
            x[2] = np.nan
    return x


def _reference(comm, x: np.ndarray, op: str) -> np.ndarray:
    """Every rank's input combined in rank order, one ufunc call per rank (the Python form)."""
    every = comm.allgather(x)
    total = every[0].copy()
    ufunc = {"PROD": np.multiply, "MAX": np.maximum}.get(op, np.add)
    for theirs in every[1:]:
        ufunc(total, theirs, out=total)
    if op == "AVG":
        np.divide(total, comm.size, out=total)
    return total


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


CASES = [("SUM", "float64"), ("AVG", "float64"), ("PROD", "float64"), ("SUM", "float32"),
         ("PROD", "float32"), ("SUM", "int64"), ("MAX", "float64")]


@pytest.mark.parametrize("op_name, dtype", CASES)
@pytest.mark.parametrize("count", [1, 2, 9, 1000])
def test_repeated_calls_give_rank_order_bits(op_name, dtype, count):
    """The first call binds, the next ones hit the cache (the compiled run where it is built),
    with and without a timeout, in place and out: every one gives the reference's bits. (shm:
    ``auto`` may pick a schedule that combines in another order where ranks outnumber cores.)"""
    comm = MPI.COMM_WORLD
    algorithm = "shm"
    op = mar.AVG if op_name == "AVG" else getattr(MPI, op_name)
    verdicts = []
    for special in (False, True):
        x = _inputs(comm, count, dtype, special and np.dtype(dtype).kind == "f")
        expected = _reference(comm, x, op_name)
        out = np.empty_like(x)
        inplace = np.empty_like(x)
        for timeout in (None, None, 30.0, None, 30.0):
            mar.allreduce(x, out, op=op, comm=comm, algorithm=algorithm, timeout=timeout)
            inplace[...] = x
            mar.allreduce(MPI.IN_PLACE, inplace, op=op, comm=comm, algorithm=algorithm,
                          timeout=timeout)
            verdicts.append(_same_bits(out, expected) and _same_bits(inplace, expected))
    everyone = comm.allgather(all(verdicts))
    assert all(everyone), f"ranks whose bits differ: {[r for r, ok in enumerate(everyone) if not ok]}"


def test_a_count_that_differs_raises_the_same_error_on_every_rank():
    """A repeated call whose count differs on one rank: the same ValueError everywhere (the
    compiled run's slow path is the Python form's)."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs two ranks")  # (uniform across ranks: the size is the world's)
    x, out = np.ones(4), np.empty(4)
    for _ in range(3):
        mar.allreduce(x, out, comm=comm, algorithm="shm")
    y, other = (np.ones(5), np.empty(5)) if comm.rank == 0 else (x, out)
    try:
        mar.allreduce(y, other, comm=comm, algorithm="shm")
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert messages[0] is not None and len(set(messages)) == 1, messages


def test_the_form_is_the_one_selected():
    """``MPIALLREDUCE_COMPILED=0`` selects Python; otherwise the compiled form where built (and
    where ``MPIALLREDUCE_EXPECT_COMPILED=1`` says it must be)."""
    import os

    if os.environ.get(_form.ENV, "1") == "0":
        assert _form.compiled is None
        assert mar.allreduce.__module__ == "mpiallreduce.api"
        return
    if os.environ.get("MPIALLREDUCE_EXPECT_COMPILED") == "1":
        # make test sets it where a C compiler exists: a build that failed quietly (the Python
        # form, the fallback) must not pass for the compiled form
        assert _form.compiled is not None, _form.REASON
    if _form.compiled is not None:
        assert mar.allreduce is _form.compiled.allreduce


def test_a_repeated_small_shm_call_runs_compiled_where_built():
    """Where the compiled form is active, a repeated 8-byte shm call's cache entry runs
    ``_compiled.SmallRun`` (with and without a timeout); in the Python form, the closures."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("one rank runs no shm epoch")  # (uniform across ranks)
    from mpiallreduce import _state

    x, out = np.ones(1), np.empty(1)
    for _ in range(2):
        mar.allreduce(x, out, comm=comm, algorithm="shm")
    entry = _state.LAST[id(out)]
    compiled = _form.compiled is not None
    kinds = {type(entry.direct).__name__, type(entry.timed).__name__}
    assert kinds == ({"SmallRun"} if compiled else {"function"}), kinds
    assert out[0] == comm.size


@pytest.mark.parametrize("op_name, dtype", [("SUM", "float64"), ("AVG", "float64"),
                                             ("PROD", "float32")])
def test_the_compiled_small_regime_reduces_in_c_at_every_size_of_it(op_name, dtype):
    """Where built, the small regime's run of float32 and float64 loads and reduces in C
    (``SmallRun.takes_pointers``) at every size of the regime, its largest too, not only up to
    1 KiB: past a size it does not take, each run would call NumPy's ufuncs, far slower at
    2 KiB. Every size gives the rank-order reference's bits on every rank."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("one rank runs no shm epoch")  # (uniform across ranks)
    from mpiallreduce.shm import small_bytes

    op = mar.AVG if op_name == "AVG" else getattr(MPI, op_name)
    itemsize = np.dtype(dtype).itemsize
    verdicts = []
    for nbytes in (8, 2048, small_bytes(comm.size)):
        x = _inputs(comm, nbytes // itemsize, dtype, True)
        if op_name == "PROD":  # products of many values stay finite and not 0
            x = (1.0 + x / (np.abs(x).max() * comm.size * 8)).astype(dtype)
        expected = _reference(comm, x, op_name)
        out = np.empty_like(x)
        plan = mar.plan(x, out, op, comm, "shm")
        try:
            plan.run()
            plan.run()
            in_c = bool(getattr(plan.direct, "takes_pointers", False))
        finally:
            plan.free()
        verdicts.append((nbytes, _same_bits(out, expected), in_c))
    everyone = comm.allgather(verdicts)
    assert all(same for mine in everyone for _, same, _ in mine), everyone
    assert all(in_c == (_form.compiled is not None) for mine in everyone
               for _, _, in_c in mine), everyone


def test_the_compiled_load_gives_the_bits_at_every_distance_from_its_slot():
    """The compiled small regime copies the input into its slot itself (memcpy, in pieces where
    the slot lies 1-63 bytes past the input modulo 4096, the band where glibc's ``rep movsb``
    crawls: ``shm.plan.trapped``). Inputs at page offsets across and around that band, fresh
    arrays and a plan's own, 32 KiB (past ``LOOP_COPY_BYTES``) and an odd size: every result
    has the reference's bits on every rank."""
    comm = MPI.COMM_WORLD
    from mpiallreduce.shm import small_bytes

    backing = np.empty(3 << 13)  # 3 pages of float64, and more
    start = (-backing.ctypes.data % 4096) // 8  # the first element on a page
    verdicts = []
    for count in (min(4096, small_bytes(comm.size) // 8), 1531):
        for offset in (0, 1, 2, 3, 7, 8, 256, 504, 505, 511):  # elements past a page
            x = backing[start + offset:start + offset + count]
            x[...] = _inputs(comm, count, "float64", False)
            expected = _reference(comm, x, "SUM")
            out = np.empty_like(x)
            plan = mar.plan(x, out, MPI.SUM, comm, "shm")
            try:
                plan.run()
            finally:
                plan.free()
            fresh = [mar.allreduce(x, comm=comm, algorithm="shm") for _ in range(3)]
            verdicts.append(_same_bits(out, expected)
                            and all(_same_bits(f, expected) for f in fresh))
    everyone = comm.allgather(all(verdicts))
    assert all(everyone), f"ranks whose bits differ: {[r for r, ok in enumerate(everyone) if not ok]}"


def _shape_of(comm, x: np.ndarray, in_place: bool, algorithm: str):
    """The shape ``_state.SHAPES`` holds for ``mar.allreduce`` calls like this one."""
    from mpiallreduce import _plans, _state

    return _state.SHAPES.get(_plans.shape_key(comm, MPI.IN_PLACE if in_place else x, x, MPI.SUM,
                                              algorithm, None, {}))


@pytest.mark.parametrize("op_name, dtype", CASES)
@pytest.mark.parametrize("count", [1, 3, 9])
def test_fresh_arrays_per_call_give_rank_order_bits(op_name, dtype, count):
    """``total = mar.allreduce(np.array([...]))`` and fresh pairs in and out of place, call after
    call (known by their shape after the first; the compiled form then runs the shape on the
    caller's arrays, no staging): every result has the reference's bits, and the inputs are
    left as they were."""
    comm = MPI.COMM_WORLD
    op = mar.AVG if op_name == "AVG" else getattr(MPI, op_name)
    x = _inputs(comm, count, dtype, np.dtype(dtype).kind == "f")
    expected = _reference(comm, x, op_name)
    verdicts = []
    for _ in range(5):
        source = x.copy()
        total = mar.allreduce(source, op=op, comm=comm, algorithm="shm")
        verdicts.append(_same_bits(total, expected) and _same_bits(source, x))
        out = np.full_like(x, 7)
        mar.allreduce(source, out, op=op, comm=comm, algorithm="shm")
        verdicts.append(_same_bits(out, expected) and _same_bits(source, x))
        inplace = x.copy()
        mar.allreduce(MPI.IN_PLACE, inplace, op=op, comm=comm, algorithm="shm")
        verdicts.append(_same_bits(inplace, expected))
    everyone = comm.allgather(all(verdicts))
    assert all(everyone), f"ranks whose bits differ: {[r for r, ok in enumerate(everyone) if not ok]}"


def test_fresh_arrays_run_the_shape_on_their_own_memory_where_compiled():
    """After two calls with fresh arrays the compiled form keeps the shape's compiled run
    (``Shape.small``), which it runs on the next call's arrays; the Python form stages."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("one rank runs no shm epoch")  # (uniform across ranks)
    for _ in range(3):
        mar.allreduce(np.array([1.0]), np.empty(1), comm=comm, algorithm="shm")
        mar.allreduce(MPI.IN_PLACE, np.array([1.0]), comm=comm, algorithm="shm")
    for in_place in (False, True):
        shape = _shape_of(comm, np.empty(1), in_place, "shm")
        assert shape is not None
        if _form.compiled is not None:
            assert type(shape.small).__name__ == "SmallRun"
        else:
            assert shape.small is None
    result = mar.allreduce(np.array([2.0 + comm.rank]), comm=comm, algorithm="shm")
    assert result[0] == sum(2.0 + r for r in range(comm.size))


def test_a_fresh_array_whose_count_differs_raises_the_same_error_on_every_rank():
    """Fresh arrays known by their shape on every rank but one, whose count differs: the same
    ValueError everywhere, in either form (the shape's run compares the call's headers)."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs two ranks")  # (uniform across ranks: the size is the world's)
    for _ in range(3):
        mar.allreduce(np.ones(2), np.empty(2), comm=comm, algorithm="shm")
    count = 3 if comm.rank == comm.size - 1 else 2
    try:
        mar.allreduce(np.ones(count), np.empty(count), comm=comm, algorithm="shm", timeout=60.0)
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert messages[0] is not None and len(set(messages)) == 1, messages


@pytest.mark.parametrize("algorithm", ["shm", "auto", "recursive_doubling"])
@pytest.mark.parametrize("in_place", [True, False])
def test_the_drop_in_with_a_new_spec_or_fresh_arrays_each_call(algorithm, in_place):
    """``mar.Comm.Allreduce`` with a new ``[memory, count, datatype]`` spec per call (a count
    shorter than the memory too) and with fresh arrays per call, in and out of place: each
    result equals plain mpi4py's ``Allreduce`` of the same input on every rank."""
    comm = MPI.COMM_WORLD
    drop_in = mar.Comm(comm, algorithm)
    ok = []
    for call in range(6):
        values = np.arange(5, dtype=np.float64) * (comm.rank + 1) + call
        expected = np.empty(3)
        comm.Allreduce(values[:3].copy(), expected)
        memory = values.copy()  # 5 elements; the spec takes 3
        spec = [MPI.memory.fromaddress(memory.ctypes.data, memory.nbytes), 3, MPI.DOUBLE]
        if in_place:
            drop_in.Allreduce(MPI.IN_PLACE, spec)
            ok.append(np.array_equal(memory[:3], expected) and np.array_equal(memory[3:],
                                                                              values[3:]))
        else:
            result = np.full(5, -1.0)
            drop_in.Allreduce(spec, [MPI.memory.fromaddress(result.ctypes.data, result.nbytes),
                                     3, MPI.DOUBLE])
            ok.append(np.array_equal(result[:3], expected) and np.all(result[3:] == -1.0)
                      and np.array_equal(memory, values))
        fresh = values[:3].copy()
        if in_place:
            drop_in.Allreduce(MPI.IN_PLACE, fresh)
            ok.append(np.array_equal(fresh, expected))
        else:
            out = np.empty(3)
            drop_in.Allreduce(fresh, out)
            ok.append(np.array_equal(out, expected) and np.array_equal(fresh, values[:3]))
    everyone = comm.allgather(all(ok))
    assert all(everyone), f"ranks with a wrong result: {[r for r, v in enumerate(everyone) if not v]}"


def test_the_drop_in_knows_fresh_arrays_by_their_element_type_alone():
    """``mar.Comm`` keeps the shapes of fresh arrays by the ``id`` of their dtype (held with the
    shape): fresh arrays of another element type of the same size, each call a new dtype object
    where NumPy makes one (byte-swapped float64, int64), never run a float64 shape; every result
    equals plain mpi4py's on every rank."""
    comm = MPI.COMM_WORLD
    drop_in = mar.Comm(comm, "auto")
    ok = []
    for call in range(4):
        for dtype in (np.float64, np.dtype(">f8"), np.int64, np.float64):
            values = (np.arange(4) * (comm.rank + 1) + call).astype(np.float64)
            expected = np.empty(4)
            comm.Allreduce(values, expected)
            fresh = values.astype(dtype)  # a new array (and, byte-swapped, a new dtype object)
            if fresh.dtype.isnative:
                drop_in.Allreduce(MPI.IN_PLACE, fresh)
            else:  # mpi4py refuses a byte-swapped buffer; the drop-in must do as mpi4py does
                try:
                    drop_in.Allreduce(MPI.IN_PLACE, fresh)
                except Exception as exc:  # noqa: BLE001 - compared with plain mpi4py's refusal
                    theirs = None
                    try:
                        comm.Allreduce(MPI.IN_PLACE, values.astype(dtype))
                    except Exception as plain:  # noqa: BLE001
                        theirs = type(plain)
                    ok.append(type(exc) is theirs)
                    continue
            ok.append(fresh.dtype == dtype and np.array_equal(fresh.astype(np.float64), expected))
    everyone = comm.allgather(all(ok))
    assert all(everyone), f"ranks with a wrong result: {[r for r, v in enumerate(everyone) if not v]}"


def test_the_drop_in_with_a_spec_past_its_memory_does_as_mpi4py():
    """A spec whose count runs past its memory object (mpi4py trusts the count and reads on),
    after calls that made its shape known: the drop-in hands it to MPI, which gives what plain
    mpi4py gives, on every rank."""
    comm = MPI.COMM_WORLD
    drop_in = mar.Comm(comm, "shm")
    memory = np.ones(2)
    for _ in range(3):
        drop_in.Allreduce(MPI.IN_PLACE, [MPI.memory.fromaddress(memory.ctypes.data, 16), 2,
                                         MPI.DOUBLE])
    results = []
    for c in (comm, drop_in):
        values = np.array([1.0 + comm.rank, 2.0])  # 16 bytes; the memory object names 8
        c.Allreduce(MPI.IN_PLACE, [MPI.memory.fromaddress(values.ctypes.data, 8), 2, MPI.DOUBLE])
        results.append(values)
    everyone = comm.allgather(np.array_equal(results[0], results[1]))
    assert all(everyone), (results, everyone)


@pytest.mark.parametrize("algorithm", ["shm", "auto", "recursive_doubling", "native"])
def test_repeated_iallreduce_and_start_give_the_reference(algorithm):
    """``iallreduce(...).wait()`` and ``start(plan).wait()`` call after call (the compiled form's
    twins where built: an shm run whole at the start, the same complete request every start):
    each result is the reference's, ``wait()`` again returns it, in and out of place."""
    comm = MPI.COMM_WORLD
    x = _inputs(comm, 3, "float64", False)
    expected = _reference(comm, x, "SUM")
    out, inplace = np.empty_like(x), np.empty_like(x)
    ok = []
    with mar.plan(x, out, comm=comm, algorithm=algorithm) as bound:
        for _ in range(4):
            request = mar.iallreduce(x, out, comm=comm, algorithm=algorithm)
            ok.append(request.wait() is out and np.allclose(out, expected, rtol=1e-12, atol=0))
            ok.append(request.wait() is out and request.done)
            inplace[...] = x
            result = mar.iallreduce(MPI.IN_PLACE, inplace, comm=comm, algorithm=algorithm).wait()
            ok.append(result is inplace and np.allclose(inplace, expected, rtol=1e-12, atol=0))
            out[...] = 0
            request = mar.start(bound)
            ok.append(request.wait() is out and np.allclose(out, expected, rtol=1e-12, atol=0))
    everyone = comm.allgather(all(ok))
    assert all(everyone), f"ranks with a wrong result: {[r for r, v in enumerate(everyone) if not v]}"


def test_start_of_a_freed_plan_raises_on_every_rank():
    """A plan started after ``free()``: ValueError (the compiled start's checks are the run's)."""
    comm = MPI.COMM_WORLD
    x, out = np.ones(1), np.empty(1)
    bound = mar.plan(x, out, comm=comm, algorithm="shm")
    for _ in range(2):
        mar.start(bound).wait()
    bound.free()
    with pytest.raises(ValueError):
        mar.start(bound)


def test_the_non_blocking_entry_points_are_the_selected_form():
    """Where the compiled form is active, ``iallreduce``, ``start`` and a request's ``wait``
    are its twins; in the Python form, the package's functions."""
    from mpiallreduce.nonblocking import Request

    if _form.compiled is not None:
        assert mar.iallreduce is _form.compiled.iallreduce
        assert mar.start is _form.compiled.start
        assert Request.wait is _form.compiled.RequestFields.wait
    else:
        assert mar.iallreduce.__module__ == "mpiallreduce.api"
        assert mar.start.__module__ == "mpiallreduce.nonblocking.calls"


def test_the_compiled_start_runs_a_small_shm_plan_itself_and_hands_every_other_start_on():
    """The compiled ``start`` runs a small shm plan without deadline itself (reading the plan's
    fields from its instance dict) once the first start made its complete request, and hands
    the Python ``start`` a plan with a timeout of its own, or one whose communicator broke
    (which refuses it: CommunicatorRevoked on every rank)."""
    comm = MPI.COMM_WORLD
    if _form.compiled is None or comm.size < 2:
        pytest.skip("the compiled start's own branch runs where the compiled form builds "
                    "SmallRun (two ranks at least)")  # (uniform across ranks)
    from mpiallreduce import _state
    from mpiallreduce.nonblocking import calls

    handed, python_start = [], calls.start.__wrapped__

    def spy(plan, timeout=None):
        handed.append(plan)
        return python_start(plan, timeout)

    x, out = np.full(1, 1.0 + comm.rank), np.empty(1)
    private = comm.Dup()
    bound = mar.plan(x, out, comm=private, algorithm="shm")
    timed = mar.plan(x, np.empty(1), comm=private, algorithm="shm", timeout=30.0)
    _form.compiled.install_nonblocking(spy, calls._bind, calls._DROPPED, calls._tidy)
    try:
        for _ in range(3):
            out[0] = np.nan
            assert mar.start(bound).wait() is out and out[0] == comm.size * (comm.size + 1) / 2
        mine = list(handed)
        mar.start(timed).wait()
        took_timed = handed[-1:] == [timed]
        _state.existing(private).broken = "a test marked it"
        with pytest.raises(mar.CommunicatorRevoked, match="a test marked it"):
            mar.start(bound)
        took_broken = handed[-1] is bound
    finally:
        _form.compiled.install_nonblocking(python_start, calls._bind, calls._DROPPED,
                                           calls._tidy)
        _state.existing(private).broken = None
        timed.free()
        bound.free()
        private.Free()
    # (the first start makes the plan's complete request: the Python start's)
    assert mine == [bound] and took_timed and took_broken, (mine, took_timed, took_broken)
