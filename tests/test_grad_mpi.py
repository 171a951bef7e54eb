"""Gradient synchronisation: buckets equal per-array allreduce, compression error bounds against
the exact float64 sum, top-k error feedback, ZeRO-1 equal to the unsharded update, delayed mode,
and the data-parallel example under every --sync."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    assert_identical_across_ranks,
    assert_matches_native,
    assert_on_every_rank,
    free_comm,
    load_file,
    make_comm,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import compression, grad

SHAPES = [((3, 4), "float32"), ((7,), "float64"), ((2, 2, 2), "float32"), ((5,), "float32"),
          ((1,), "float64"), ((40,), "int64")]


def _grads(comm, seed, integer_valued=False, shapes=SHAPES):
    rng = np.random.default_rng([seed, comm.rank])
    out = []
    for shape, dtype in shapes:
        if integer_valued or np.dtype(dtype).kind == "i":
            x = rng.integers(-50, 50, shape)
        else:
            x = rng.standard_normal(shape)
        out.append(np.ascontiguousarray(x, dtype=dtype))
    return out


def _reference(comm, x, op):
    """MPI's own sum of every rank's integer-valued ``x`` (exact in any order), divided by p in
    x's dtype for AVG (as NumPy divides): an independent reference, not the library itself."""
    total = np.empty_like(x)
    comm.Allreduce(x, total, MPI.SUM)
    if op is mar.AVG:
        np.divide(total, comm.size, out=total)
    return total


def _exact(comm, x, average=False):
    """The exact sum (or mean) of every rank's x, in float64 (float64 sums of these are exact
    to far below the bounds checked)."""
    total = np.empty(x.shape, np.float64)
    comm.Allreduce(np.ascontiguousarray(x, np.float64), total, MPI.SUM)
    return total / comm.size if average else total


# -- serial -----------------------------------------------------------------------------------------

def test_pack_reverse_order_dtype_and_cap():
    arrays = [np.zeros(4, "f4"), np.zeros(4, "f4"), np.zeros(2, "f8"), np.zeros(10, "f4"),
              np.zeros(1, "f4")]
    assert grad.pack(arrays, 32) == [[4], [3], [2], [1, 0]]
    assert grad.pack(arrays, 1 << 20) == [[4, 3], [2], [1, 0]]
    assert grad.pack(arrays, 1) == [[4], [3], [2], [1], [0]]


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0x7FC00001,
                     0xFF800000], np.uint32)
    words = np.empty(bits.size, np.uint16)
    compression.BF16.encode(bits.view(np.float32), words)
    assert list(words) == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7FC0, 0xFF80]
    out = np.empty(3, np.float32)
    compression.BF16.decode(np.array([0x3F80, 0xC040, 0x0001], np.uint16), out)
    assert out[0] == 1.0 and out[1] == -3.0 and out[2] == np.float32(2.0 ** -133)


def test_fp16_round_trip():
    x = np.array([1.0, -2.5, 65504.0, 1e-8], np.float32)
    words = np.empty(4, np.uint16)
    compression.FP16.encode(x, words)
    out = np.empty(4, np.float32)
    compression.FP16.decode(words, out)
    assert list(out[:3]) == [1.0, -2.5, 65504.0] and abs(out[3] - 1e-8) <= 2.0 ** -25


def test_bad_arguments():
    with pytest.raises(ValueError, match="wire format"):
        compression.cast("fp8")
    with pytest.raises(ValueError, match="ratio"):
        mar.TopK(0)
    with pytest.raises(TypeError, match="float32 or float64"):
        mar.GradSync([np.zeros(3, "i4")], MPI.COMM_SELF, compression="fp16")
    with pytest.raises(ValueError, match="bucket_bytes"):
        mar.GradSync([np.zeros(3)], MPI.COMM_SELF, bucket_bytes=0)


# -- buckets ----------------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring", "tree", "recursive_doubling",
                                       "rabenseifner"])
@pytest.mark.parametrize("op", [mar.AVG, MPI.SUM], ids=["AVG", "SUM"])
def test_buckets_equal_per_array_allreduce(algorithm, op):
    comm = MPI.COMM_WORLD
    shapes = SHAPES if op is MPI.SUM else SHAPES[:-1]  # AVG is for floats
    grads = _grads(comm, 0, integer_valued=True, shapes=shapes)  # exact whatever the order
    with mar.GradSync(grads, comm, op=op, algorithm=algorithm, bucket_bytes=64) as sync:
        assert len(sync.buckets) > 2
        for step in range(2):
            fresh = _grads(comm, step, integer_valued=True, shapes=shapes)
            for g, f in zip(grads, fresh):
                g[...] = f
            order = range(len(grads)) if step else reversed(range(len(grads)))
            for index in order:  # forward order too: buckets still start in bucket order
                sync.ready(index)
            result = sync.wait()
            for got, f in zip(result, fresh):
                assert got.dtype == f.dtype and np.array_equal(got, _reference(comm, f, op))


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring", "recursive_doubling"])
def test_large_gradients_reduce_in_place_in_their_own_memory(algorithm):
    comm = MPI.COMM_WORLD
    grads = _grads(comm, 0, integer_valued=True)
    big = [i for i, g in enumerate(grads) if g.nbytes >= 64]
    with mar.GradSync(grads, comm, op=MPI.SUM, algorithm=algorithm, solo_bytes=64) as sync:
        solo = [b for b in sync.buckets if b.solo]
        assert sorted(b.members[0] for b in solo) == big and all(len(b.members) == 1 for b in solo)
        for bucket in solo:  # no copy: the plan reduces the gradient's own memory
            assert np.shares_memory(bucket.flat, grads[bucket.members[0]])
        for step in range(3):
            fresh = _grads(comm, step, integer_valued=True)
            for g, f in zip(grads, fresh):
                g[...] = f
            result = sync.synchronize()
            for got, f in zip(result, fresh):
                ref = np.empty_like(f)
                comm.Allreduce(f, ref, MPI.SUM)  # integer-valued: exact in any order
                assert np.array_equal(got, ref)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["shm", "auto"])
@pytest.mark.parametrize("op", [mar.AVG, MPI.SUM], ids=["AVG", "SUM"])
def test_buckets_of_shm_plans_are_shared_arrays(algorithm, op):
    """On one node a bucket whose plan runs shm lives in shared memory (the ranks reduce from
    each other's buckets in place); results equal comm.Allreduce; free() releases them."""
    comm = MPI.COMM_WORLD.Dup()
    one_node = mar.Topology.from_comm(comm).nnodes == 1
    if not one_node:  # simulated nodes (MPIALLREDUCE_RANKS_PER_NODE): shm refuses, auto skips it
        algorithm = "auto"
    # a float64 bucket of 168 kB (large regime; auto runs shm there even oversubscribed), a
    # float32 one of 20 kB (small regime), an int64 one of 320 B
    shapes = [((300, 70), "float64"), ((7,), "float64"), ((5000,), "float32"), ((40,), "int64")]
    if op is mar.AVG:
        shapes = shapes[:-1]
    grads = _grads(comm, 0, integer_valued=True, shapes=shapes)
    sync = mar.GradSync(grads, comm, op=op, algorithm=algorithm)
    packed = [b for b in sync.buckets if not b.solo]
    assert packed
    for bucket in packed:
        runs_shm = bucket.plan.algorithm == "shm"
        assert bucket.shared == runs_shm == isinstance(bucket.flat, mar.SharedArray)
        if algorithm == "shm":
            assert runs_shm
    if algorithm == "auto" and one_node and comm.size > 1:
        assert max(packed, key=lambda b: b.flat.nbytes).shared  # the 168 kB bucket
    for step in range(3):
        fresh = _grads(comm, step + 1, integer_valued=True, shapes=shapes)
        for g, f in zip(grads, fresh):
            g[...] = f
        for got, f in zip(sync.synchronize(), fresh):
            assert got.dtype == f.dtype and np.array_equal(got, _reference(comm, f, op))
    shared = [b.flat for b in packed if b.shared]
    sync.free()
    assert all(flat.freed for flat in shared)
    comm.Free()


LARGE_SHAPES = [((300, 70), "float64"), ((7,), "float64"), ((200, 60), "float64")]


def _steps_right(comm, sync, grads, steps, shapes=LARGE_SHAPES) -> list:
    """Run ``steps`` steps of fresh integer-valued gradients; return the packing mode of each
    step, after checking every result against MPI's own sum."""
    ways = []
    for step in range(steps):
        fresh = _grads(comm, step + 1, integer_valued=True, shapes=shapes)
        for g, f in zip(grads, fresh):
            g[...] = f
        ways.append(sync.way)
        for got, f in zip(sync.synchronize(), fresh):
            assert np.array_equal(got, _reference(comm, f, MPI.SUM))
    return ways


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["shm", "auto"])
def test_on_one_node_every_way_is_timed_then_one_kept(algorithm):
    """Where the plans run shm, packing="auto" holds the arrays packed into shared buckets,
    the large ones solo (their own memory, reduced in place) and, under auto, the same solo
    through native plans (the plain loop); it times the steps each way in turn, keeps one on
    every rank and frees the others' buckets and plans; results equal comm.Allreduce's at
    every step. Elsewhere large gradients stay solo, nothing timed."""
    comm = MPI.COMM_WORLD
    if mar.Topology.from_comm(comm).nnodes > 1:
        algorithm = "auto"  # simulated nodes: shm refuses
    grads = _grads(comm, 0, integer_valued=True, shapes=LARGE_SHAPES)
    with mar.GradSync(grads, comm, op=MPI.SUM, algorithm=algorithm, solo_bytes=1024,
                      overlap=False) as sync:
        forms = {way: buckets for way, (buckets, _) in sync._forms.items()}
        shm = all(b.plan.algorithm == "shm" for b in forms["solo" if "solo" in forms
                                                           else "packed"])
        if shm:
            expected = ["packed", "solo"] + (["native"] if algorithm == "auto" else [])
            assert list(forms) == expected
            packed = forms["packed"]
            assert not any(b.solo for b in packed) and all(b.shared for b in packed)
            for way in expected[1:]:
                solo = [b for b in forms[way] if b.solo]
                assert sorted(b.members[0] for b in solo) == [0, 2]
                assert all(np.shares_memory(b.flat, grads[b.members[0]]) for b in solo)
                assert all(b.plan.algorithm == ("shm" if way == "solo" else "native")
                           for b in forms[way])
        else:
            expected = ["solo"]
            assert list(forms) == expected and sum(b.solo for b in forms["solo"]) == 2
        ways = _steps_right(comm, sync, grads, len(expected) * grad.PROBE_STEPS + 2)
        kept = sync.way
        assert ways[-1] == kept and set(sync._forms) == {kept}
        assert comm.allgather(kept) == [kept] * comm.size
        assert ways[:len(expected) * grad.PROBE_STEPS] == expected * grad.PROBE_STEPS
        for way, buckets in forms.items():
            assert all(b.plan._freed != (way == kept) for b in buckets)
            assert all(b.flat.freed != (way == kept) for b in buckets if b.shared)


@pytest.mark.mpi
@pytest.mark.parametrize("packing", [True, False])
def test_a_fixed_packing_is_kept(packing):
    """packing=True packs every array (shared buckets where the plans run shm); False keeps the
    large ones solo, on one node too; nothing is timed, and results equal comm.Allreduce's."""
    comm = MPI.COMM_WORLD
    grads = _grads(comm, 0, integer_valued=True, shapes=LARGE_SHAPES)
    way = "packed" if packing else "solo"
    with mar.GradSync(grads, comm, op=MPI.SUM, solo_bytes=1024, overlap=False,
                      packing=packing) as sync:
        assert list(sync._forms) == [way] and not sync.probing
        assert sum(b.solo for b in sync.buckets) == (0 if packing else 2)
        for bucket in sync.buckets:
            assert bucket.shared == (bucket.plan.algorithm == "shm" and not bucket.solo)
        assert _steps_right(comm, sync, grads, 3) == [way] * 3


@pytest.mark.mpi
@pytest.mark.parametrize("packing, views", [("auto", False), (True, False), ("auto", True)])
def test_plans_bound_on_gradients_are_only_those_kept_or_the_one_probe(monkeypatch, packing,
                                                                      views):
    """The first solo array's plan says whether the plans run shm before any other is bound:
    packing=True binds none on a gradient; with views (the packed way alone on one node) the
    one probe, freed; packing="auto" keeps each large gradient's own, and on one node a
    native one too (both timed against the packed way)."""
    comm = MPI.COMM_WORLD
    shapes = [((300, 70), "float64"), ((7,), "float64"), ((200, 60), "float64"),
              ((250, 50), "float64")]
    grads = _grads(comm, 0, integer_valued=True, shapes=shapes)
    on_gradients = []
    plan = mar.api.plan

    def counted(sendbuf, recvbuf=None, *args, **kwargs):
        buffer = recvbuf if sendbuf is MPI.IN_PLACE else sendbuf
        on_gradients.append(any(np.shares_memory(buffer, g) for g in grads))
        return plan(sendbuf, recvbuf, *args, **kwargs)

    monkeypatch.setattr(mar.api, "plan", counted)
    with mar.GradSync(grads, comm, op=MPI.SUM, solo_bytes=1024, packing=packing,
                      views=views) as sync:
        shm = all(b.plan.algorithm == "shm" for b in sync.buckets)
        expected = 0 if packing is True else 1 if views and shm else 6 if shm else 3
        assert sum(on_gradients) == expected
        assert sum(b.solo for b in sync.buckets) == (0 if packing is True or shm else 3)
        fresh = _grads(comm, 1, integer_valued=True, shapes=shapes)
        for g, f in zip(sync.arrays, fresh):
            g[...] = f
        for got, f in zip(sync.synchronize(), fresh):
            assert np.array_equal(got, _reference(comm, f, MPI.SUM))


@pytest.mark.mpi
@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_views_are_the_buckets_and_hold_the_results(algorithm, compression):
    """``views=True``: the arrays become views of the buckets holding their values (nothing to
    copy in or out); gradients written there sum as comm.Allreduce sums them, step after
    step; a solo array stays the caller's."""
    comm = MPI.COMM_WORLD
    shapes = [((300, 70), "float64"), ((7,), "float64"), ((50, 3), "float64"),
              ((400, 400), "float64")]
    grads = _grads(comm, 0, integer_valued=True, shapes=shapes)
    with mar.GradSync(grads, comm, op=MPI.SUM, algorithm=algorithm, compression=compression,
                      solo_bytes=1 << 20, views=True) as sync:
        for got, g in zip(sync.arrays, grads):
            assert type(got) is np.ndarray and got.shape == g.shape and np.array_equal(got, g)
        for bucket in sync.buckets:
            for i in bucket.members:
                assert np.shares_memory(sync.arrays[i], bucket.flat)
                assert np.shares_memory(sync.arrays[i], grads[i]) == bucket.solo
        for step in range(3):
            fresh = _grads(comm, step + 1, integer_valued=True, shapes=shapes)
            for array, f in zip(sync.arrays, fresh):
                array[...] = f
            for got, f in zip(sync.synchronize(), fresh):
                assert np.array_equal(got, _reference(comm, f, MPI.SUM))


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False, "auto"])
@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_every_overlap_mode_gives_the_sum(overlap, algorithm):
    comm = MPI.COMM_WORLD
    grads = _grads(comm, 0, integer_valued=True)
    modes = []
    with mar.GradSync(grads, comm, op=MPI.SUM, algorithm=algorithm, bucket_bytes=64,
                      overlap=overlap) as sync:
        for step in range(2 * grad.PROBE_STEPS + 2):
            fresh = _grads(comm, step, integer_valued=True)
            for g, f in zip(grads, fresh):
                g[...] = f
            modes.append(sync.overlap_mode)
            for index in reversed(range(len(grads))):
                sync.ready(index)
            for got, f in zip(sync.wait(), fresh):
                ref = np.empty_like(f)
                comm.Allreduce(f, ref, MPI.SUM)
                assert np.array_equal(got, ref)
    if overlap == "auto":  # both modes probed, then one kept
        assert modes[:2 * grad.PROBE_STEPS].count(True) == grad.PROBE_STEPS
        assert len(set(modes[2 * grad.PROBE_STEPS:])) == 1
    else:
        assert set(modes) == {overlap}


class _StepClock:
    """The clock grad.py reads (``time.perf_counter``), advanced by the test: a step lasts what
    :func:`_step_seconds` says for its mode on this rank, whatever the machine does."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _step_seconds(comm, overlap_mode: bool) -> float:
    """Even ranks find overlapped steps slow, odd ranks find waiting steps slow, so ranks that
    chose from their own timings alone would disagree. The slowest rank is slower overlapped
    (1 s against 0.5 s): agreed, every rank keeps ``overlap_mode = False``."""
    even = comm.rank % 2 == 0
    slow = overlap_mode if even else not overlap_mode
    return (1.0 if even else 0.5) if slow else 0.01


def _problem(comm, step, got, ref) -> str | None:
    if got.dtype != ref.dtype or not np.array_equal(got, ref):
        return f"rank {comm.rank}, step {step}: {got.ravel()[:4]} vs {ref.ravel()[:4]}"
    return None


# a 40 kB float64 bucket and small ones: both regimes where auto picks shm on one node
DISAGREE_SHAPES = [((50, 100), "float64"), ((7,), "float64"), ((3, 4), "float32")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["world", "dup", "split"])
@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_auto_overlap_is_agreed_when_ranks_time_differently(kind, algorithm, monkeypatch):
    """overlap="auto" keeps one mode on every rank even where each rank's own timings point
    to another one, and the averages stay right through the probing and after it."""
    comm = make_comm(kind)
    clock = _StepClock()
    monkeypatch.setattr(grad, "time", clock)
    shapes = DISAGREE_SHAPES
    grads = _grads(comm, 0, integer_valued=True, shapes=shapes)
    problems = []
    sync = mar.GradSync(grads, comm, algorithm=algorithm, bucket_bytes=256)
    try:
        for step in range(2 * grad.PROBE_STEPS + 3):
            fresh = _grads(comm, step, integer_valued=True, shapes=shapes)
            for g, f in zip(grads, fresh):
                g[...] = f
            for index in reversed(range(len(grads))):
                sync.ready(index)
            clock.now += _step_seconds(comm, sync.overlap_mode)
            result = sync.wait()
            problems += [_problem(comm, step, got, _reference(comm, f, mar.AVG))
                         for got, f in zip(result, fresh)]
    except Exception as error:  # noqa: BLE001 - reported on every rank below
        problems.append(f"rank {comm.rank}: {type(error).__name__}: {error}")
    try:
        modes = comm.allgather(sync.overlap_mode)
        assert_on_every_rank(comm, "; ".join(p for p in problems if p) or None)
        assert len(set(modes)) == 1, f"ranks settled on different overlap modes: {modes}"
        assert modes[0] is False  # the mode whose slowest rank is faster
    finally:
        sync.free()
        free_comm(comm)


def _way_seconds(comm, way: str) -> float:
    """Even ranks find packed steps slow, odd ranks solo ones, every rank native ones a little:
    ranks that chose alone would disagree; the slowest rank is fastest solo (0.5 s, against
    0.7 s native and 1 s packed)."""
    even = comm.rank % 2 == 0
    return {"packed": 1.0 if even else 0.01, "solo": 0.01 if even else 0.5,
            "native": 0.7}[way]


@pytest.mark.mpi(min_size=2)
def test_auto_packing_is_agreed_when_ranks_time_differently(monkeypatch):
    """packing="auto" (with overlap="auto": six ways on one node) keeps one way on every rank
    even where each rank's own timings point to another (:func:`_way_seconds`), overlapped or
    not as the clock says; results stay right throughout."""
    comm = MPI.COMM_WORLD
    grads = _grads(comm, 0, integer_valued=True, shapes=LARGE_SHAPES)
    clock = _StepClock()
    monkeypatch.setattr(grad, "time", clock)
    problems = []
    sync = mar.GradSync(grads, comm, op=MPI.SUM, solo_bytes=1024)
    ways = len(sync._timings)
    try:
        for step in range(ways * grad.PROBE_STEPS + 2):
            fresh = _grads(comm, step, integer_valued=True, shapes=LARGE_SHAPES)
            for g, f in zip(grads, fresh):
                g[...] = f
            for index in reversed(range(len(grads))):
                sync.ready(index)
            clock.now += _way_seconds(comm, sync.way) + 0.001 * sync.overlap_mode
            problems += [_problem(comm, step, got, _reference(comm, f, MPI.SUM))
                         for got, f in zip(sync.wait(), fresh)]
    except Exception as error:  # noqa: BLE001 - reported on every rank below
        problems.append(f"rank {comm.rank}: {type(error).__name__}: {error}")
    try:
        kept = comm.allgather((sync.way, sync.overlap_mode))
        assert_on_every_rank(comm, "; ".join(p for p in problems if p) or None)
        assert len(set(kept)) == 1, f"ranks settled on different ways: {kept}"
        # on one node (the plans run shm) three ways timed, elsewhere the solo arrays alone
        assert ways in (6, 2) and kept[0] == ("solo", False)
        assert len(sync.timed) == ways and min(sync.timed, key=sync.timed.get) == kept[0]
    finally:
        sync.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["auto", "ring", "native"])
def test_delayed_sync_agrees_on_overlap_when_ranks_time_differently(algorithm, monkeypatch):
    """DelayedSync's two GradSyncs each pick one mode on every rank, so buckets of the one in
    flight and of the next start in the same order everywhere (different orders raised in shm's
    header check, or hung without shm), and every late average is right."""
    comm = MPI.COMM_WORLD
    clock = _StepClock()
    monkeypatch.setattr(grad, "time", clock)
    shapes = DISAGREE_SHAPES
    grads = _grads(comm, 0, integer_valued=True, shapes=shapes)
    delayed = mar.DelayedSync(grads, comm, algorithm=algorithm, bucket_bytes=256)
    problems, previous = [], None
    try:
        for step in range(4 * grad.PROBE_STEPS + 4):
            fresh = _grads(comm, step, integer_valued=True, shapes=shapes)
            if delayed.in_flight is not None:  # the step ends the in-flight sync's timing
                clock.now += _step_seconds(comm, delayed.in_flight.overlap_mode)
            result = delayed.step(fresh)
            if previous is not None:
                problems += [_problem(comm, step, got, ref) for got, ref in zip(result, previous)]
            previous = [_reference(comm, f, mar.AVG) for f in fresh]
        problems += [_problem(comm, "flush", got, ref)
                     for got, ref in zip(delayed.flush(), previous)]
    except Exception as error:  # noqa: BLE001 - reported on every rank below
        problems.append(f"rank {comm.rank}: {type(error).__name__}: {error}")
    try:
        modes = comm.allgather([sync.overlap_mode for sync in delayed.syncs])
        assert_on_every_rank(comm, "; ".join(p for p in problems if p) or None)
        assert len(set(map(tuple, modes))) == 1, f"ranks settled on different modes: {modes}"
        assert modes[0] == [False, False]  # the mode whose slowest rank is faster
    finally:
        delayed.free()


@pytest.mark.parametrize("name", ["overlap", "packing"])
def test_overlap_and_packing_must_be_known_modes(name):
    with pytest.raises(ValueError, match=name):
        mar.GradSync([np.zeros(3)], MPI.COMM_SELF, **{name: "sometimes"})


@pytest.mark.mpi
def test_buckets_bit_identical_to_per_array_tree_on_random_data():
    """Bucketing keeps tree's order of additions (bit for bit the per-array call), and that
    result is the sum: within the summation bound of MPI's own, identical on every rank."""
    comm = MPI.COMM_WORLD
    grads = _grads(comm, 3)
    fresh = [g.copy() for g in grads]
    with mar.GradSync(grads, comm, algorithm="tree", op=MPI.SUM) as sync:
        sync.synchronize()
    for got, f in zip(grads, fresh):
        assert_matches_native(comm, f, got, MPI.SUM)  # independent of the library
        assert np.array_equal(got, mar.allreduce(f, comm=comm, algorithm="tree"))


@pytest.mark.mpi
def test_wait_refuses_unmarked_gradients():
    comm = MPI.COMM_WORLD
    grads = [np.full(3, comm.rank + 1.0), np.arange(4.0) * (comm.rank + 1)]
    fresh = [g.copy() for g in grads]
    with mar.GradSync(grads, comm) as sync:
        sync.ready(1)
        with pytest.raises(ValueError, match=r"\[0\] were not marked"):
            sync.wait()
        sync.ready(0)  # the step goes on where it was: both gradients reduced, the mean
        result = sync.wait()
    for got, f in zip(result, fresh):
        assert np.array_equal(got, _reference(comm, f, mar.AVG))


# -- compression ------------------------------------------------------------------------------------

def _mixed(comm, count, seed):
    rng = np.random.default_rng([seed, comm.rank])
    return (rng.standard_normal(count) * 10.0 ** rng.integers(-6, 2, count)).astype(np.float32)


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("algorithm", ["native", "ring", "tree", "recursive_doubling",
                                       "rabenseifner"])
@pytest.mark.parametrize("op", [mar.AVG, MPI.SUM], ids=["AVG", "SUM"])
def test_cast_allreduce_within_bound(wire, algorithm, op):
    comm = MPI.COMM_WORLD
    x = _mixed(comm, 1001, 0)
    out = mar.cast_allreduce(x, wire=wire, op=op, comm=comm, algorithm=algorithm)
    exact = _exact(comm, x, op is mar.AVG)
    magnitudes = _exact(comm, np.abs(x))
    bound = compression.cast_error_bound(wire, magnitudes, comm.size, op is mar.AVG)
    error = np.abs(out.astype(np.float64) - exact)
    assert np.all(error <= bound), float(np.max(error / bound))
    assert_identical_across_ranks(comm, out)


@pytest.mark.mpi
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_compressed_buckets_within_bound(wire):
    comm = MPI.COMM_WORLD
    shapes = [((30,), "float32"), ((5, 6), "float64"), ((17,), "float32")]
    grads = [_mixed(comm, int(np.prod(s)), i).reshape(s).astype(d) for i, (s, d) in
             enumerate(shapes)]
    fresh = [g.copy() for g in grads]
    with mar.GradSync(grads, comm, compression=wire, algorithm="ring", bucket_bytes=128) as sync:
        assert sync.payload_bytes == 2 * sum(g.size for g in grads)
        sync.synchronize()
    for got, f in zip(grads, fresh):
        bound = compression.cast_error_bound(wire, _exact(comm, np.abs(f)), comm.size, True)
        assert np.all(np.abs(got - _exact(comm, f, True)) <= bound)
        assert_identical_across_ranks(comm, got)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring", "recursive_doubling"])
def test_topk_bound_and_error_feedback_conserves_the_sum(algorithm):
    comm = MPI.COMM_WORLD
    shapes = [((50,), "float64"), ((4, 5), "float64")]
    topk = mar.TopK(0.2)
    grads = [np.zeros(s, d) for s, d in shapes]
    applied = [np.zeros(g.size) for g in grads]
    exact_total = [np.zeros(g.size) for g in grads]
    with mar.GradSync(grads, comm, op=MPI.SUM, algorithm=algorithm, compression=topk) as sync:
        assert sync.payload_bytes == sum(16 * topk.k(g.size) for g in grads)
        for step in range(4):
            fresh = _grads(comm, step, shapes=shapes)
            # what each rank's accumulated gradient is before this step's selection
            accumulated = [f.reshape(-1) + topk.residuals.get(i, 0) for i, f in enumerate(fresh)]
            for g, f in zip(grads, fresh):
                g[...] = f
            sync.synchronize()
            for i, (got, acc, f) in enumerate(zip(grads, accumulated, fresh)):
                k = topk.k(acc.size)
                threshold = np.sort(np.abs(acc))[-k]
                thresholds = comm.allreduce(threshold)
                error = np.abs(got.reshape(-1) - _exact(comm, acc))
                assert np.all(error <= thresholds * (1 + 1e-12)), (step, i)
                assert_identical_across_ranks(comm, got)
                applied[i] += got.reshape(-1)
                exact_total[i] += _exact(comm, f.reshape(-1))
    for i in range(len(grads)):  # nothing lost: applied + every rank's residual = exact total
        left = _exact(comm, topk.residuals[i])
        assert np.allclose(applied[i] + left, exact_total[i], rtol=0, atol=1e-12)


# -- ZeRO-1 and the delayed mode --------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring", "auto"])
def test_sharded_update_equals_unsharded(algorithm):
    comm = MPI.COMM_WORLD
    shapes = [((3, 5), "float64"), ((7,), "float64"), ((1,), "float64")]
    params = [np.arange(np.prod(s), dtype=d).reshape(s) / 4 for s, d in shapes]
    reference = [p.copy() for p in params]
    velocity = [np.zeros_like(p) for p in params]
    optimizer = mar.SGD(0.25, momentum=0.5)
    sharded = mar.ShardedSGD(params, optimizer, comm, algorithm)
    assert sharded.velocity.size <= -(-sum(p.size for p in params) // comm.size)
    for step in range(3):
        grads = _grads(comm, step, integer_valued=True, shapes=shapes)  # dyadic: exact sums
        sharded.step(grads)
        for p, g, v in zip(reference, grads, velocity):
            optimizer.update(p, _reference(comm, g, mar.AVG), v)
        for p, r in zip(params, reference):
            assert np.array_equal(p, r)
            assert_identical_across_ranks(comm, p)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_delayed_sync_returns_the_previous_average(algorithm):
    comm = MPI.COMM_WORLD
    grads = _grads(comm, 0, integer_valued=True, shapes=SHAPES[:3])
    delayed = mar.DelayedSync(grads, comm, algorithm=algorithm, bucket_bytes=64)
    previous = None
    for step in range(3):
        fresh = _grads(comm, step, integer_valued=True, shapes=SHAPES[:3])
        result = delayed.step(fresh)
        if previous is None:
            assert result is None
        else:
            for got, ref in zip(result, previous):
                assert np.array_equal(got, ref)
                assert_identical_across_ranks(comm, got)
        previous = [_reference(comm, f, mar.AVG) for f in fresh]
    for got, ref in zip(delayed.flush(), previous):
        assert np.array_equal(got, ref)
    assert delayed.flush() is None
    delayed.free()


@pytest.mark.mpi
def test_delayed_sync_times_its_ways_while_the_other_sync_is_in_flight():
    """DelayedSync of gradients of 1 MiB and more: each of its two syncs times its ways (on one
    node), and frees the losers' shared buckets in a wait() while the other sync's buckets are
    in flight; every late sum equals comm.Allreduce's, and each sync keeps one way on every
    rank."""
    comm = MPI.COMM_WORLD
    shapes = [((400, 400), "float64"), ((7,), "float64"), ((300, 500), "float64")]
    delayed = mar.DelayedSync(_grads(comm, 0, integer_valued=True, shapes=shapes), comm,
                              op=MPI.SUM)
    ways = max(len(sync._timings) for sync in delayed.syncs)
    previous = None
    for step in range(2 * ways * grad.PROBE_STEPS + 4):
        fresh = _grads(comm, step, integer_valued=True, shapes=shapes)
        result = delayed.step(fresh)
        if previous is not None:
            for got, ref in zip(result, previous):
                assert np.array_equal(got, ref)
        previous = [_reference(comm, f, MPI.SUM) for f in fresh]
    for got, ref in zip(delayed.flush(), previous):
        assert np.array_equal(got, ref)
    kept = [(sync.way, list(sync._forms), sync.probing) for sync in delayed.syncs]
    assert all(forms == [way] and not probing for way, forms, probing in kept)
    assert comm.allgather(kept) == [kept] * comm.size
    delayed.free()


# -- the example ------------------------------------------------------------------------------------

def _example():
    return load_file("examples/data_parallel.py", "data_parallel")


@pytest.mark.mpi
@pytest.mark.parametrize("sync", ["plain", "bucketed", "fp16", "bf16", "topk", "sharded",
                                  "async"])
def test_data_parallel_example(sync):
    module = _example()
    assert sync in module.SYNCS
    summary = module.main(["--sync", sync, "--steps", "12", "--samples", "256", "--quiet"])
    assert summary["ok"] and summary["identical"]
    assert summary["relative_error"] <= module.TOLERANCE[sync]
