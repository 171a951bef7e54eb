"""reproducible=True and mar.sum/dot/norm2: the same bits for every algorithm, rank order and
split, checked against exact sums (fractions) of the gathered contributions. Run under mpirun
with --with-mpi."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from conftest import GRID_KINDS, assert_identical_across_ranks
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.partition import block

pytestmark = pytest.mark.mpi

DTYPES = ["float64", "float32", "complex128", "complex64"]
REAL = {"float64": np.float64, "float32": np.float32, "complex128": np.float64,
        "complex64": np.float32}


def rounded(exact: Fraction, dtype) -> float:
    """``exact`` rounded to nearest, ties to even, in float64 or float32 (inf past the range)."""
    dtype = np.dtype(dtype)
    try:
        near = float(exact)  # Fraction -> float64 is correctly rounded
    except OverflowError:
        return math.inf if exact > 0 else -math.inf
    if dtype == np.float64:
        return near
    candidate = np.float32(near)  # may be a double rounding: look at both neighbours
    best = None
    for value in (np.nextafter(candidate, np.float32(-np.inf)), candidate,
                  np.nextafter(candidate, np.float32(np.inf))):
        if not np.isfinite(value):
            continue
        error = abs(Fraction(float(value)) - exact)
        even = not (int(np.float32(value).view(np.uint32)) & 1)
        if best is None or error < best[0] or (error == best[0] and even):
            best = (error, float(value))
    limit = Fraction(2) ** 128 * (1 - Fraction(1, 2 ** 25))  # halfway to 2**128: overflow
    if abs(exact) >= limit:
        return math.inf if exact > 0 else -math.inf
    return best[1]


def reference(columns: np.ndarray, dtype) -> np.ndarray:
    """The correctly rounded sum of each column of finite values (rows: contributions)."""
    real = np.dtype(REAL[np.dtype(dtype).name])
    return np.array([rounded(np.add.reduce([Fraction(float(v)) for v in column], dtype=object)
                             if column.size else Fraction(0), real) for column in columns.T],
                    dtype=real)


def adversarial(comm_rank: int, count: int, dtype, seed: int = 0, span: int | None = None
                ) -> np.ndarray:
    """Values whose sums depend on the order: magnitudes in [2**-span, 2**span), mixed signs.

    The default span keeps every element within the range its format holds exactly (31
    binades below the largest for float64, 18 for float32), so results are correctly rounded.
    """
    rng = np.random.default_rng([seed, comm_rank + 1, count])
    real = REAL[np.dtype(dtype).name]
    if span is None:
        span = 15 if real is np.float64 else 9
    parts = []
    for _ in range(2 if np.dtype(dtype).kind == "c" else 1):
        values = (rng.choice([-1.0, 1.0], count) * rng.uniform(1, 2, count)
                  * np.exp2(rng.integers(-span, span, count)))
        parts.append(values.astype(real))
    if len(parts) == 2:
        return (parts[0] + 1j * parts[1].astype(np.float64)).astype(dtype)
    return parts[0].astype(dtype)


def permuted(comm: MPI.Intracomm, how: str) -> MPI.Intracomm:
    """The same processes in another rank order (``comm.Split`` with permuted keys)."""
    if how == "reversed":
        return comm.Split(0, comm.size - 1 - comm.rank)
    order = np.random.default_rng(comm.size).permutation(comm.size)
    return comm.Split(0, int(order[comm.rank]))


def options(comm, algorithm):
    if algorithm == "hierarchical":
        return {"topology": mar.Topology.simulated(comm, ranks_per_node=2)}
    if algorithm == "cascade":
        return {"topology": mar.Topology.simulated(comm, ranks_per_node=3)}
    if algorithm == "ring_segmented":
        return {"segment_bytes": 256}
    return {}


def bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("comm", GRID_KINDS, indirect=True)
@pytest.mark.parametrize("op", [MPI.SUM, mar.AVG], ids=["SUM", "AVG"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_for_every_algorithm_and_rank_order(comm, dtype, op):
    count = 3 * comm.size + 7
    x = adversarial(MPI.COMM_WORLD.rank, count, dtype)  # tied to the process, not the rank
    results = {}
    orders = {"plain": comm, "reversed": permuted(comm, "reversed"),
              "shuffled": permuted(comm, "shuffled")}
    try:
        for order, sub in orders.items():
            for algorithm in mar.ALGORITHMS:
                out = mar.allreduce(x, np.empty_like(x), op=op, comm=sub, algorithm=algorithm,
                                    reproducible=True, **options(sub, algorithm))
                results[order, algorithm] = bits(out)
    finally:
        for order, sub in orders.items():
            if order != "plain":
                sub.Free()
    first = results["plain", "native"]
    differ = [key for key, value in results.items() if value != first]
    assert not differ, f"rank {comm.rank}: {differ} differ from native"
    assert_identical_across_ranks(comm, np.frombuffer(first, dtype=np.uint8))
    # exact: within its span the 84 (float32: 42) bits hold every contribution
    real = x.view(REAL[dtype]).astype(np.float64)
    columns = np.array(comm.allgather(real))
    want = reference(columns, REAL[dtype])
    got = np.frombuffer(first, dtype=x.dtype).view(REAL[dtype])
    if op is mar.AVG:
        want = (want / comm.size).astype(want.dtype)
    assert np.array_equal(got, want), f"{np.flatnonzero(got != want)[:5]}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_ranks_sum_unconverted_with_the_bits_of_the_conversion(dtype, monkeypatch):
    """At one or two ranks the elementwise sum is the algorithm's own SUM (two contributions
    are added once, in either order alike); where every contribution fits the conversion's
    words, the conversion (forced with PAIR_RANKS = 0) gives the same correctly rounded bits,
    special values, -0 and AVG included. (At more ranks both runs convert.)"""
    comm = MPI.COMM_WORLD
    x = adversarial(comm.rank, 2 * comm.size + 301, dtype, seed=12)
    real = x.view(REAL[dtype])
    real[:6] = [np.nan if comm.rank == 0 else 1.0, -0.0, np.inf, 0.0 if comm.rank else -0.0,
                np.finfo(real.dtype).max, np.finfo(real.dtype).smallest_subnormal]
    for op in (MPI.SUM, mar.AVG):
        plain = {name: bits(mar.allreduce(x, None, op=op, algorithm=name, reproducible=True))
                 for name in ("native", "ring", "shm")}
        monkeypatch.setattr(mar.reproducible.elementwise, "PAIR_RANKS", 0)
        converted = {name: bits(mar.allreduce(x, None, op=op, algorithm=name,
                                              reproducible=True))
                     for name in ("native", "ring", "shm")}
        monkeypatch.undo()
        assert len(set(plain.values()) | set(converted.values())) == 1, op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [5, 300, 70_001])
def test_the_compiled_conversion_gives_the_numpy_bits(dtype, size, monkeypatch):
    """The elementwise conversion compiled (Numba, where installed) and in NumPy, on alternate
    ranks and on all: the same keys and words, so the same bits (forced at every rank count
    with PAIR_RANKS = 0; wide magnitudes, the largest floats, specials, -0, AVG)."""
    from mpiallreduce.reproducible import _exact

    comm = MPI.COMM_WORLD
    wide = REAL[dtype] == np.float64
    x = adversarial(comm.rank, size, dtype, seed=21, span=200 if wide else 60)
    real = x.view(REAL[dtype])
    real[:4] = [np.finfo(real.dtype).max, -0.0, np.finfo(real.dtype).smallest_subnormal,
                np.inf if comm.rank == comm.size - 1 else 2.0]
    monkeypatch.setattr(mar.reproducible.elementwise, "PAIR_RANKS", 0)
    found = {}
    for forms in ("compiled", "numpy", "mixed"):
        if forms == "numpy" or (forms == "mixed" and comm.rank % 2):
            monkeypatch.setattr(_exact, "_KERNEL", [None])
        for op in (MPI.SUM, mar.AVG):
            found[forms, op.py2f() if op is MPI.SUM else "avg"] = bits(
                mar.allreduce(x, np.empty_like(x), op=op, algorithm="ring", reproducible=True))
        monkeypatch.setattr(_exact, "_KERNEL", list(_exact._KERNEL[:0]))  # decide again
    for op in {key[1] for key in found}:
        assert found["compiled", op] == found["numpy", op] == found["mixed", op]


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_plan_iallreduce_and_in_place_give_the_same_bits(in_place):
    comm = MPI.COMM_WORLD
    x = adversarial(comm.rank, 1001, "float64", seed=3, span=60)
    want = mar.allreduce(x, np.empty_like(x), algorithm="native", reproducible=True)
    buf = x.copy()
    sendbuf = MPI.IN_PLACE if in_place else x
    out = np.empty_like(x) if not in_place else buf
    with mar.plan(sendbuf, out, algorithm="ring", reproducible=True) as plan:
        for _ in range(3):
            np.copyto(buf, x)
            assert bits(plan.run()) == bits(want)
        np.copyto(buf, x)
        assert bits(plan.start().wait()) == bits(want)
    np.copyto(buf, x)
    request = mar.iallreduce(sendbuf, out, algorithm="recursive_doubling", reproducible=True)
    assert bits(request.wait()) == bits(want)
    for timeout in (None, None, 30.0, None):  # the cached one-shot plan, data changed between
        np.copyto(buf, x)
        assert bits(mar.allreduce(sendbuf, out, algorithm="rabenseifner", reproducible=True,
                                  timeout=timeout)) == bits(want)
    with mar.plan(sendbuf, out, algorithm="tree", reproducible=True, timeout=30.0) as plan:
        np.copyto(buf, x)
        assert bits(plan.run()) == bits(want)


@pytest.mark.parametrize("check", [True, False])
def test_repeated_small_calls_and_every_path_agree_elementwise(check):
    """An element's result depends on its own contributions only: the same through the small
    path (keys inside the argument check, units from tables), the middle one (tables, keys
    apart) and the large one (units computed), in repeated cached calls with new data."""
    comm = MPI.COMM_WORLD
    x = adversarial(comm.rank, 700, "float64", seed=8, span=300)
    x[:5] = [0.0, -0.0, 5e-324, np.inf if comm.rank == 0 else 1.0, 1e300]
    whole = mar.allreduce(x, np.empty_like(x), algorithm="native", reproducible=True)
    for count in (3, 64, 65, 256, 257):
        out = np.empty(count)
        part = np.empty(count)
        for shift in range(3):  # the same arrays, new contents: the cached entry runs
            np.copyto(part, np.roll(x, shift)[:count])
            got = mar.allreduce(part, out, algorithm="ring", reproducible=True, check=check)
            want = np.roll(whole, shift)[:count]
            assert bits(got) == bits(want), (count, shift)


def fsum_columns(comm, x: np.ndarray) -> np.ndarray:
    """Every element's correctly rounded sum over the ranks (float64)."""
    columns = np.array(comm.allgather(x))
    return np.array([math.fsum(column) for column in columns.T])


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_cached_calls_with_new_contents_at_every_count(in_place):
    """The one-shot call bound on the first call runs again on the same arrays with new
    contents: counts 0, 1 (the one-value path), below p, past the shared-memory transport's
    small regime (words in node-shared scratch) and large; each result correctly rounded."""
    comm = MPI.COMM_WORLD
    for count in sorted({0, 1, max(comm.size - 1, 1), 2049, 70_001}):
        buf = np.empty(count)
        out = buf if in_place else np.empty(count)
        sendbuf = MPI.IN_PLACE if in_place else buf
        for seed in range(3):
            x = adversarial(comm.rank, count, "float64", seed=seed)
            np.copyto(buf, x)
            got = mar.allreduce(sendbuf, out, reproducible=True)
            assert got is out
            assert np.array_equal(got, fsum_columns(comm, x)), (count, seed)


def one_value_cases(rank: int, p: int) -> list[float]:
    """This rank's contribution to each one-value case: special values, -0, subnormals, sums
    near and past overflow, and spans wider than the vector program's 84 bits, where only an
    exact sum rounds right (the first: 1 + 2**-51 on rank 0 and 2**-53 + 2**-105 on rank 1 sum
    to just above a tie, which the 84-bit words cut to the tie and round to even: down)."""
    last = rank == p - 1
    big = float(np.finfo(np.float64).max)
    cases = [(1 + 2.0 ** -51) if rank == 0 else (2.0 ** -53 + 2.0 ** -105 if rank == 1 else 0.0),
             0.0, -0.0, -0.0 if rank else 0.0, 5e-324 * (rank + 1), -5e-324 if rank == 0 else 0.0,
             math.inf if rank == 0 else 1.0, math.nan if last else 2.0,
             math.inf if rank == 0 else (-math.inf if last else 1.0), big / 2,
             -big if rank == 0 else big, big if rank < 2 else -big, 2.0 ** -1000,
             1e-310 * (-1) ** rank, 2.0 ** 1000 * (-1) ** rank + 2.0 ** -1000 * (rank + 1)]
    rng = np.random.default_rng([11, rank])
    cases += list(rng.standard_normal(3) * np.exp2(rng.integers(-1000, 1000, 3)))
    return cases


def exact_rounded(column) -> float:
    """IEEE addition's special values, else the exact sum rounded once (the reference)."""
    if any(math.isnan(v) for v in column) or (math.inf in column and -math.inf in column):
        return math.nan
    if math.inf in column or -math.inf in column:
        return math.inf if math.inf in column else -math.inf
    if all(v == 0 for v in column):
        return -0.0 if all(math.copysign(1, v) < 0 for v in column) else 0.0
    return rounded(np.add.reduce([Fraction(v) for v in column], dtype=object), np.float64)


@pytest.mark.parametrize("check", [True, False])
def test_one_value_calls_are_correctly_rounded_on_every_path(check):
    """One float64 on at most GATHER_RANKS ranks: the values themselves are gathered and
    summed exactly, so every path gives the correctly rounded sum (special values as IEEE
    addition gives them), bit for bit: every algorithm (shm reading the peers' slots, the
    others gathering through a SUM with -0), the check carried over shared memory or not,
    cached entries, fresh arrays, in place, plans, requests, AVG and the drop-in."""
    comm = MPI.COMM_WORLD
    p = comm.size
    cases = one_value_cases(comm.rank, p)
    want = [exact_rounded(column) for column in zip(*comm.allgather(cases))]
    one, out = np.empty(1), np.empty(1)
    drop_in = mar.Comm(comm, reproducible=True, check=check)
    for algorithm in ["shm", "auto", "native", "ring", "recursive_doubling", "tree"]:
        for index, (value, expected) in enumerate(zip(cases, want)):
            got = []
            for _ in range(2):  # bound, then the cached entry
                one[0] = value
                got.append(mar.allreduce(one, out, reproducible=True, check=check,
                                         algorithm=algorithm)[0])
            got.append(mar.allreduce(np.array([value]), None, reproducible=True,
                                     check=check, algorithm=algorithm)[0])
            one[0] = value
            got.append(mar.allreduce(MPI.IN_PLACE, one, reproducible=True, check=check,
                                     algorithm=algorithm)[0])
            with mar.plan(np.array([value]), out, reproducible=True, check=check,
                          algorithm=algorithm) as plan:
                got.append(plan.run()[0])
                got.append(plan.start().wait()[0])
            got.append(mar.iallreduce(np.array([value]), out, reproducible=True, check=check,
                                      algorithm=algorithm).wait()[0])
            if algorithm == "auto":
                drop_in.Allreduce(np.array([value]), out)
                got.append(out[0])
                request = drop_in.Allreduce_init(np.array([value]), out)
                request.Start()
                request.Wait()
                request.Free()
                got.append(out[0])
            for result in got:
                assert (math.isnan(result) and math.isnan(expected)) or (
                    np.float64(result).tobytes() == np.float64(expected).tobytes()), (
                    algorithm, index, value, result, expected)
        avg = mar.allreduce(np.array([cases[0]]), None, op=mar.AVG, reproducible=True,
                            check=check, algorithm=algorithm)[0]
        assert avg == want[0] / p, algorithm


@pytest.mark.mpi(min_size=2)
def test_one_value_call_disagreeing_on_reproducible_raises_everywhere():
    comm = MPI.COMM_WORLD
    one, out = np.ones(1), np.empty(1)
    for _ in range(2):  # the first call binds, the second runs the cached entry
        mar.allreduce(one, out, reproducible=True)
    with pytest.raises(ValueError, match="differ"):
        mar.allreduce(one, out, reproducible=comm.rank == 0)
    with pytest.raises(ValueError, match="differ"):
        mar.allreduce(one, out, op=mar.AVG if comm.rank == 0 else MPI.SUM, reproducible=True)
    assert mar.allreduce(one, out, reproducible=True)[0] == comm.size
    # a cached call on some ranks, fresh arrays on others: the key rides in both checks alike
    for step in range(4):
        one[0] = 2.0 ** (step * 300 - 600) * (comm.rank + 1)
        fresh = comm.rank % 2 == 1
        got = mar.allreduce(one.copy() if fresh else one, np.empty(1) if fresh else out,
                            reproducible=True)
        assert got[0] == 2.0 ** (step * 300 - 600) * comm.size * (comm.size + 1) / 2


def test_plans_sharing_the_node_scratch_keep_their_bits():
    """Plans whose words' sum runs on the shared-memory transport share one node-shared
    scratch, which grows for a larger plan while the smaller ones keep theirs: alternate runs
    of plans and calls of several sizes, and a plan freed in between, give the bits of a
    schedule that uses no shared memory."""
    comm = MPI.COMM_WORLD
    sizes = (3000, 20_000, 90_000)
    inputs = {size: adversarial(comm.rank, size, "float64", seed=size, span=200)
              for size in sizes}
    want = {size: mar.allreduce(x, None, algorithm="ring", reproducible=True)
            for size, x in inputs.items()}
    plans = {}
    for size in sizes:  # the scratch grows with each
        plans[size] = mar.plan(inputs[size], np.empty(size), reproducible=True,
                               algorithm="shm" if comm.size > 1 else "auto")
        assert bits(plans[size].run()) == bits(want[size])
    outs = {size: np.empty(size) for size in sizes}
    for size in reversed(sizes):
        for _ in range(2):
            assert bits(plans[size].run()) == bits(want[size])
            assert bits(mar.allreduce(inputs[size], outs[size], reproducible=True)) == \
                bits(want[size])
    plans.pop(20_000).free()
    for size, plan in plans.items():
        assert bits(plan.run()) == bits(want[size])
        plan.free()
    with mar.plan(np.zeros(0), np.empty(0), reproducible=True) as empty:
        assert empty.run().size == 0
    complex_x = adversarial(comm.rank, 5000, "complex128", seed=7)
    assert bits(mar.allreduce(complex_x, None, op=mar.AVG, reproducible=True)) == bits(
        mar.allreduce(complex_x, None, op=mar.AVG, algorithm="tree", reproducible=True))


@pytest.mark.parametrize("count", [0, 1, 2, 5, 100_003])
def test_awkward_counts(count):
    comm = MPI.COMM_WORLD
    x = adversarial(comm.rank, count, "float64", seed=count)
    outs = [bits(mar.allreduce(x, None, algorithm=a, reproducible=True, **options(comm, a)))
            for a in ("native", "ring", "tree", "hierarchical")]
    assert len(set(outs)) == 1
    if count:
        columns = np.array(comm.allgather(x))
        got = np.frombuffer(outs[0], dtype=np.float64)
        fsum = np.array([math.fsum(c) for c in columns.T])
        assert np.array_equal(got, fsum)


def test_wide_range_stays_within_its_bound():
    """Magnitudes 2**-1000..2**1000 with cancellation: beyond 31 binades below an element's
    largest contribution, the error is at most p * 2**(e_max - 84) plus half an ulp."""
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng([9, comm.rank])
    count = 4000
    x = rng.standard_normal(count) * np.exp2(rng.integers(-1000, 1000, count))
    x[::7] = -x[::7] if comm.rank % 2 else x[::7]  # pairs that cancel
    out = mar.allreduce(x, None, algorithm="ring", reproducible=True)
    assert bits(out) == bits(mar.allreduce(x, None, algorithm="native", reproducible=True))
    columns = np.array(comm.allgather(x))
    for index in range(count):
        column = columns[:, index]
        exact = np.add.reduce([Fraction(float(v)) for v in column], dtype=object)
        e_max = math.frexp(float(np.abs(column).max()))[1]
        bound = comm.size * Fraction(2) ** max(e_max - 84, -1074)
        got = Fraction(float(out[index]))
        ulp = Fraction(math.ulp(float(out[index])))
        assert abs(got - exact) <= bound + ulp / 2, index


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_special_values_as_ieee_addition(dtype):
    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    real = np.dtype(dtype)
    big = np.finfo(real).max
    tiny = np.finfo(real).smallest_subnormal
    last = rank == p - 1
    x = np.array([
        np.nan if rank == 0 else 1.0,               # NaN anywhere: NaN
        np.inf if rank == 0 else (-np.inf if last and p > 1 else 2.0),  # +inf and -inf: NaN
        -np.inf if rank == 0 else 3.0,              # one infinity: it
        big,                                        # overflow of the true sum: inf (p > 1)
        big if rank < 2 else (-big if rank == 2 else 0.0),  # overflow midway, not in total
        -0.0,                                       # -0 everywhere: -0
        -0.0 if rank else 0.0,                      # +0 with -0: +0
        tiny * (rank + 1),                          # subnormals, exact
        -tiny if rank == 0 else (tiny if last else 0.0),  # subnormals cancelling: +0
        (1 << 100) * (-1) ** rank,                  # large cancelling values
    ], dtype=real)
    got = mar.allreduce(x, None, algorithm="ring", reproducible=True)
    assert bits(got) == bits(mar.allreduce(x, None, algorithm="native", reproducible=True))
    in_place = x.copy()  # the input is overwritten by the result: -0 is still decided right
    assert bits(mar.allreduce(MPI.IN_PLACE, in_place, algorithm="tree",
                              reproducible=True)) == bits(got)
    nan = float("nan")
    want = [nan, nan if p > 1 else np.inf, -np.inf, np.inf if p > 1 else big,
            np.inf if p == 2 else big, -0.0, 0.0 if p > 1 else 0.0,
            tiny * p * (p + 1) / 2, 0.0 if p > 1 else -tiny,
            0.0 if p % 2 == 0 else float(1 << 100)]
    want = np.array(want, dtype=real)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite], want[finite]), (got, want)
    assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite])), (got, want)


@pytest.mark.parametrize("op, dtype", [(MPI.MAX, "float64"), (MPI.MIN, "float32"),
                                       (MPI.PROD, "float64"), (MPI.SUM, "int64"),
                                       (mar.AVG, "int32")])
def test_other_ops_and_dtypes_raise_value_error_on_every_rank(op, dtype):
    comm = MPI.COMM_WORLD
    x = np.ones(4, dtype=dtype)
    with pytest.raises((ValueError, TypeError)) as info:
        mar.allreduce(x, None, op=op, comm=comm, reproducible=True)
    if not (op is mar.AVG and dtype == "int32"):  # AVG on integers: not defined at all
        assert info.type is ValueError
        assert "reproducible" in str(info.value) and "exact" in str(info.value)
    with pytest.raises((ValueError, TypeError)):
        mar.plan(x, None, op=op, comm=comm, reproducible=True)
    # the communicator still works afterwards
    assert mar.allreduce(np.ones(2), None, reproducible=True)[0] == comm.size


@pytest.mark.mpi(min_size=2)
def test_ranks_disagreeing_on_reproducible_raise_everywhere():
    comm = MPI.COMM_WORLD
    x = np.ones(3)
    with pytest.raises(ValueError, match="differ"):
        mar.allreduce(x, np.empty_like(x), reproducible=comm.rank == 0)
    assert mar.allreduce(x, None, reproducible=True)[0] == comm.size
    # a cached call on some ranks, fresh arrays on others: one check of one size, same result
    out = np.empty_like(x)
    for _ in range(3):
        fresh = comm.rank % 2 == 1
        got = mar.allreduce(x.copy() if fresh else x, np.empty_like(x) if fresh else out,
                            reproducible=True)
        assert got[0] == comm.size
    with pytest.raises(ValueError, match="differ"):
        if comm.rank == 0:
            mar.sum(x, comm=comm)
        else:
            mar.dot(x, x, comm=comm)
    assert float(mar.sum(x, comm=comm)) == 3 * comm.size


# -- mar.sum, mar.dot, mar.norm2: the same bits for any split ----------------------------------------

def global_vector(count: int, dtype, seed: int = 5, span: int = 7) -> np.ndarray:
    """The same vector on every rank (seeded by nothing rank-dependent)."""
    return adversarial(-1, count, dtype, seed=seed, span=span)


def splits(comm, count: int):
    """This rank's slice under a block split and under an uneven one (some ranks empty)."""
    yield block(count, comm.size, comm.rank)
    rng = np.random.default_rng(count)
    cuts = np.sort(rng.integers(0, count + 1, comm.size - 1))
    edges = [0, *cuts.tolist(), count]
    yield edges[comm.rank], edges[comm.rank + 1]
    yield (0, count) if comm.rank == comm.size - 1 else (0, 0)  # all on the last rank


@pytest.mark.parametrize("comm", GRID_KINDS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [0, 1, 17, 10_007])
def test_sum_dot_norm2_independent_of_the_split(comm, dtype, count):
    x = global_vector(count, dtype)
    y = global_vector(count, dtype, seed=6)
    alone = (bits(mar.sum(x, comm=MPI.COMM_SELF)), bits(mar.dot(x, y, comm=MPI.COMM_SELF)),
             bits(mar.norm2(x, comm=MPI.COMM_SELF)))
    for start, stop in splits(comm, count):
        got = (bits(mar.sum(x[start:stop], comm=comm)),
               bits(mar.dot(x[start:stop], y[start:stop], comm=comm, algorithm="ring")),
               bits(mar.norm2(x[start:stop], comm=comm)))
        assert got == alone
    # and against exact sums: the sum and the sum of the (rounded) products
    real = REAL[dtype]
    parts = x.view(real).reshape(-1, 2) if np.dtype(dtype).kind == "c" else x.view(real)[:, None]
    want = [rounded(np.add.reduce([Fraction(float(v)) for v in parts[:, k]] or [Fraction(0)]),
                    real) for k in range(parts.shape[1])]
    total = mar.sum(x, comm=MPI.COMM_SELF)
    assert [float(total.real), float(total.imag)][:len(want)] == want
    if np.dtype(dtype).kind == "f":
        products = x.astype(np.float64) * y.astype(np.float64)
        exact = np.add.reduce([Fraction(float(v)) for v in products] or [Fraction(0)])
        assert float(mar.dot(x, y, comm=MPI.COMM_SELF)) == rounded(exact, real)


def test_million_values_with_heavy_cancellation_match_fsum():
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(11)
    half = rng.uniform(-2, 2, 500_000) * np.exp2(rng.integers(-12, 12, 500_000))
    values = np.concatenate([half, -half[::-1] * (1 + 2.0 ** -40), [1e-3]])
    start, stop = block(values.size, comm.size, comm.rank)
    got = mar.sum(values[start:stop], comm=comm)
    assert float(got) == math.fsum(values)
    assert bits(got) == bits(mar.sum(values, comm=MPI.COMM_SELF))


def test_sum_over_the_whole_range_is_correctly_rounded():
    """Magnitudes 2**-1000..2**1000 and subnormals: the exact sum, rounded once (before the
    local totals were exact, the error was bounded by N * 2**(e_max - 84) + ulp/2)."""
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(12)
    values = rng.standard_normal(20_000) * np.exp2(rng.integers(-1000, 1000, 20_000))
    values[:100] = np.finfo(np.float64).smallest_subnormal * rng.integers(-50, 50, 100)
    values[100:200] = -values[200:300]
    start, stop = block(values.size, comm.size, comm.rank)
    got = float(mar.sum(values[start:stop], comm=comm))
    exact = np.add.reduce([Fraction(float(v)) for v in values])
    assert got == rounded(exact, np.float64)
    assert got == float(mar.sum(values, comm=MPI.COMM_SELF))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ranks_with_and_without_the_compiled_form_agree(monkeypatch, dtype):
    """Odd ranks make their totals with NumPy, even ones compiled (where Numba is installed):
    the totals are exact, so the bits are those of one rank alone."""
    from mpiallreduce.reproducible import _exact

    comm = MPI.COMM_WORLD
    x = global_vector(3 * _exact.BLOCK + 11, dtype, span=40)
    y = global_vector(3 * _exact.BLOCK + 11, dtype, seed=8, span=40)
    alone = (bits(mar.sum(x, comm=MPI.COMM_SELF)), bits(mar.dot(x, y, comm=MPI.COMM_SELF)),
             bits(mar.norm2(x, comm=MPI.COMM_SELF)))
    if comm.rank % 2:
        monkeypatch.setattr(_exact, "_KERNEL", [None])
    for start, stop in splits(comm, x.size):
        got = (bits(mar.sum(x[start:stop], comm=comm)),
               bits(mar.dot(x[start:stop], y[start:stop], comm=comm)),
               bits(mar.norm2(x[start:stop], comm=comm)))
        assert got == alone


def test_vector_special_values():
    comm = MPI.COMM_WORLD
    on_last = comm.rank == comm.size - 1
    cases = [([np.nan], math.nan), ([np.inf, -np.inf], math.nan), ([np.inf, 1.0], math.inf),
             ([-0.0, -0.0], -0.0), ([-0.0, 0.0], 0.0), ([1e308, 1e308], math.inf),
             ([1e308, 1e308, -1e308], 1e308), ([5e-324, 5e-324], 1e-323)]
    for values, want in cases:
        local = np.array(values if on_last else [], dtype=np.float64)
        got = float(mar.sum(local, comm=comm))
        assert (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want)), (values, got)
    x = np.array([np.inf, 0.0]) if on_last else np.zeros(0)
    assert math.isnan(mar.dot(x, x[::-1].copy(), comm=comm))  # inf * 0


def test_vector_bad_input_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError, match="exact"):
        mar.sum(np.ones(3, dtype=np.int64) if comm.rank == 0 else np.ones(3), comm=comm)
    with pytest.raises(ValueError):
        mar.dot(np.ones(3), np.ones(2 if comm.rank == comm.size - 1 else 3), comm=comm)
    with pytest.raises(ValueError, match="unknown algorithm"):
        mar.sum(np.ones(2), comm=comm, algorithm="nope")
    if comm.size > 1:
        with pytest.raises(ValueError, match="differ"):
            mar.sum(np.ones(2, dtype=np.float32 if comm.rank == 0 else np.float64), comm=comm)
    assert float(mar.sum(np.ones(2), comm=comm)) == 2 * comm.size


def test_a_reproducible_drop_in_passes_the_flag_only_where_it_applies():
    comm = MPI.COMM_WORLD
    drop_in = mar.Comm(comm, "ring", reproducible=True)
    x = np.random.default_rng(comm.rank).standard_normal(37)
    out = np.empty_like(x)
    for _ in range(2):  # routed, then through the remembered decision
        drop_in.Allreduce(x, out, MPI.SUM)
        assert np.array_equal(out, mar.allreduce(x, op=MPI.SUM, comm=comm, algorithm="tree",
                                                 reproducible=True))
    counts = np.arange(5, dtype=np.int64) + comm.rank
    biggest = np.empty_like(counts)
    drop_in.Allreduce(counts, biggest, MPI.MAX)  # exact already: no flag, no ValueError
    expected = np.empty_like(counts)
    comm.Allreduce(counts, expected, MPI.MAX)
    assert np.array_equal(biggest, expected)
    request = drop_in.Iallreduce(x, out, MPI.SUM)
    request.Wait()
    assert np.array_equal(out, mar.allreduce(x, op=MPI.SUM, comm=comm, reproducible=True))
