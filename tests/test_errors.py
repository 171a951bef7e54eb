"""Bad input raises a clear TypeError/ValueError on the calling rank before any message.

Serial tests (one rank): each case runs with ``check=True`` (the cross-rank agreement, which at
p = 1 passes the local error straight through) and ``check=False`` (local checks only), through
both ``allreduce`` and ``plan``. The cross-rank versions are in test_agreement_mpi.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.algorithms import REGISTRY

COMMUTATIVE_ONLY = sorted(name for name, a in REGISTRY.items() if a.commutative_only)


def _read_only(array):
    array.flags.writeable = False
    return array


def _freed_comm():
    comm = MPI.COMM_SELF.Dup()
    comm.Free()  # mpi4py sets the handle to MPI_COMM_NULL
    return comm


def _affine(inbuf, inoutbuf, datatype):
    pass  # never called: the op is refused before any data moves


# name -> (keyword arguments of the call, exception, pattern the message must match)
CASES = {
    "recvbuf not contiguous": (
        lambda: dict(sendbuf=np.zeros(10), recvbuf=np.zeros(20)[::2]),
        ValueError, r"recvbuf must be contiguous \(C or Fortran order; got strides \(16,\)\); "
                    r"pass np.ascontiguousarray\(recvbuf\)"),
    "sendbuf not contiguous": (
        lambda: dict(sendbuf=np.zeros((4, 4))[:, 1], recvbuf=np.zeros(4)),
        ValueError, r"sendbuf must be contiguous \(C or Fortran order"),
    "recvbuf read-only": (
        lambda: dict(sendbuf=np.zeros(10), recvbuf=_read_only(np.zeros(10))),
        ValueError, r"recvbuf is read-only; the result needs a writable buffer"),
    "in-place buffer read-only": (
        lambda: dict(sendbuf=MPI.IN_PLACE, recvbuf=_read_only(np.zeros(10))),
        ValueError, r"recvbuf is read-only"),
    "recvbuf wrong shape": (
        lambda: dict(sendbuf=np.zeros(10), recvbuf=np.zeros(11)),
        ValueError, r"recvbuf has shape \(11,\) but sendbuf has \(10,\); they must match"),
    "recvbuf same size, other shape": (
        lambda: dict(sendbuf=np.zeros((2, 6)), recvbuf=np.zeros((3, 4))),
        ValueError, r"recvbuf has shape \(3, 4\) but sendbuf has \(2, 6\)"),
    "dtype mismatch": (
        lambda: dict(sendbuf=np.zeros(10), recvbuf=np.zeros(10, dtype=np.float32)),
        TypeError, r"recvbuf has dtype float32 but sendbuf has float64; they must match"),
    "dtype without an MPI datatype": (
        lambda: dict(sendbuf=np.zeros(10, dtype=np.float16)),
        TypeError, r"sendbuf has dtype float16, which has no predefined MPI datatype here; "
                   r"use one of int8, .*complex128, bool"),
    "sendbuf not a buffer": (
        lambda: dict(sendbuf=[1.0, 2.0]),
        TypeError, r"sendbuf must be a NumPy array or expose the buffer protocol, got list"),
    "in place without recvbuf": (
        lambda: dict(sendbuf=MPI.IN_PLACE),
        ValueError, r"sendbuf is MPI.IN_PLACE, so recvbuf must hold the input and result"),
    "send and receive overlap": (
        lambda: (lambda a: dict(sendbuf=a[:6], recvbuf=a[4:]))(np.zeros(10)),
        ValueError, r"sendbuf and recvbuf overlap; pass MPI.IN_PLACE as sendbuf"),
    "BAND on floats": (
        lambda: dict(sendbuf=np.zeros(10), op=MPI.BAND),
        TypeError, r"op MPI.BAND is not defined for dtype float64; MPI defines it for int8, "
                   r"int16, int32, int64, uint8, uint16, uint32, uint64$"),
    "MAX on complex": (
        lambda: dict(sendbuf=np.zeros(3, dtype=np.complex64), op=MPI.MAX),
        TypeError, r"op MPI.MAX is not defined for dtype complex64"),
    "SUM on bool": (
        lambda: dict(sendbuf=np.zeros(3, dtype=bool), op=MPI.SUM),
        TypeError, r"op MPI.SUM is not defined for dtype bool"),
    "AVG on integers": (
        lambda: dict(sendbuf=np.zeros(3, dtype=np.int32), op=mar.AVG),
        TypeError, r"op AVG is not defined for dtype int32: it divides by the number of ranks"),
    "op not an MPI.Op": (
        lambda: dict(sendbuf=np.zeros(3), op="sum"),
        TypeError, r"op must be an mpi4py MPI.Op or mpiallreduce.AVG, got 'sum'"),
    "op is OP_NULL": (
        lambda: dict(sendbuf=np.zeros(3), op=MPI.OP_NULL),
        ValueError, r"op is MPI.OP_NULL \(a freed or null op\)"),
    "predefined op mpiallreduce lacks": (
        lambda: dict(sendbuf=np.zeros(3), op=MPI.MAXLOC),
        TypeError, r"predefined op MPI.MAXLOC is not supported by mpiallreduce; use one of "
                   r"SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR, AVG or a user op "
                   r"from MPI.Op.Create$"),
    "unknown algorithm": (
        lambda: dict(sendbuf=np.zeros(3), algorithm="rnig"),
        ValueError, r"unknown algorithm 'rnig'; choose one of " + ", ".join(mar.ALGORITHMS) + "$"),
    "algorithm not a string": (
        lambda: dict(sendbuf=np.zeros(3), algorithm=None),
        ValueError, r"unknown algorithm None; choose one of "),
    "comm is COMM_NULL": (
        lambda: dict(sendbuf=np.zeros(3), comm=MPI.COMM_NULL),
        ValueError, r"comm is MPI.COMM_NULL \(a freed or null communicator\)"),
    "comm freed": (
        lambda: dict(sendbuf=np.zeros(3), comm=_freed_comm()),
        ValueError, r"comm is MPI.COMM_NULL \(a freed or null communicator\)"),
    "comm not a communicator": (
        lambda: dict(sendbuf=np.zeros(3), comm="world"),
        TypeError, r"comm must be an mpi4py communicator, got str"),
    "topology not a Topology": (
        lambda: dict(sendbuf=np.zeros(3), topology=[0, 0, 1, 1]),
        TypeError, r"topology must be a mpiallreduce Topology \(Topology.from_comm, "
                   r"Topology.simulated, Topology.from_nodes\), got list"),
    "topology of another size": (
        lambda: dict(sendbuf=np.zeros(3), topology=mar.Topology.from_nodes([0, 0, 1, 1])),
        ValueError, r"topology describes 4 ranks but the communicator has 1; build it for this "
                    r"communicator"),
    "negative timeout": (
        lambda: dict(sendbuf=np.zeros(3), timeout=-1),
        ValueError, r"timeout must be a positive number of seconds or None, got -1"),
    "timeout not a number": (
        lambda: dict(sendbuf=np.zeros(3), timeout="5"),
        ValueError, r"timeout must be a positive number of seconds or None, got '5'"),
}


@pytest.mark.parametrize("entry", ["allreduce", "plan"])
@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_a_clear_error(case, check, entry):
    kwargs, kind, pattern = CASES[case]
    call = mar.allreduce if entry == "allreduce" else mar.plan
    with pytest.raises(kind, match=pattern):
        call(**kwargs(), check=check)


@pytest.mark.parametrize("algorithm", COMMUTATIVE_ONLY)
def test_non_commutative_op_is_refused_by_algorithms_that_reorder(algorithm):
    op = MPI.Op.Create(_affine, commute=False)
    keep = [n for n, a in REGISTRY.items() if not a.commutative_only] + ["shm", "native"]
    try:
        with pytest.raises(ValueError, match=rf"algorithm '{algorithm}' reorders operands and "
                                             rf"needs a commutative op; for a non-commutative "
                                             rf"op use one of {', '.join(keep)}$"):
            mar.allreduce(np.zeros(4, dtype=np.int64), op=op, algorithm=algorithm)
    finally:
        op.Free()


def test_a_bad_call_changes_nothing():
    """The error comes before any data moves: the output buffer is untouched."""
    out = np.full(10, 7.0)
    with pytest.raises(TypeError):
        mar.allreduce(np.ones(10), out, op=MPI.BAND, algorithm="ring")
    assert (out == 7.0).all()


@pytest.mark.parametrize("algorithm", ["ring", "native"])
@pytest.mark.parametrize("timeout", [True, "5", -1, 0])
def test_plan_run_checks_its_timeout_like_allreduce(algorithm, timeout):
    x = np.arange(4.0)
    with mar.plan(x, algorithm=algorithm) as p:
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            p.run(timeout=timeout)
        assert np.array_equal(p.run(), x)  # a refused argument leaves the plan usable
