"""Public entry points: ``allreduce``, ``plan`` and ``iallreduce``, short dispatch over the call path.

The call path: local checks (:mod:`._checks`), the agreement across ranks (:mod:`._agree`),
plan building (:mod:`._plans`) on the communicator's state (:mod:`._state`), then the executor.
A repeated one-shot call with the same objects skips everything but the agreement and the run;
where the run is ``shm`` the run checks the arguments itself and there is no separate agreement.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import _form, _plans
from . import reproducible as _reproducible
from ._agree import prepare
from ._checks import ALGORITHMS, COLLECTIVE_ALGORITHMS, allreduce_call
from ._state import SHAPES
from ._state import state as comm_state
from .collectives import allgather, alltoall, bcast, reduce_scatter
from .nonblocking import iallreduce as _iallreduce
from .nonblocking import start

__all__ = ["ALGORITHMS", "COLLECTIVE_ALGORITHMS", "allgather", "allreduce", "alltoall", "bcast",
           "iallreduce", "plan", "reduce_scatter", "start"]


def allreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
              check=True, timeout=None, reproducible=False, **params):
    """Combine ``sendbuf`` from every rank with ``op`` and return the result on every rank.

    A drop-in for ``comm.Allreduce(sendbuf, recvbuf, op)`` that runs one of mpiallreduce's
    schedules (or MPI's own, ``algorithm="native"``). Calls on one communicator match in call
    order on every rank, as MPI's collectives do.

    The plan bound on the first call is kept (per communicator, bounded; docs/howto/calls.md, "Call
    cost and caching") and reused while the same array objects, op, algorithm, topology and
    parameters come back with the same shape and dtype: a repeated call costs the agreement check
    (if ``check``) and the run. Pass ``recvbuf`` to benefit most: a result allocated per call is
    never cached, though a small one (up to 64 KiB, C-contiguous NumPy input) is remembered by its
    shape, as calls with fresh arrays are, and costs a staging copy more than a cached call.

    Args:
        sendbuf: C- or Fortran-contiguous array (or buffer-protocol / CPU DLPack object), or
            ``MPI.IN_PLACE``.
        recvbuf: result array of the same shape, dtype and memory order; ``None`` allocates one.
            In place, it holds the input and receives the result.
        op: a predefined ``MPI.Op`` valid for the dtype, ``mpiallreduce.AVG``, or a user op from
            ``MPI.Op.Create`` (non-commutative ones keep MPI's rank order).
        comm: any intracommunicator (default ``MPI.COMM_WORLD``).
        algorithm: one of ``ALGORITHMS``; ``"auto"`` picks by size, op and topology.
        topology: a ``Topology`` for ``hierarchical``/``cascade`` (default:
            ``Topology.from_comm(comm)``, computed once per communicator, which honours
            ``MPIALLREDUCE_RANKS_PER_NODE``). Its size must be the communicator's.
        check: agree on count, dtype, op, algorithm, parameters, topology and whether a timeout
            is set across ranks first (one 176-byte ``Allreduce``), so a mismatch or bad input on
            any rank raises the same exception everywhere instead of hanging. Pass the same
            ``check`` on every rank. Where the call runs ``shm``, its run compares all of these
            through the shared headers instead, at no extra cost.
        timeout: seconds before :class:`CollectiveTimeout` (default: wait forever), covering the
            first call's set-up too; give it on every rank or none. After a timeout,
            mpiallreduce refuses further calls and plans on ``comm``.
        reproducible: the same result bits for every algorithm, topology and rank order
            (SUM and AVG on float and complex dtypes; :mod:`.reproducible`, docs/howto/numerics.md
            "Reproducible sums"). Pass the same value on every rank.
        params: parameters of the named algorithm's schedule, e.g. ``segment_bytes=`` for
            ``ring_segmented``, ``inner=`` and ``intra=`` (``"auto"``: shared memory inside
            nodes that share it, ``"shm"``, ``"p2p"``) for ``hierarchical`` and ``cascade``;
            a parameter the algorithm does not take is a TypeError.

    Returns:
        The result array (``recvbuf`` when given).
    """
    if reproducible:
        return _reproducible.allreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                       timeout, params)
    return _plans.cached_call(_plans.ALLREDUCE, _bind, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                              timeout, params)


def _bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params):
    """An allreduce the call cache does not hold (:func:`._plans.cached_call`, whose arguments
    these are): known by its shape, or checked, bound, run and kept."""
    if recvbuf is None and type(sendbuf) is np.ndarray and sendbuf.nbytes <= _plans.STAGE_BYTES \
            and sendbuf.flags.c_contiguous:
        # ``total = mar.allreduce(local)``: the result array is made here, as the checks would,
        # so that a call like an earlier one is known by its shape (a fresh array per call)
        # instead of set up again
        recvbuf = allocated = np.empty_like(sendbuf)
    else:
        allocated = None
    if timeout is None and type(recvbuf) is np.ndarray:
        # a call with fresh arrays (a new np.array([dot]) per call): known by its shape
        shape = SHAPES.get(_plans.shape_key(comm, sendbuf, recvbuf, op, algorithm, topology,
                                            params))
        if shape is not None and _plans.fresh_arrays(sendbuf, recvbuf) \
                and not shape.repeats(sendbuf, recvbuf):
            return shape.call(sendbuf, recvbuf, check)
    return _plans.bind_one_shot(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                timeout, params, allocated=allocated is not None)


if _form.compiled is not None:
    # the compiled twin (mpiallreduce._compiled.allreduce): the same sequence, with no Python
    # frame between the caller and the run
    _form.compiled.install_api(_bind, _reproducible.allreduce, _reproducible.iallreduce)
    _form.compiled.allreduce.__doc__ = allreduce.__doc__
    _form.compiled.allreduce.__wrapped__ = allreduce  # its signature, for inspect and help()
    allreduce = _form.compiled.allreduce  # noqa: F811


def plan(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
         check=True, timeout=None, reproducible=False, **params):
    """Bind an allreduce to its buffers once; ``run()`` repeats it with no allocation.

    Arguments as :func:`allreduce`. Creating a plan is collective, and plans on one
    communicator are created and run in the same order on every rank (MPI-4's rule for
    persistent collectives); each plan's messages use tags of its own, so plans run out of order
    wait (or time out) instead of exchanging data. The cross-rank ``check`` runs once, here;
    ``run()`` trusts the buffers' contents and shapes thereafter. Use as a context manager or
    call ``free()``.
    """
    if reproducible:
        return _reproducible.plan(sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout,
                                  params)
    call = prepare("plan", comm, check, lambda comm: allreduce_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout)
    state = comm_state(call.comm)
    deadline = None if timeout is None else time.monotonic() + timeout
    return _plans.build(call, state, explicit=True, persistent=True, timeout=timeout,
                        deadline=deadline, what="plan")


def iallreduce(sendbuf, recvbuf=None, op=MPI.SUM, comm=None, algorithm="auto", topology=None,
               check=True, timeout=None, reproducible=False, **params):
    """Start an allreduce and return a :class:`Request` (see :func:`.nonblocking.iallreduce`);
    ``reproducible=True`` as in :func:`allreduce`."""
    if reproducible:
        return _reproducible.iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check,
                                        timeout, params)
    return _iallreduce(sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params)


if _form.compiled is not None:  # the compiled twin, as allreduce's
    _form.compiled.iallreduce.__doc__ = iallreduce.__doc__
    _form.compiled.iallreduce.__wrapped__ = iallreduce
    iallreduce = _form.compiled.iallreduce  # noqa: F811
