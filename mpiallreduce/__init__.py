"""mpiallreduce: allreduce algorithms over mpi4py point-to-point messages, checked against MPI."""

from .api import ALGORITHMS, allreduce, plan
from .collectives import allgather, alltoall, bcast, reduce_scatter
from .comm import Comm
from .errors import CollectiveTimeout, ScheduleError
from .executor import Plan
from .ops import AVG
from .topology import Topology

__version__ = "0.1.0"

__all__ = ["ALGORITHMS", "AVG", "CollectiveTimeout", "Comm", "Plan", "ScheduleError", "Topology",
           "__version__",
           "allgather", "allreduce", "alltoall", "bcast", "plan", "reduce_scatter"]
