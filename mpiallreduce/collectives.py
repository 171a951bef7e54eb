"""Related collectives: reduce_scatter, allgather, bcast, alltoall over the same executor.

Each is one table-driven entry: local checks, the agreement, then MPI's own collective
(``native``; ``auto`` means native for these, for the reason given in :mod:`.select`) or a
schedule bound to the buffers by a :class:`~mpiallreduce.executor.Layout`.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import _plans
from ._agree import prepare
from ._checks import Call, as_array, check_algorithm, matching_recv, no_in_place
from ._state import state as comm_state
from .executor import MPI_CANNOT_SAY, Layout, Plan, flat, scratch_size, wait_or_fail
from .ops import reducer
from .partition import block, block_counts


def _run(call: Call, count: int, layout: Layout, native, timeout) -> np.ndarray:
    """Run a related collective: MPI's own (``native``) or a schedule through a Plan.

    ``native(private, nonblocking)`` calls MPI's collective, or starts its non-blocking form
    and returns the request (when a timeout is set).

    ``auto`` means ``native`` for these collectives, for the reason given in :mod:`.select`.
    """
    state = comm_state(call.comm)
    private = state.private
    result = flat(call.recv)
    if call.algorithm in ("native", "auto"):
        if count and timeout is None:
            native(private, False)
        elif count:
            # non-blocking and polled; the check agreed that every rank has a timeout, since
            # MPI never matches a blocking collective with a non-blocking one
            wait_or_fail(
                [native(private, True)], time.monotonic() + timeout,
                lambda reason, pending: state.fail(reason, pending, (call.send, call.recv, layout)),
                lambda: (f"native {call.collective} on rank {private.Get_rank()}: not complete "
                         f"within {timeout:g} s ({MPI_CANNOT_SAY})"))
        if count and call.reducer is not None and call.reducer.average:
            np.divide(result, private.Get_size(), out=result)
        return call.recv
    if count == 0:
        return call.recv
    steps = _plans.steps(call.algorithm, private.Get_rank(), private.Get_size(), count, None,
                         _plans.builder_params(call.algorithm, call, call.collective) + (
                             (("root", call.root),) if call.collective == "bcast" else ()),
                         call.collective)
    scratch = state.scratch_for(call.recv.dtype, scratch_size(steps))
    plan = Plan(private, steps, call.send, call.recv, call.reducer, call.algorithm,
                label=f"{call.collective} {call.algorithm}", persistent=False, scratch=scratch,
                timeout=timeout, layout=layout, state=state)
    try:
        return plan.run()
    finally:
        plan.free()


def reduce_scatter(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", check=True,
                   timeout=None):
    """Combine the full vector ``sendbuf`` across ranks; rank r gets block r of the result.

    Blocks follow :func:`mpiallreduce.partition.block` (the first ``n % p`` blocks one element
    longer), as ``comm.Reduce_scatter(sendbuf, recvbuf, block_counts(n, p), op)``.

    Args:
        sendbuf: this rank's full vector of n elements (any C-contiguous shape; read flat).
        recvbuf: this rank's block, ``block(n, p, rank)`` in size; ``None`` allocates it (1-D).
        op, comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"ring"``, ``"recursive_halving"`` (both commutative ops only),
            ``"native"`` or ``"auto"``.

    Returns:
        The result block (``recvbuf`` when given).
    """
    def local_checks(comm):
        no_in_place(sendbuf, "reduce_scatter")
        send = as_array(sendbuf, "sendbuf", writable=False)
        lo, hi = block(send.size, comm.Get_size(), comm.Get_rank())
        recv = matching_recv(recvbuf, send, hi - lo,
                              f"block {comm.Get_rank()} of {send.size} split {comm.Get_size()} ways")
        red = reducer(op, send.dtype)
        check_algorithm(algorithm, red, "reduce_scatter")
        return Call(send, recv, red, algorithm, None, comm, collective="reduce_scatter",
                     count=send.size)

    call = prepare("reduce_scatter", comm, check, local_checks, "reduce_scatter", timeout)
    n, p = call.send.size, call.comm.Get_size()
    lo, hi = block(n, p, call.comm.Get_rank())
    work = np.empty(n, dtype=call.send.dtype) if call.algorithm not in ("native", "auto") else None
    layout = None if work is None else Layout(
        (work,), ((flat(call.send), work),), ((work[lo:hi], flat(call.recv)),))
    native = lambda private, nonblocking: (
        private.Ireduce_scatter if nonblocking else private.Reduce_scatter)(
        call.send, call.recv, block_counts(n, p), call.reducer.mpi_op)
    return _run(call, n, layout, native, timeout)


def allgather(sendbuf, recvbuf, comm=None, algorithm="auto", check=True, timeout=None):
    """Gather every rank's block into ``recvbuf`` on every rank.

    Rank r contributes block r of ``recvbuf`` (``block(n, p, r)`` elements, n = recvbuf.size),
    as ``comm.Allgatherv(sendbuf, [recvbuf, block_counts(n, p)])``.

    Args:
        sendbuf: this rank's block, or ``MPI.IN_PLACE`` when it already sits in ``recvbuf``.
        recvbuf: the full result vector (required: its size says how many elements are gathered).
        comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"ring"``, ``"recursive_doubling"``, ``"native"`` or ``"auto"``.

    Returns:
        ``recvbuf``.
    """
    def local_checks(comm):
        if recvbuf is None:
            raise ValueError("allgather needs recvbuf: its size is the count gathered")
        recv = as_array(recvbuf, "recvbuf", writable=True)
        lo, hi = block(recv.size, comm.Get_size(), comm.Get_rank())
        send = None
        if sendbuf is not MPI.IN_PLACE:
            send = as_array(sendbuf, "sendbuf", writable=False)
            if send.dtype != recv.dtype:
                raise TypeError(f"recvbuf has dtype {recv.dtype} but sendbuf has {send.dtype}; "
                                f"they must match")
            if send.size != hi - lo:
                raise ValueError(f"sendbuf has {send.size} elements; rank {comm.Get_rank()} "
                                 f"contributes block {comm.Get_rank()} of {recv.size} split "
                                 f"{comm.Get_size()} ways: {hi - lo}")
        check_algorithm(algorithm, None, "allgather")
        return Call(send, recv, None, algorithm, None, comm, collective="allgather")

    call = prepare("allgather", comm, check, local_checks, "allgather", timeout)
    n, p = call.recv.size, call.comm.Get_size()
    result = flat(call.recv)
    lo, hi = block(n, p, call.comm.Get_rank())
    load = () if call.send is None else ((flat(call.send), result[lo:hi]),)
    send = MPI.IN_PLACE if call.send is None else call.send
    native = lambda private, nonblocking: (private.Iallgatherv if nonblocking else
                                           private.Allgatherv)(send, [result, block_counts(n, p)])
    return _run(call, n, Layout((result,), load), native, timeout)


def bcast(buf, root=0, comm=None, algorithm="auto", check=True, timeout=None):
    """Broadcast ``buf`` from ``root`` to every rank, in place, as ``comm.Bcast(buf, root)``.

    Args:
        buf: the vector: input on the root, output everywhere (writable on every rank).
        root: the rank that holds the data.
        comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"binomial"``, ``"scatter_allgather"`` (van de Geijn: binomial scatter then
            ring allgather, for large messages), ``"native"`` or ``"auto"``.

    Returns:
        ``buf``.
    """
    def local_checks(comm):
        array = as_array(buf, "buf", writable=True)
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
                or not 0 <= root < comm.Get_size():
            raise ValueError(f"root must be a rank of comm (0..{comm.Get_size() - 1}), got {root!r}")
        check_algorithm(algorithm, None, "bcast")
        return Call(None, array, None, algorithm, None, comm, collective="bcast",
                     root=int(root))

    call = prepare("bcast", comm, check, local_checks, "bcast", timeout)
    native = lambda private, nonblocking: (private.Ibcast if nonblocking else private.Bcast)(
        call.recv, call.root)
    return _run(call, call.recv.size, Layout((flat(call.recv),)), native, timeout)


def alltoall(sendbuf, recvbuf=None, comm=None, algorithm="auto", check=True, timeout=None):
    """Send block j of ``sendbuf`` to rank j; block i of ``recvbuf`` comes from rank i.

    As ``comm.Alltoall(sendbuf, recvbuf)``: the n elements of ``sendbuf`` (n divisible by p)
    are p equal blocks.

    Args:
        sendbuf: this rank's n elements (any C-contiguous shape; read flat).
        recvbuf: n elements of the same dtype; ``None`` allocates one shaped like sendbuf.
        comm, check, timeout: as for :func:`allreduce`.
        algorithm: ``"pairwise"`` (p-1 exchanges with rank ± s), ``"native"`` or ``"auto"``.

    Returns:
        The result array (``recvbuf`` when given).
    """
    def local_checks(comm):
        no_in_place(sendbuf, "alltoall")
        send = as_array(sendbuf, "sendbuf", writable=False)
        if send.size % comm.Get_size():
            raise ValueError(f"sendbuf has {send.size} elements, not a multiple of the "
                             f"{comm.Get_size()} ranks: alltoall sends equal blocks")
        recv = (np.empty_like(send) if recvbuf is None
                else matching_recv(recvbuf, send, send.size, "alltoall"))
        check_algorithm(algorithm, None, "alltoall")
        return Call(send, recv, None, algorithm, None, comm, collective="alltoall")

    call = prepare("alltoall", comm, check, local_checks, "alltoall", timeout)
    n, p, rank = call.send.size, call.comm.Get_size(), call.comm.Get_rank()
    send, result = flat(call.send), flat(call.recv)
    lo, hi = block(n, p, rank)
    layout = Layout((send, result), ((send[lo:hi], result[lo:hi]),))
    native = lambda private, nonblocking: (private.Ialltoall if nonblocking else
                                           private.Alltoall)(call.send, call.recv)
    return _run(call, 2 * n, layout, native, timeout)
