"""Calls from a second thread below ``MPI_THREAD_MULTIPLE``: refused with one clear error.

MPI's thread level is fixed when MPI starts (``mpi4py.rc.thread_level``). At
``MPI_THREAD_MULTIPLE`` (mpi4py's default) any thread may call mpiallreduce, one communicator
per thread at a time, and nothing here runs: the entry points are not wrapped at all. Below it
MPI forbids what a second thread's call would do (``SINGLE`` and ``FUNNELED``: MPI calls from
the main thread only; ``SERIALIZED``: from one thread at a time, which mpiallreduce's state
does not check), so the entry points are wrapped (:func:`guarded`): the first thread that
calls mpiallreduce in the process (the main thread, at ``SINGLE`` and ``FUNNELED``) is the
only one that may, and any other raises RuntimeError before anything is touched.
"""

from __future__ import annotations

import functools
import threading

from mpi4py import MPI

#: the process's MPI thread level, and whether entry points check the calling thread
LEVEL = MPI.Query_thread()
GUARDED = LEVEL < MPI.THREAD_MULTIPLE
NAMES = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
         MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
_owner: list = []  # the one thread that may call (its ident), once it has


def check(what: str) -> None:
    """Raise RuntimeError unless the calling thread may call mpiallreduce at this level."""
    me = threading.get_ident()
    if not _owner:
        if LEVEL <= MPI.THREAD_FUNNELED and threading.current_thread() is not \
                threading.main_thread():
            _refuse(what, "only the main thread may call MPI")
        _owner.append(me)
    elif _owner[0] != me:
        _refuse(what, "mpiallreduce was first called from another thread, the only one that "
                      "may call it")


def _refuse(what: str, why: str) -> None:
    raise RuntimeError(
        f"{what} from thread {threading.current_thread().name!r}: MPI was initialised with "
        f"{NAMES.get(LEVEL, LEVEL)}, where {why}; to call mpiallreduce from several threads, "
        f"start MPI with MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple', mpi4py's "
        f"default)")


def guarded(function, what: str | None = None):
    """``function`` itself at ``MPI_THREAD_MULTIPLE``; below it, ``function`` after
    :func:`check` (``what``: the call, as the refusal names it)."""
    if not GUARDED:
        return function
    what = what or getattr(function, "__name__", "mpiallreduce")

    @functools.wraps(function)
    def call(*args, **kwargs):
        check(what)
        return function(*args, **kwargs)
    return call


def guard_methods(cls, names) -> None:
    """Wrap the methods ``names`` that ``cls`` defines itself with :func:`guarded` (below
    ``MPI_THREAD_MULTIPLE`` only)."""
    if GUARDED:
        for name in names:
            if name in vars(cls):
                setattr(cls, name, guarded(vars(cls)[name], f"{cls.__name__}.{name}"))
