"""mpiallreduce: allreduce algorithms over mpi4py point-to-point messages, checked against MPI."""

from . import _checks, _state, _threads
from ._state import recover
from .api import ALGORITHMS, allreduce, iallreduce, plan, start
from .collectives import allgather, alltoall, bcast, reduce_scatter
from .comm import Comm
from .compression import TopK, cast_allreduce
from .errors import CollectiveTimeout, CommunicatorRevoked, ScheduleError
from .executor import Plan
from .grad import SGD, DelayedSync, GradSync, ShardedSGD
from .nonblocking import Request
from .ops import AVG
from .reproducible import ReproduciblePlan, dot, norm2, sum
from .shm import SharedArray, serve_states, shared_empty, shared_zeros
from .topology import Topology
from .tracing import trace

serve_states(_checks.check_comm, _state.state)  # how the transport's shared_empty finds a state

# below MPI_THREAD_MULTIPLE a second thread's call is refused (._threads; at MULTIPLE these are
# the functions themselves)
allreduce, iallreduce, plan, start = (_threads.guarded(f) for f in (allreduce, iallreduce,
                                                                     plan, start))
allgather, alltoall, bcast, reduce_scatter = (
    _threads.guarded(f) for f in (allgather, alltoall, bcast, reduce_scatter))
sum, dot, norm2, shared_empty, shared_zeros, recover = (  # noqa: A001 - mar.sum, as numpy's
    _threads.guarded(f) for f in (sum, dot, norm2, shared_empty, shared_zeros, recover))
_threads.guard_methods(Comm, ("Allreduce", "allreduce", "Reduce_scatter", "Reduce_scatter_block",
                              "Allgather", "Bcast", "Alltoall"))

from ._version import __version__  # noqa: E402 - after the guards, as before


def __getattr__(name):
    """``mar.torch``, imported on first use: the rest of the package never imports torch."""
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["ALGORITHMS", "AVG", "SGD", "CollectiveTimeout", "Comm", "CommunicatorRevoked",
           "DelayedSync", "GradSync", "Plan", "Request", "ReproduciblePlan", "ScheduleError",
           "SharedArray", "ShardedSGD", "TopK", "Topology", "__version__", "allgather",
           "allreduce", "alltoall", "bcast", "cast_allreduce", "dot", "iallreduce", "norm2",
           "plan", "recover", "reduce_scatter", "shared_empty", "shared_zeros", "start", "sum",
           "trace"]
