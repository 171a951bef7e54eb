"""Alpha-beta-gamma cost model: time the schedules the executor runs, on a model machine.

    python -m mpiallreduce.model predict --ranks 4096 --ranks-per-node 8 --sizes 8:1G
    mpirun -n 2 python -m mpi4py -m mpiallreduce.model calibrate -o machine.json   # runs
        # mpiallreduce.calibrate, a client above the model: the model itself runs no MPI

The model (Hockney's alpha-beta with a reduction term, as in Thakur, Rabenseifner & Gropp 2005,
plus a per-step interpreter term): a message of b bytes on a link costs α + bβ, with (α, β) of
the intra-node or the inter-node link depending on whether the two ranks share a node of the
:class:`~mpiallreduce.topology.Topology` (or, where ``calibrate`` measured it, the link's
one-way time curve by message size: protocol switch and caches); reducing b received bytes
costs bγ (γ per dtype, by combine size where measured); every non-empty step costs ``step``
seconds of Python, plus ``request`` per message it starts and waits and ``combine`` per
reducing receive (what the executor does per step and MPI's C code does not), every run
``call`` seconds. In place (``in_place=True``) the executor's reducing receives go through
scratch and, between the sizes of ``ops.SCRATCH_COMBINE``, a copy back. Native is Open MPI's
decision table in C with its copies per mode; ``"shm"`` the shared-memory transport's regimes
in closed form with a node memory-bandwidth bound.

The simulator walks the same :class:`~mpiallreduce.schedule.Schedule` steps the executor runs,
with one clock per rank. In step k a rank is ready at ``clock + step``; a message starts when
both its sender and its receiver are ready; the messages a rank sends in one step share its
send port, those it receives share its receive port (per link class; a port carrying messages
of total cost Σ(α + bβ) finishes them all after that sum: fair sharing), so a message ends at
``start + max(sender's send load, receiver's receive load)``. The step ends when every message of
the rank has ended, plus γ times the bytes it reduces. Empty steps cost nothing (the executor
skips them), and so do zero-byte messages (it does not send them).

Scale (symmetry). Building every rank's program costs O(p) programs, and a ring's programs
have O(p) steps each: 33 million messages at 4096 ranks. The simulator instead partitions the
ranks into classes that it expects to have identical programs up to relabelling: all ranks one
class, then ranks of equal local index on nodes of equal size; it builds only one representative
program per class (the lowest rank) and simulates one clock per class. A candidate partition is
accepted only if the representatives' programs are consistent as a quotient schedule: in every
step, every (sender class, receiver class, bytes, link) that some representative sends is
received by the receiver class's representative, and the other way round. The binomial tree
(rank 0 is the root) fails both candidates; it, recursive doubling, Rabenseifner, and the
ring below p elements take exact paths instead (see ``_base_parts``): every rank simulated
in NumPy from a table built once per (p, topology), or, for the ring, from rank 0's rotated
program touching only the ranks that hold data. Ranks of one
class get the same clock, which is exact when the schedule is symmetric (p and the count
divisible as the closed forms assume) and otherwise off by the one-element differences of the
block distribution; ``symmetric=False`` builds every rank (the tests compare both).

Modules: ``machine`` (links, switches, cores, the built-in machine), ``programs`` (cost programs,
the quotient by symmetry, the exact-path tables), ``simulate`` (the clocks), ``native`` (Open
MPI's decision table), ``prediction`` (:func:`predict`, :func:`choose`), ``fit`` (a machine
from measured numbers: :func:`fit_alpha_beta`, :func:`machine_from`), ``shm_layout`` (the
shared-memory transport's regime sizes as the model describes them), ``cli`` (the command line
and its plots). The package is pure prediction over schedules and machine files: it imports
no MPI, and nothing of the layers above it or of the transport; what measures a machine is
:mod:`mpiallreduce.calibrate`.
"""

from .cli import build_parser, main, predict_table
from .fit import fit_alpha_beta, machine_from
from .machine import (
    DEFAULT_MACHINE,
    INTER,
    INTRA,
    LINK_NAMES,
    NETWORK_100G,
    SHARP_LLT,
    SHARP_SAT,
    SWITCHES,
    Link,
    Machine,
    Oversubscribed,
    Switch,
    check_cores,
)
from .native import (
    OMPI_ALLREDUCE_COMMUTATIVE,
    OMPI_ALLREDUCE_NONCOMMUTATIVE,
    OMPI_COPIES,
    native_algorithm,
)
from .prediction import SHARP, SHM, candidates, choose, native_copies, predict
from .programs import ROTATION_INVARIANT
from .simulate import PAIRS_RANKS, Prediction

__all__ = [
    "DEFAULT_MACHINE", "INTER", "INTRA", "LINK_NAMES", "NETWORK_100G", "OMPI_ALLREDUCE_COMMUTATIVE",
    "OMPI_ALLREDUCE_NONCOMMUTATIVE", "OMPI_COPIES", "PAIRS_RANKS", "ROTATION_INVARIANT",
    "SHARP", "SHARP_LLT", "SHARP_SAT", "SHM", "SWITCHES", "Link", "Machine", "Oversubscribed",
    "Prediction", "Switch", "build_parser", "candidates", "check_cores", "choose",
    "fit_alpha_beta", "machine_from", "main", "native_algorithm", "native_copies", "predict",
    "predict_table",
]
