"""mpiallreduce: allreduce algorithms over mpi4py point-to-point messages, checked against MPI."""

from .api import ALGORITHMS, allreduce, iallreduce, plan, start
from .collectives import allgather, alltoall, bcast, reduce_scatter
from .errors import CollectiveTimeout, ScheduleError
from .executor import Plan
from .nonblocking import Request
from .ops import AVG
from .topology import Topology

__version__ = "0.1.0"

__all__ = ["ALGORITHMS", "AVG", "CollectiveTimeout", "Plan", "Request", "ScheduleError", "Topology",
           "__version__",
           "allgather", "allreduce", "alltoall", "bcast", "iallreduce", "plan", "reduce_scatter",
           "start"]
