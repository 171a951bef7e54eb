"""Alpha-beta-gamma cost model: time the schedules the executor runs, on a model machine.

    python -m mpiallreduce.model predict --ranks 4096 --ranks-per-node 8 --sizes 8:1G
    mpirun -n 2 python -m mpi4py -m mpiallreduce.model calibrate -o machine.json

The model (Hockney's alpha-beta with a reduction term, as in Thakur, Rabenseifner & Gropp 2005,
plus a per-step interpreter term): a message of b bytes on a link costs α + bβ, with (α, β) of
the intra-node or the inter-node link depending on whether the two ranks share a node of the
:class:`~mpiallreduce.topology.Topology`; reducing b received bytes costs bγ (γ per dtype);
every non-empty step costs ``step`` seconds of Python (posting, waiting, looping: what the
executor does per step and MPI's C code does not), every run ``call`` seconds.

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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import numpy as np

from . import algorithms
from .errors import ScheduleError
from .schedule import REDUCE
from .topology import Topology

INTRA, INTER = 0, 1
LINK_NAMES = ("intra", "inter")
#: native is modelled as Open MPI 5.0's coll/tuned fixed decision, which is what runs on one
#: node (coll/han, priority 35, steps aside without remote peers; tuned has 30):
#: ``ompi_coll_tuned_allreduce_intra_dec_fixed`` in ``coll_tuned_decision_fixed.c``. Rows:
#: (communicator sizes below, ((bytes per rank below, algorithm), ...)), None for no bound.
#: Open MPI's algorithms: 1 basic_linear, 2 nonoverlapping (reduce + bcast), 3 recursive
#: doubling, 4 ring, 5 segmented ring (with the table's segment size 0 it runs the ring),
#: 6 Rabenseifner.
OMPI_ALLREDUCE_COMMUTATIVE = (
    (4, ((8, 4), (4096, 3), (8192, 4), (16384, 3), (65536, 4), (262144, 5), (None, 6))),
    (8, ((16, 4), (8192, 3), (None, 6))),
    (16, ((8192, 3), (None, 6))),
    (32, ((64, 5), (4096, 3), (None, 6))),
    (64, ((128, 5), (None, 6))),
    (128, ((262144, 3), (None, 6))),
    (256, ((131072, 2), (262144, 3), (None, 6))),
    (512, ((4096, 2), (None, 6))),
    (2048, ((2048, 2), (16384, 3), (None, 6))),
    (4096, ((2048, 2), (4096, 5), (16384, 3), (None, 6))),
    (None, ((2048, 2), (16384, 5), (32768, 3), (None, 6))),
)
OMPI_ALLREDUCE_NONCOMMUTATIVE = (
    (4, ((131072, 3), (None, 1))),
    (8, ((None, 3),)),
    (16, ((1048576, 3), (None, 2))),
    (128, ((None, 3),)),
    (256, ((131072, 2), (524288, 3), (None, 2))),
    (512, ((4096, 2), (524288, 3), (None, 2))),
    (None, ((2048, 2), (None, 3))),
)
#: Open MPI's algorithms that copy the whole message per call, out of place: recursive
#: doubling allocates a temporary and copies the input into it, the ring copies sendbuf into
#: recvbuf, Rabenseifner allocates a temporary and copies sendbuf into recvbuf.
OMPI_COPIES = frozenset({3, 4, 5, 6})


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    def __post_init__(self):
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"link {name} must be a number >= 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class Switch:
    """In-network reduction (SHARP-like): switches reduce the data as it passes. Modelled only.

    One aggregation operation of b bytes among N node leaders costs
    ``alpha + 2·levels(N)·hop + (chunks - 1)·chunk + b·beta``: the host's post/inject/eject
    (``alpha``), one reduction per switch level up the tree and the result back down (``hop``
    per level and direction, ``levels = ⌈log_radix N⌉``), and the stream through the tree
    (``beta``). A message above ``limit`` bytes is split into ``⌈b/limit⌉`` operations that
    are pipelined: each extra one adds ``chunk`` (the switch's per-operation turnaround), so
    the time grows linearly in b above the limit.

    Args:
        radix: nodes (or child switches) under one switch of the aggregation tree.
        name, source: a label, and where the numbers come from (printed by ``predict``).
    """

    alpha: float
    hop: float
    beta: float
    chunk: float
    limit: int
    radix: int
    name: str = "switch"
    source: str = ""

    def __post_init__(self):
        for name in ("alpha", "hop", "beta", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"switch {name} must be a number >= 0 (seconds), got {value!r}")
        for name, least in (("limit", 1), ("radix", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"switch {name} must be an integer >= {least}, got {value!r}")

    def levels(self, nnodes: int) -> int:
        """Switch levels of the aggregation tree over ``nnodes`` leaves (at least 1)."""
        levels, reach = 1, self.radix
        while reach < nnodes:
            levels, reach = levels + 1, reach * self.radix
        return levels

    def chunks(self, nbytes: int) -> int:
        """Aggregation operations for ``nbytes``: ⌈nbytes / limit⌉, at least 1."""
        return max(1, -(-int(nbytes) // self.limit))

    def time(self, nnodes: int, nbytes: int) -> float:
        """Seconds of one in-network allreduce of ``nbytes`` among ``nnodes`` leaders."""
        if nnodes <= 1:
            return 0.0
        return (self.alpha + 2 * self.levels(nnodes) * self.hop
                + (self.chunks(nbytes) - 1) * self.chunk + nbytes * self.beta)


#: SHARP's low-latency aggregation (LLT) on Switch-IB 2 (EDR, 100 Gb/s), fitted to Graham et
#: al., "Scalable Hierarchical Aggregation Protocol (SHArP): A Hardware Architecture for
#: Efficient Data Reduction", COMHPC@SC 2016: MPI_Allreduce on 128 hosts took 2.83 µs at 8 B
#: and 14.48 µs at 4096 B with SHArP (6.01 and 46.93 µs without). The payload per operation
#: is 256 B on Switch-IB 2 (NVIDIA SHARP v2.6.1 docs, SHARP_COLL_JOB_QUOTA_PAYLOAD_PER_OST:
#: "256B on Switch-IB 2, 2048B on Quantum"; larger requests are pipelined). Assumed: the host
#: part α is the 100 Gb/s network's 2 µs, a radix of 18 (36-port switches, half the ports down:
#: 2 levels at 128 hosts), β the network's; then 8 B gives 2 + 4·hop = 2.83 µs and 4096 B
#: (16 operations) 2.83 + 15·chunk + 4096β = 14.48 µs.
SHARP_LLT = Switch(alpha=2.0e-6, hop=0.2075e-6, beta=8.0e-11, chunk=0.7548e-6, limit=256,
                   radix=18, name="sharp-llt",
                   source="fitted to Graham et al., COMHPC@SC 2016 (SHArP, Switch-IB 2, EDR: "
                          "8 B 2.83 us, 4 KiB 14.48 us at 128 hosts); 256 B per operation "
                          "(NVIDIA SHARP docs); host alpha, radix 18 and beta assumed")

#: SHARP's streaming aggregation (SAT) on Quantum (HDR): Graham et al., "SHARP Streaming-
#: Aggregation Hardware Design and Evaluation", ISC 2020, measured MPI_Allreduce bandwidth at
#: about 95% of the network's; the NVIDIA SHARP docs (v2.6.1) give 1073741792 B (1 GiB less
#: 32 B) as the largest SAT message. β is the model's 100 Gb/s network at 95%; α, hop and
#: chunk are assumed equal to the LLT fit (no latency figure found), radix 20 (40-port Quantum).
SHARP_SAT = Switch(alpha=2.0e-6, hop=0.2075e-6, beta=8.0e-11 / 0.95, chunk=0.7548e-6,
                   limit=1073741792, radix=20, name="sharp-sat",
                   source="Graham et al., ISC 2020 (SHARP streaming aggregation, HDR: ~95% of "
                          "network bandwidth); 1 GiB - 32 B per operation (NVIDIA SHARP docs); "
                          "alpha, hop, chunk assumed as sharp-llt's, radix 20 assumed")

SWITCHES = {switch.name: switch for switch in (SHARP_LLT, SHARP_SAT)}


@dataclass(frozen=True)
class Machine:
    """Model parameters: two link classes, γ per dtype, and the interpreter's terms.

    Args:
        intra: link between ranks of one node (shared memory).
        inter: link between nodes (the network).
        gamma: ``((dtype name, seconds per reduced byte), ...)``; dtypes not listed use float32's.
        step: seconds of Python per non-empty step of a schedule (the executor's loop).
        call: seconds of Python per ``Plan.run()`` call, beyond its steps.
        copy: seconds per byte to allocate a fresh buffer and copy into it: what Open MPI's
            recursive doubling, ring and Rabenseifner pay per call on the whole message
            (:data:`OMPI_COPIES`), and the schedules do not.
        native_call: seconds per call of MPI's own ``Allreduce`` from Python beyond its
            messages: mpi4py's call and the collective's entry, which a point-to-point
            ping-pong does not include.
        switch: in-network reduction (:class:`Switch`), or ``None``: only the modelled
            algorithm ``"sharp"`` uses it.
        cores: cores per node, or ``None`` (not checked). A prediction that puts more ranks
            on a node than it has cores is refused (:class:`Oversubscribed`): ranks then wait
            for a time slice, which no term of the model describes.
        info: where the numbers come from (MPI library, host, date); not compared.
    """

    intra: Link
    inter: Link
    gamma: tuple[tuple[str, float], ...]
    step: float = 0.0
    call: float = 0.0
    copy: float = 0.0
    native_call: float = 0.0
    cores: int | None = None
    switch: Switch | None = None
    info: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.cores is not None and (isinstance(self.cores, bool)
                                       or not isinstance(self.cores, int) or self.cores < 1):
            raise ValueError(f"machine cores must be a positive integer (per node) or None, "
                             f"got {self.cores!r}")

    def link(self, kind: int) -> Link:
        return self.inter if kind == INTER else self.intra

    def gamma_for(self, dtype) -> float:
        """Seconds per reduced byte for ``dtype`` (float32's value for dtypes not calibrated)."""
        table = dict(self.gamma)
        return table.get(np.dtype(dtype).name, table.get("float32", 0.0))

    def native(self) -> Machine:
        """The same machine without interpreter terms: what MPI's own C code pays."""
        return replace(self, step=0.0, call=0.0)

    def to_dict(self) -> dict:
        return {"intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
                "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta},
                "gamma": dict(self.gamma), "step": self.step, "call": self.call,
                "copy": self.copy, "native_call": self.native_call, "cores": self.cores,
                "switch": None if self.switch is None else asdict(self.switch), "info": self.info}

    @classmethod
    def from_dict(cls, data: dict) -> Machine:
        """Build a Machine from :meth:`to_dict`'s layout; ValueError names what is missing."""
        if not isinstance(data, dict):
            raise ValueError(f"a machine description is a JSON object, got {type(data).__name__}")
        try:
            intra = Link(float(data["intra"]["alpha"]), float(data["intra"]["beta"]))
            inter = Link(float(data["inter"]["alpha"]), float(data["inter"]["beta"]))
            gamma = tuple(sorted((str(k), float(v)) for k, v in data["gamma"].items()))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"machine description lacks {error}: it needs intra.alpha, "
                             f"intra.beta, inter.alpha, inter.beta and gamma "
                             f"{{dtype: s/B}}") from None
        cores, switch = data.get("cores"), data.get("switch")
        if switch is not None:
            try:
                switch = Switch(**switch)
            except TypeError as error:
                raise ValueError(f"machine switch: {error} (it needs alpha, hop, beta, chunk, "
                                 f"limit, radix)") from None
        return cls(intra, inter, gamma, step=float(data.get("step", 0.0)),
                   call=float(data.get("call", 0.0)), copy=float(data.get("copy", 0.0)),
                   native_call=float(data.get("native_call", 0.0)),
                   cores=None if cores is None else int(cores), switch=switch,
                   info=dict(data.get("info", {})))

    @classmethod
    def load(cls, path: str) -> Machine:
        """Read a machine file written by ``calibrate`` (or by hand)."""
        with open(path, encoding="utf-8") as handle:
            try:
                data = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not JSON ({error})") from None
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")


#: a 100 Gb/s network (InfiniBand HDR100/EDR, 100 GbE RoCE): β = 8 bits / 100e9 b/s = 8e-11 s/B,
#: α ≈ 2 µs, the one-way small-message latency ``osu_latency`` reports between two such nodes.
NETWORK_100G = Link(alpha=2.0e-6, beta=8.0e-11)

#: built-in machine: intra-node numbers from ``mpirun -n 2 python -m mpi4py -m
#: mpiallreduce.model calibrate`` on the 2-core VM of the README (scripts/machine-vm.json),
#: a 100 Gb/s network between nodes.
DEFAULT_MACHINE = Machine(
    intra=Link(alpha=1.50e-6, beta=1.43e-10),
    inter=NETWORK_100G,
    gamma=(("float32", 7.8e-11), ("float64", 7.6e-11), ("int32", 7.8e-11), ("int64", 8.0e-11)),
    step=2.86e-6,
    call=0.0,
    copy=2.71e-10,
    # native measured less native modelled at 2 ranks, median over 8 B..1 KiB, in the quiet
    # VM's run of scripts/predict_vs_measured-vm.txt (2026-11-30): 0.75-1.24 µs
    native_call=0.94e-6,
    info={"source": "built-in: intra-node, gamma, step and copy calibrated on the quiet 2-core "
                    "VM (Open MPI 5.0.11, 2026-11-30, after the executor's flat run loop); "
                    "inter-node a 100 Gb/s network"},
)


class Oversubscribed(ValueError):
    """A prediction for more ranks on a node than the node has cores (not modelled)."""


def check_cores(ranks_per_node: int, machine: Machine) -> None:
    """Raise :class:`Oversubscribed` when ``ranks_per_node`` exceeds ``machine.cores``.

    Ranks beyond the cores run in turns: a rank waiting for a message spins through its time
    slice while the sender is not scheduled, so a step costs scheduler quanta, not α + bβ.
    Measured on the 2-core VM (issue 24), runs at 4 ranks took 1-7x and at 8 ranks 2.5-14x
    the model's prediction, with a spread that follows the machine's other load, so no single
    core-sharing factor calibrated there would be credible: the model refuses instead of
    being 10x wrong.
    """
    if machine.cores is not None and ranks_per_node > machine.cores:
        raise Oversubscribed(
            f"{ranks_per_node} ranks on a node of {machine.cores} cores: ranks would share "
            f"cores, and the model has no core-sharing term (oversubscribed runs measured 1-14x "
            f"its predictions); predict at most {machine.cores} ranks per node, or describe a "
            f"node with more cores (--cores-per-node, or \"cores\" in the machine file)")


# -- cost programs: a rank's steps reduced to what the model needs ---------------------------------

@dataclass(frozen=True, slots=True)
class _CostStep:
    """One rank's non-empty step: its sends, its port loads per link class, bytes it reduces."""

    sends: tuple[tuple[int, int, int], ...]      # (peer, bytes, link) of non-empty sends
    send_count: tuple[int, int]                  # messages per link class
    send_bytes: tuple[int, int]
    recv_count: tuple[int, int]
    recv_bytes: tuple[int, int]
    reduced: int                                 # bytes combined into the buffer
    recvs: tuple[tuple[int, int, int], ...]      # (peer, bytes, link): for the quotient check


def _cost_step(sends, recvs, reduced: int, intern: dict) -> _CostStep:
    """Return the (interned) cost step of ``(peer, bytes, link)`` sends and receives."""
    key = (sends, recvs, reduced)
    found = intern.get(key)
    if found is None:
        count, volume, rcount, rvolume = [0, 0], [0, 0], [0, 0], [0, 0]
        for _, nbytes, link in sends:
            if nbytes:
                count[link] += 1
                volume[link] += nbytes
        for _, nbytes, link in recvs:
            if nbytes:
                rcount[link] += 1
                rvolume[link] += nbytes
        found = intern[key] = _CostStep(tuple(s for s in sends if s[1]), tuple(count),
                                        tuple(volume), tuple(rcount), tuple(rvolume), reduced,
                                        recvs)
    return found


def _compile(steps, rank: int, node: Sequence[int], itemsize: int, intern: dict
             ) -> list[_CostStep | None]:
    """Reduce one rank's steps to cost steps (``None`` for an empty step).

    Equal cost steps are one object (``intern``), so the simulator can tell repeated steps
    apart by identity.
    """
    program: list[_CostStep | None] = []
    mine = node[rank]
    for step in steps:
        if not step:
            program.append(None)
            continue
        sends = tuple([(s.peer, (s.stop - s.start) * itemsize, INTER if node[s.peer] != mine
                        else INTRA) for s in step.sends])
        recvs = tuple([(r.peer, (r.stop - r.start) * itemsize, INTER if node[r.peer] != mine
                        else INTRA) for r in step.recvs])
        reduced = sum([r.stop - r.start for r in step.recvs if r.action == REDUCE]) * itemsize
        program.append(_cost_step(sends, recvs, reduced, intern))
    return program


def _rotate(program, rank: int, nranks: int, node: Sequence[int], intern: dict, memo: dict):
    """Rank 0's cost program as rank ``rank``'s in a rotation-invariant schedule (peers + rank)."""
    mine = node[rank]
    rotated = []
    for cost in program:
        if cost is None:
            rotated.append(None)
            continue
        key = (id(cost), rank)
        found = memo.get(key)
        if found is None:
            def moved(messages):
                return tuple((peer, nbytes, INTER if node[peer] != mine else INTRA)
                             for peer, nbytes in (((rank + p) % nranks, b)
                                                  for p, b, _ in messages))
            found = memo[key] = _cost_step(moved(cost.sends), moved(cost.recvs), cost.reduced,
                                           intern)
        rotated.append(found)
    return rotated


@dataclass(frozen=True)
class _Quotient:
    """Classes of ranks with one representative program each (every rank its own in full mode)."""

    reps: tuple[int, ...]
    class_of: tuple[int, ...]
    sizes: tuple[int, ...]
    programs: tuple[tuple[_CostStep | None, ...], ...]
    partition: str

    @property
    def full(self) -> bool:
        return len(self.reps) == len(self.class_of)


def _partitions(topology: Topology, rotation: bool = False):
    """Candidate partitions, coarsest first: (label, class of every rank).

    For a rotation-invariant schedule only the one that fits the topology: one class when every
    link is of one kind (one node, or one rank per node), ranks of equal local index on nodes
    of equal size, else none (every rank is simulated, each program rotated from rank 0's).
    """
    nranks = topology.nranks
    sizes = set(topology.node_sizes)
    uniform = topology.nnodes == 1 or sizes == {1}
    if not rotation or uniform:
        yield "one class", (0,) * nranks
    if topology.nnodes > 1 and len(sizes) == 1 and topology.contiguous and not uniform:
        yield "local rank", topology.local_rank


def _consistent(programs, class_of) -> bool:
    """True when the representatives' programs match as a quotient schedule (see module doc)."""
    length = max((len(p) for p in programs), default=0)
    previous = None
    for k in range(length):
        costs = tuple(program[k] if k < len(program) else None for program in programs)
        if costs == previous:  # interned: the same step again, already checked
            continue
        previous = costs
        sent, received = set(), set()
        for index, cost in enumerate(costs):
            if cost is None:
                continue
            for peer, nbytes, link in cost.sends:
                sent.add((index, class_of[peer], nbytes, link))
            for peer, nbytes, link in cost.recvs:
                if nbytes:
                    received.add((class_of[peer], index, nbytes, link))
        if sent != received:
            return False
    return True


#: schedules in which rank r's program is rank 0's with every peer moved by +r (mod p) and the
#: ranges rotated: only rank 0's program is built (``tests/test_model.py`` checks the property).
ROTATION_INVARIANT = frozenset({"ring", "ring_segmented"})


def _builder_params(name: str, itemsize: int, params: dict) -> dict:
    accepted = algorithms.get(name).params
    merged = dict(params)
    if "itemsize" in accepted:
        merged.setdefault("itemsize", itemsize)
    return merged


@lru_cache(maxsize=512)
def _quotient(name: str, nranks: int, count: int, topology: Topology, itemsize: int,
              params: tuple, symmetric: bool) -> _Quotient:
    """Build the cost programs of ``name``: a representative per class, or every rank."""
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    node = topology.node
    built: dict[int, list] = {}
    intern: dict = {}
    memo: dict = {}

    def program(rank: int):
        if rank not in built:
            if name in ROTATION_INVARIANT and rank and symmetric:
                built[rank] = _rotate(program(0), rank, nranks, node, intern, memo)
            else:
                steps = algorithm.steps(rank, nranks, count, topology=topology, **merged)
                built[rank] = _compile(steps, rank, node, itemsize, intern)
        return built[rank]

    if symmetric:
        for label, labels in _partitions(topology, name in ROTATION_INVARIANT):
            ids: dict = {}
            class_of = tuple(ids.setdefault(label_, len(ids)) for label_ in labels)
            reps = [0] * len(ids)
            sizes = [0] * len(ids)
            for rank in range(nranks - 1, -1, -1):
                reps[class_of[rank]] = rank
                sizes[class_of[rank]] += 1
            programs = [program(rep) for rep in reps]
            # rotation moves ranks of one local index onto each other and keeps the links;
            # only block sizes may differ (by one element), so no check
            if name in ROTATION_INVARIANT or _consistent(programs, class_of):
                return _Quotient(tuple(reps), class_of, tuple(sizes),
                                 tuple(tuple(p) for p in programs), label)
    programs = tuple(tuple(program(rank)) for rank in range(nranks))
    return _Quotient(tuple(range(nranks)), tuple(range(nranks)), (1,) * nranks, programs,
                     "every rank")


# -- exact paths for schedules without symmetry: ranges as slot spans, every rank in NumPy -----------

def _base_parts(name: str, nranks: int, count: int) -> int | None:
    """Slots whose block-distributed spans are every range of ``name`` at any ``count``, or None.

    Tree and recursive doubling move the whole vector (one slot); Rabenseifner moves spans of
    its pof2 slots; the ring and, while every block holds at most one element (count < p), the
    segmented ring move single ring blocks. Building the schedule once at ``count = parts``
    (one element per slot) gives every range of every other count by :func:`_span_sizes`:
    ``tests/test_model.py`` checks the result against the per-count simulation.
    """
    if name in ("tree", "recursive_doubling"):
        return 1
    if name == "rabenseifner":
        return 1 << (nranks.bit_length() - 1)
    if name in ROTATION_INVARIANT and count < nranks:
        return nranks
    return None


def _span_sizes(count: int, parts: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elements in slots ``[lo, hi)`` of ``count`` split ``parts`` ways (partition.block)."""
    q, r = divmod(count, parts)
    return (hi * q + np.minimum(hi, r)) - (lo * q + np.minimum(lo, r))


@dataclass(frozen=True)
class _Table:
    """Every rank's messages and reductions at the base count, as arrays (slot ranges)."""

    parts: int
    active: np.ndarray                  # (steps, p) bool: the rank's step is non-empty
    sends: tuple[tuple[np.ndarray, ...], ...]    # per step: sender, receiver, link, lo, hi
    reduces: tuple[tuple[np.ndarray, ...], ...]  # per step: rank, lo, hi of REDUCE receives


@lru_cache(maxsize=32)
def _table(name: str, nranks: int, topology: Topology, itemsize: int, params: tuple,
           parts: int) -> _Table:
    """Build every rank's program once at ``count = parts`` and keep it as slot ranges."""
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    node = topology.node
    programs = [algorithm.steps(rank, nranks, parts, topology=topology, **merged)
                for rank in range(nranks)]
    length = max((len(p) for p in programs), default=0)
    active = np.zeros((length, nranks), dtype=bool)
    sends, reduces = [], []
    for k in range(length):
        out, red = [], []
        for rank, program in enumerate(programs):
            if k >= len(program) or not program[k]:
                continue
            active[k, rank] = True
            mine = node[rank]
            for s in program[k].sends:
                out.append((rank, s.peer, INTER if node[s.peer] != mine else INTRA,
                            s.start, s.stop))
            for r in program[k].recvs:
                if r.action == REDUCE:
                    red.append((rank, r.start, r.stop))
        out_array = np.asarray(out, dtype=np.int64).reshape(-1, 5)
        red_array = np.asarray(red, dtype=np.int64).reshape(-1, 3)
        sends.append(tuple(out_array.T))
        reduces.append(tuple(red_array.T))
    return _Table(parts, active, tuple(sends), tuple(reduces))


def _exchange(ready: np.ndarray, sender, receiver, link, nbytes, links) -> np.ndarray:
    """End time of every rank after one step's messages (the rules of :func:`_run`)."""
    end = ready.copy()
    if len(sender) == 0:
        return end
    alpha = np.array([links[0].alpha, links[1].alpha])
    beta = np.array([links[0].beta, links[1].beta])
    cost = alpha[link] + nbytes * beta[link]
    size = 2 * len(ready)
    send_port, recv_port = sender * 2 + link, receiver * 2 + link
    send_load = np.bincount(send_port, weights=cost, minlength=size)
    recv_load = np.bincount(recv_port, weights=cost, minlength=size)
    finish = (np.maximum(ready[sender], ready[receiver])
              + np.maximum(send_load[send_port], recv_load[recv_port]))
    np.maximum.at(end, sender, finish)
    np.maximum.at(end, receiver, finish)
    return end


#: above this many ranks the exact paths leave ``Prediction.pairs`` out (``None``): a dict of
#: every (sender, receiver) pair costs more than the simulation itself.
PAIRS_RANKS = 512


def _totals(nranks: int, sender, receiver, link, nbytes):
    """(sent bytes, sent messages per rank, link bytes, link messages, pairs) of message arrays."""
    sent_bytes = np.bincount(sender, weights=nbytes, minlength=nranks).astype(np.int64)
    sent_messages = np.bincount(sender, minlength=nranks).astype(np.int64)
    link_bytes = tuple(int(nbytes[link == kind].sum()) for kind in (INTRA, INTER))
    link_messages = tuple(int((link == kind).sum()) for kind in (INTRA, INTER))
    pairs = None
    if nranks <= PAIRS_RANKS:
        keys = sender * nranks + receiver
        unique, index, counts = np.unique(keys, return_inverse=True, return_counts=True)
        sums = np.bincount(index, weights=nbytes, minlength=len(unique)).astype(np.int64)
        pairs = {(int(k) // nranks, int(k) % nranks): (int(c), int(b))
                 for k, c, b in zip(unique, counts, sums)}
    return sent_bytes, sent_messages, link_bytes, link_messages, pairs


def _simulate_table(table: _Table, count: int, itemsize: int, machine: Machine, gamma: float
                    ) -> tuple[np.ndarray, tuple, int]:
    """Every rank's clock through the table at ``count``: exact, O(messages) NumPy work."""
    nranks = table.active.shape[1]
    links = (machine.intra, machine.inter)
    clock = np.zeros(nranks)
    messages = []
    for k in range(table.active.shape[0]):
        active = table.active[k]
        ready = clock + machine.step * active
        sender, receiver, link, lo, hi = table.sends[k]
        nbytes = _span_sizes(count, table.parts, lo, hi) * itemsize
        sent = nbytes > 0
        sender, receiver, link, nbytes = sender[sent], receiver[sent], link[sent], nbytes[sent]
        end = _exchange(ready, sender, receiver, link, nbytes, links)
        messages.append((sender, receiver, link, nbytes))
        rank, rlo, rhi = table.reduces[k]
        reduced = np.bincount(rank, weights=_span_sizes(count, table.parts, rlo, rhi) * itemsize,
                              minlength=nranks)
        clock = np.where(active, end + reduced * gamma, clock)
    steps = int(table.active.sum(axis=0).max()) if table.active.size else 0
    return clock, _totals(nranks, *map(np.concatenate, zip(*messages))), steps


@lru_cache(maxsize=32)
def _ring_base(name: str, nranks: int, itemsize: int, params: tuple):
    """Rank 0's ring program at ``count = p`` as (send offset, send slot, recv slot, reduces)."""
    algorithm = algorithms.get(name)
    merged = {**algorithm.params, **_builder_params(name, itemsize, dict(params))}
    base = []
    for step_ in algorithm.steps(0, nranks, nranks, **merged):
        (send,), (recv,) = step_.sends, step_.recvs
        if send.size != 1 or recv.size != 1 or (send.peer - recv.peer) % nranks != 2 % nranks:
            raise ScheduleError(f"{name}: rank 0's steps are not single ring blocks")
        base.append((send.peer, send.start, recv.action == REDUCE))
    return tuple(base)


@lru_cache(maxsize=64)
def _simulate_ring_sparse(base: tuple, nranks: int, count: int, topology: Topology,
                          itemsize: int, machine: Machine, gamma: float
                          ) -> tuple[np.ndarray, tuple, int]:
    """Every rank of a ring with fewer elements than ranks, touching only non-empty messages.

    Rank r's step is rank 0's rotated by r, so the ranks sending a non-empty block in step s
    are ``(j - slot) mod p`` for the ``count`` one-element blocks j, each to its ring
    neighbour: one message per port, so a message ends at max(both ready) + α + bβ. Every
    rank's every step is non-empty (it posts its zero-byte messages' step), so a rank without
    data in a step only advances by ``step``: clocks are kept relative to that common offset
    and only the busy ranks are touched. Cached on rank 0's program, so the segmented ring
    with one piece per block reuses the ring's run.
    """
    node = np.asarray(topology.node)
    links = (machine.intra, machine.inter)
    alpha = np.array([links[0].alpha, links[1].alpha])
    cost = alpha + itemsize * np.array([links[0].beta, links[1].beta])
    relative = np.zeros(nranks)
    blocks = np.arange(count)
    senders, receivers = [], []
    reduce_cost = itemsize * gamma
    for offset, slot, reduces in base:
        sender = (blocks - slot) % nranks
        receiver = (sender + offset) % nranks
        link = (node[sender] != node[receiver]).astype(np.int64)
        finish = np.maximum(relative[sender], relative[receiver]) + cost[link]
        np.maximum.at(relative, sender, finish)
        np.maximum.at(relative, receiver, finish)
        if reduces:
            relative[receiver] += reduce_cost
        senders.append(sender)
        receivers.append(receiver)
    sender, receiver = np.concatenate(senders), np.concatenate(receivers)
    link = (node[sender] != node[receiver]).astype(np.int64)
    totals = _totals(nranks, sender, receiver, link, np.full(len(sender), itemsize, np.int64))
    return relative + len(base) * machine.step, totals, len(base)

# -- the simulator ---------------------------------------------------------------------------------

@dataclass
class Prediction:
    """What the model predicts for one collective.

    Attributes:
        time: seconds until the last rank finishes (plus the per-call term).
        finish: seconds at which every rank finishes its steps (array of p).
        sent_bytes, sent_messages: per rank (arrays of p).
        link_bytes, link_messages: totals over all ranks per link class (intra, inter).
        pairs: ``{(sender, receiver): (messages, bytes)}`` when every rank was simulated
            (``partition == "every rank"``), else ``None``.
        steps: non-empty steps of the longest program.
        partition: how ranks were grouped ("every rank", "one class", "local rank").
    """

    name: str
    nranks: int
    nbytes: int
    time: float
    finish: np.ndarray
    sent_bytes: np.ndarray
    sent_messages: np.ndarray
    link_bytes: tuple[int, int]
    link_messages: tuple[int, int]
    pairs: dict | None
    steps: int
    partition: str

    @property
    def busbw(self) -> float:
        """Bus bandwidth in B/s: size / time · 2(p-1)/p (nccl-tests' definition)."""
        if self.time <= 0 or self.nranks < 2:
            return 0.0
        return self.nbytes / self.time * 2 * (self.nranks - 1) / self.nranks


def _run(quotient: _Quotient, machine: Machine, gamma: float) -> np.ndarray:
    """Simulate the class clocks; return the finish time of every class.

    A step that repeats the previous one (the same interned cost step in every class) after a
    step that advanced every clock by the same δ advances them by δ again (the step is a
    max-plus map, which commutes with adding a constant), so runs of equal steps in steady state
    cost one addition: a ring's 2(p-1) equal steps are simulated in a few.
    """
    nclasses = len(quotient.reps)
    class_of = quotient.class_of
    links = (machine.intra, machine.inter)
    clock = [0.0] * nclasses
    programs = quotient.programs
    length = max((len(p) for p in programs), default=0)
    previous, delta, steady = None, 0.0, False
    for k in range(length):
        costs = tuple(program[k] if k < len(program) else None for program in programs)
        if steady and costs == previous:
            clock = [t + delta for t in clock]
            continue
        before = clock[:]
        active = []
        ready = {}
        send_load, recv_load = {}, {}
        for c, cost in enumerate(costs):
            if cost is None:
                continue
            active.append((c, cost))
            ready[c] = clock[c] + machine.step
            send_load[c] = tuple(cost.send_count[i] * links[i].alpha
                                 + cost.send_bytes[i] * links[i].beta for i in (0, 1))
            recv_load[c] = tuple(cost.recv_count[i] * links[i].alpha
                                 + cost.recv_bytes[i] * links[i].beta for i in (0, 1))
        end = dict(ready)
        for c, cost in active:
            for peer, _, link in cost.sends:
                d = class_of[peer]
                if d not in ready:
                    raise ScheduleError(f"rank {quotient.reps[c]}, step {k}: sends to rank {peer}, "
                                        f"which has no step {k}")
                finish = max(ready[c], ready[d]) + max(send_load[c][link], recv_load[d][link])
                if finish > end[c]:
                    end[c] = finish
                if finish > end[d]:
                    end[d] = finish
        for c, cost in active:
            clock[c] = end[c] + cost.reduced * gamma
        increments = {clock[c] - before[c] for c in range(nclasses)}
        steady = costs == previous and len(active) == nclasses and len(increments) == 1
        delta = increments.pop() if steady else 0.0
        previous = costs
    return np.asarray(clock, dtype=float)


def _counts(quotient: _Quotient):
    """Per-class and per-link message counts of a quotient (cached: the quotient is)."""
    found = _COUNTS.get(id(quotient))
    if found is not None and found[0] is quotient:
        return found[1]
    sizes = quotient.sizes
    sent_bytes = np.zeros(len(quotient.reps), dtype=np.int64)
    sent_messages = np.zeros(len(quotient.reps), dtype=np.int64)
    link_bytes, link_messages = [0, 0], [0, 0]
    pairs: dict | None = {} if quotient.full else None
    steps = 0
    for c, program in enumerate(quotient.programs):
        steps = max(steps, sum(1 for cost in program if cost is not None))
        for cost in program:
            if cost is None:
                continue
            for peer, nbytes_sent, link in cost.sends:
                sent_bytes[c] += nbytes_sent
                sent_messages[c] += 1
                link_bytes[link] += nbytes_sent * sizes[c]
                link_messages[link] += sizes[c]
                if pairs is not None:
                    messages, volume = pairs.get((quotient.reps[c], peer), (0, 0))
                    pairs[(quotient.reps[c], peer)] = (messages + 1, volume + nbytes_sent)
    result = (sent_bytes, sent_messages, tuple(link_bytes), tuple(link_messages), pairs, steps)
    if len(_COUNTS) > 512:
        _COUNTS.clear()
    _COUNTS[id(quotient)] = (quotient, result)
    return result


_COUNTS: dict = {}


def _resolve(nranks: int, topology: Topology | None) -> Topology:
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks must be a positive integer, got {nranks!r}")
    if topology is None:
        return Topology.simulated(nranks, nranks)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a mpiallreduce Topology, got {type(topology).__name__}")
    topology.check_size(nranks)
    return topology


def predict(name: str, nranks: int, nbytes: int, topology: Topology | None = None,
            machine: Machine | None = None, dtype="float32", symmetric: bool = True,
            **params) -> Prediction:
    """Predict allreduce ``name`` on ``nranks`` ranks of ``nbytes`` bytes each.

    Args:
        name: a registered algorithm, ``"native"`` (:func:`native_algorithm` on
            :meth:`Machine.native`, plus Open MPI's per-call copies and ``native_call``; no
            knowledge of nodes; ``ordered=True`` for a non-commutative op), or ``"sharp"``
            (the modelled in-network reduction, which needs ``machine.switch``).
        topology: which rank is on which node (default: all on one node).
        machine: model parameters (default: :data:`DEFAULT_MACHINE`).
        dtype: element type; ``nbytes`` is rounded down to whole elements.
        symmetric: simulate one representative per class of ranks (see the module doc);
            ``False`` builds and simulates every rank.
        params: builder parameters (``inner=``, ``segment_bytes=``).

    Raises :class:`Oversubscribed` (a ValueError) when a node holds more ranks than
    ``machine.cores``.
    Cost: one program per class of ranks (a few for symmetric schedules), p programs otherwise.
    """
    topology = _resolve(nranks, topology)
    machine = DEFAULT_MACHINE if machine is None else machine
    if not isinstance(machine, Machine):
        raise TypeError(f"machine must be a mpiallreduce.model.Machine, got "
                        f"{type(machine).__name__}")
    check_cores(max(topology.node_sizes), machine)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
    itemsize = np.dtype(dtype).itemsize
    if name == "native":
        return _predict_native(nranks, nbytes, topology, machine, dtype, symmetric,
                               bool(params.get("ordered")))
    if name == "sharp":
        return _predict_sharp(nranks, nbytes, topology, machine, dtype)
    count = int(nbytes) // itemsize
    key = tuple(sorted(params.items()))
    parts = _base_parts(name, nranks, count) if symmetric and nranks > 1 and count else None
    if parts is not None:
        gamma = machine.gamma_for(dtype)
        if name in ROTATION_INVARIANT:
            base = _ring_base(name, nranks, itemsize, key)
            finish, totals, steps = _simulate_ring_sparse(base, nranks, count, topology,
                                                          itemsize, machine, gamma)
            label = "every rank (rotated, busy ranks only)"
        else:
            table = _table(name, nranks, topology, itemsize, key, parts)
            finish, totals, steps = _simulate_table(table, count, itemsize, machine, gamma)
            label = "every rank (slot spans)"
        return Prediction(name, nranks, int(nbytes), float(finish.max()) + machine.call,
                          finish.copy(), *totals, steps, label)
    quotient = _quotient(name, nranks, count, topology, itemsize, key, symmetric)
    clocks = _run(quotient, machine, machine.gamma_for(dtype))
    class_of = np.asarray(quotient.class_of)
    sent_bytes, sent_messages, link_bytes, link_messages, pairs, steps = _counts(quotient)
    finish = clocks[class_of] if len(clocks) else np.zeros(nranks)
    total = float(finish.max()) + machine.call if finish.size else machine.call
    return Prediction(name, nranks, int(nbytes), total, finish, sent_bytes[class_of],
                      sent_messages[class_of], tuple(link_bytes), tuple(link_messages), pairs,
                      steps, quotient.partition)


def _ompi_choice(nranks: int, nbytes: int, commutative: bool) -> int:
    """Open MPI 5.0 coll/tuned's fixed allreduce algorithm number for (p, bytes per rank)."""
    table = OMPI_ALLREDUCE_COMMUTATIVE if commutative else OMPI_ALLREDUCE_NONCOMMUTATIVE
    for ranks_below, rows in table:
        if ranks_below is None or nranks < ranks_below:
            return next(algorithm for below, algorithm in rows if below is None or nbytes < below)
    raise AssertionError("the last row of the decision table has no bound")


def native_algorithm(nranks: int, nbytes: int, itemsize: int = 4, commutative: bool = True
                     ) -> str:
    """The schedule that stands in for what Open MPI 5.0's default allreduce runs.

    Open MPI's ring (and its segmented ring at segment size 0) runs recursive doubling below
    p elements, its Rabenseifner runs basic_linear below pof2 elements; basic_linear and
    nonoverlapping (a reduce to rank 0, then a broadcast) are stood in for by ``tree``.
    """
    count = nbytes // itemsize
    pof2 = 1 << (max(nranks, 1).bit_length() - 1)
    choice = _ompi_choice(nranks, nbytes, commutative)
    if choice in (4, 5):
        return "ring" if count >= nranks else "recursive_doubling"
    if choice == 6 and count >= pof2:
        return "rabenseifner"
    return "recursive_doubling" if choice == 3 else "tree"


def _predict_native(nranks, nbytes, topology, machine, dtype, symmetric, ordered=False
                    ) -> Prediction:
    """Open MPI's fixed decision in C: no interpreter terms, its copies, mpi4py's call."""
    itemsize = np.dtype(dtype).itemsize
    stand_in = native_algorithm(nranks, int(nbytes), itemsize, not ordered)
    result = predict(stand_in, nranks, nbytes, topology, machine.native(), dtype, symmetric)
    result.name = "native"
    if nranks > 1:
        choice = _ompi_choice(nranks, int(nbytes), not ordered)
        if choice in OMPI_COPIES and stand_in != "tree":
            result.time += machine.copy * (int(nbytes) // itemsize * itemsize)
        result.time += machine.native_call
    return result


#: the modelled in-network algorithm: no executor runs it (no machine here has such a switch).
SHARP = "sharp"


def _predict_sharp(nranks, nbytes, topology, machine, dtype) -> Prediction:
    """Reduce to a leader per node, one in-network allreduce among leaders, broadcast back.

    The two node phases are ``hierarchical`` on one node of each node size (binomial reduce
    and broadcast, with the interpreter's step terms); the switch phase is one executor step
    plus :meth:`Switch.time` on the whole message. Commutative ops only (the switches reduce
    in arrival order).
    """
    switch = machine.switch
    if switch is None:
        raise ValueError("sharp is a modelled in-network reduction: it needs a machine with a "
                         "switch (predict --switch sharp-llt or sharp-sat, or \"switch\" in the "
                         "machine file)")
    itemsize = np.dtype(dtype).itemsize
    nbytes = int(nbytes) // itemsize * itemsize
    inside = {size: predict("hierarchical", size, nbytes, None, machine, dtype)
              for size in set(topology.node_sizes)}
    across = (switch.time(topology.nnodes, nbytes) + machine.step
              if topology.nnodes > 1 and nbytes else 0.0)
    local = max(result.time for result in inside.values()) - machine.call
    chunks = switch.chunks(nbytes) if topology.nnodes > 1 and nbytes else 0
    sent_bytes = np.zeros(nranks, dtype=np.int64)
    sent_messages = np.zeros(nranks, dtype=np.int64)
    intra_bytes = intra_messages = 0
    for members in topology.members:
        result = inside[len(members)]
        sent_bytes[list(members)] = result.sent_bytes
        sent_messages[list(members)] = result.sent_messages
        intra_bytes += result.link_bytes[INTRA]
        intra_messages += result.link_messages[INTRA]
    leaders = list(topology.leaders)
    if chunks:
        sent_bytes[leaders] += nbytes
        sent_messages[leaders] += chunks
    steps = max(result.steps for result in inside.values()) + (1 if chunks else 0)
    total = local + across
    return Prediction(SHARP, nranks, nbytes, total + machine.call, np.full(nranks, total),
                      sent_bytes, sent_messages, (intra_bytes, len(leaders) * nbytes if chunks
                                                  else 0),
                      (intra_messages, len(leaders) * chunks), None, steps,
                      f"closed form ({switch.levels(topology.nnodes)} switch levels)")


def candidates(commutative: bool = True) -> list[str]:
    """Registered allreduce algorithms that accept the op (commutative or not), then native."""
    return [name for name, algorithm in algorithms.REGISTRY.items()
            if commutative or not algorithm.commutative_only] + ["native"]


@lru_cache(maxsize=256)
def _choose(nranks: int, nbytes: int, commutative: bool, topology, machine) -> str:
    best, best_time = "native", None
    for name in candidates(commutative):
        accepted = algorithms.REGISTRY[name].params if name in algorithms.REGISTRY else {}
        params = ({"ordered": True} if not commutative and (name == "native"
                                                             or "ordered" in accepted) else {})
        try:
            time_ = predict(name, nranks, nbytes, topology, machine, **params).time
        except ValueError:  # refuses this case (e.g. order on interleaved nodes)
            continue
        if best_time is None or time_ < best_time:
            best, best_time = name, time_
    return best


def choose(nranks: int, nbytes: int, commutative: bool, topology: Topology | None = None,
           machine: Machine | None = None) -> str:
    """Return the algorithm (or ``"native"``) with the least predicted time.

    Never an algorithm that refuses a non-commutative op. Identical on every rank for identical
    arguments; cached, so a repeated question costs a dictionary lookup.
    Cost: one :func:`predict` per registered algorithm the first time.
    """
    if nranks <= 1 or nbytes <= 0:
        return "native"
    topology = _resolve(nranks, topology)
    return _choose(nranks, int(nbytes), bool(commutative), topology,
                   DEFAULT_MACHINE if machine is None else machine)


# -- calibration (under mpirun -n 2) ---------------------------------------------------------------

def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> Link:
    """Least-squares fit of one-way times ``t = α + size·β``; α and β clamped at 0.

    Raises ValueError for fewer than two distinct sizes or mismatched lengths.
    """
    sizes = np.asarray(sizes, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    if sizes.shape != seconds.shape or sizes.ndim != 1:
        raise ValueError(f"sizes and times must be two lists of one length, got {sizes.shape} "
                         f"and {seconds.shape}")
    if len(np.unique(sizes)) < 2:
        raise ValueError("fitting α and β needs at least two distinct message sizes")
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
        raise ValueError("times must be finite and >= 0")
    # weight by 1/t: relative errors, so the small sizes fix α and the large ones β
    weights = 1.0 / np.maximum(seconds, 1e-12)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    return Link(float(max(alpha, 0.0)), float(max(beta, 0.0)))


#: timed rounds per measurement; the fastest counts.
REPEATS = 7


def _pingpong(comm, nbytes: int, iterations: int) -> float:
    """One-way time of a ``nbytes`` message between ranks 0 and 1 (half the round trip)."""
    from mpi4py import MPI

    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    rank = comm.Get_rank()
    best = float("inf")
    # best of several short rounds: on a shared machine the others' load only adds time
    for _ in range(REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iterations):
            if rank == 0:
                comm.Send(buf, 1, 7)
                comm.Recv(buf, 1, 7)
            elif rank == 1:
                comm.Recv(buf, 0, 7)
                comm.Send(buf, 0, 7)
        best = min(best, (MPI.Wtime() - start) / iterations / 2)
    return comm.bcast(best, root=0)


def _gamma(dtype, nbytes: int = 4 << 20, repeats: int = 20) -> float:
    """Seconds per byte of the executor's local combine (SUM) on ``dtype``, best of ``repeats``."""
    from mpi4py import MPI

    from .ops import reducer
    from .schedule import RECEIVED_FIRST

    combine = reducer(MPI.SUM, np.dtype(dtype))
    count = nbytes // np.dtype(dtype).itemsize
    received, local = np.ones(count, dtype), np.ones(count, dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        combine.combine(received, local, RECEIVED_FIRST)
        best = min(best, time.perf_counter() - start)
    return best / (count * np.dtype(dtype).itemsize)


def _copy_cost(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """Seconds per byte to allocate a fresh ``nbytes`` buffer and copy into it, best of ``repeats``."""
    source = np.ones(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target = np.empty_like(source)
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
        del target
    return best / nbytes


def _allreduce_cost(comm, iterations: int = 400) -> float:
    """Seconds per ``comm.Allreduce`` of one float64 from Python (out of place), slowest rank."""
    from mpi4py import MPI

    x, y = np.ones(1, np.float64), np.empty(1, np.float64)
    elapsed = float("inf")
    for _ in range(REPEATS):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(iterations):
            comm.Allreduce(x, y, MPI.SUM)
        elapsed = min(elapsed, (MPI.Wtime() - start) / iterations)
    return comm.allreduce(elapsed, op=MPI.MAX)


def _step_cost(comm, nsteps: int, iterations: int) -> float:
    """Seconds per ``Plan.run()`` of a schedule of ``nsteps`` one-element exchanges (2 ranks)."""
    from mpi4py import MPI

    from .executor import Plan
    from .ops import reducer
    from .schedule import Recv, Send, Step

    peer = 1 - comm.Get_rank()
    steps = tuple(Step((Send(peer, 0, 1),), (Recv(peer, 0, 1, REDUCE),)) for _ in range(nsteps))
    private = comm.Dup()
    try:
        x, y = np.ones(1, np.float64), np.empty(1, np.float64)
        plan = Plan(private, steps, x, y, reducer(MPI.SUM, np.dtype("float64")), "calibrate")
        try:
            elapsed = float("inf")
            for _ in range(REPEATS):
                comm.Barrier()
                start = MPI.Wtime()
                for _ in range(iterations):
                    plan.run()
                elapsed = min(elapsed, (MPI.Wtime() - start) / iterations)
        finally:
            plan.free()
    finally:
        private.Free()
    return comm.allreduce(elapsed, op=MPI.MAX)


def calibrate(comm, sizes: Sequence[int] = tuple(4 ** k for k in range(12)),
              inter: Link | None = None) -> Machine:
    """Measure the machine under two ranks of ``comm`` (collective: call it on every rank).

    α, β: ping-pong between ranks 0 and 1 over ``sizes`` (8 B .. 4 MiB by default), least
    squares on the one-way times. γ: the executor's SUM combine on 4 MiB per dtype. ``step``
    and ``call``: ``Plan.run()`` of 1 and 32 one-element exchange steps; the slope less one
    message's α + 8β is the interpreter's cost per step, the rest of the 1-step run the cost
    per call. ``native_call``: ``comm.Allreduce`` of one float64 less the model's time for it.
    The measured link is the inter-node one when ranks 0 and 1 are on different
    nodes; the other class comes from ``inter`` (default :data:`NETWORK_100G`) or the default
    machine.
    """
    from mpi4py import MPI

    if comm.Get_size() < 2:
        raise ValueError("calibrate needs at least 2 ranks: mpirun -n 2 python -m mpi4py -m "
                         "mpiallreduce.model calibrate -o machine.json")
    times = []
    for nbytes in sizes:
        iterations = int(min(400, max(10, (16 << 20) // max(nbytes, 1))))
        times.append(_pingpong(comm, nbytes, iterations))
    measured = fit_alpha_beta(sizes, times)
    gamma = tuple((name, comm.bcast(_gamma(name), root=0))
                  for name in ("float32", "float64", "int32", "int64"))
    copy = comm.bcast(_copy_cost(), root=0)
    one, many = _step_cost(comm, 1, 400), _step_cost(comm, 33, 40)
    per_step = max(0.0, (many - one) / 32 - (measured.alpha + 8 * measured.beta))
    per_call = max(0.0, one - per_step - (measured.alpha + 8 * measured.beta))
    allreduce = _allreduce_cost(comm)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    split = Topology.from_comm(comm)
    across = split.node[0] != split.node[1]
    intra = DEFAULT_MACHINE.intra if across else measured
    inter = measured if across else (NETWORK_100G if inter is None else inter)
    info = {"mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "python": platform.python_version(), "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "measured_link": "inter" if across else "intra",
            "inter_source": "measured" if across else "given by hand (--inter-alpha/--inter-beta)"
                            if inter is not NETWORK_100G else "NETWORK_100G (100 Gb/s example)",
            "pingpong": {"sizes": list(map(int, sizes)), "one_way_s": times},
            "plan_run_s": {"1 step": one, "33 steps": many},
            "allreduce_1_float64_s": allreduce}
    machine = Machine(intra, inter, gamma, per_step, per_call, copy, info=info)
    # native_call: what comm.Allreduce costs beyond the model of Open MPI's algorithm for it
    modelled = predict("native", comm.Get_size(), 8, split, machine, "float64").time
    return replace(machine, native_call=max(0.0, allreduce - modelled),
                   cores=comm.bcast(cores, root=0))


# -- command line ----------------------------------------------------------------------------------

def _sizes(text: str) -> list[int]:
    from .bench import UsageError, parse_sizes

    try:
        return parse_sizes(text)
    except UsageError as error:
        raise ValueError(str(error)) from None


def _human(size: int) -> str:
    from .bench import human

    return human(size)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpiallreduce.model",
        description="Alpha-beta-gamma cost model of the mpiallreduce schedules.")
    sub = parser.add_subparsers(dest="command", required=True)
    pred = sub.add_parser("predict", help="predict every algorithm's time per size (no MPI ranks)")
    pred.add_argument("--ranks", type=_positive_int, required=True, metavar="P")
    pred.add_argument("--ranks-per-node", type=_positive_int, default=None, metavar="K",
                      help="consecutive ranks per node (default: all on one node)")
    pred.add_argument("--sizes", default="8:1G", metavar="MIN:MAX",
                      help="bytes per rank, every power of two in between (K/M/G; default 8:1G)")
    pred.add_argument("--algorithms", default="all", metavar="LIST",
                      help="comma list of algorithms (default: all, native included)")
    pred.add_argument("--dtype", default="float32")
    pred.add_argument("--machine", metavar="FILE.json",
                      help="machine from calibrate (default: the built-in machine)")
    pred.add_argument("--cores-per-node", type=_positive_int, default=None, metavar="C",
                      help="cores of a node (default: the machine file's \"cores\", unchecked "
                           "if absent); more ranks per node than cores is refused")
    pred.add_argument("--switch", choices=sorted(SWITCHES), default=None,
                      help="add in-network reduction (modelled only, parameters printed and "
                           "cited) and the algorithm 'sharp' that uses it")
    pred.add_argument("--non-commutative", action="store_true",
                      help="predict for a non-commutative op (algorithms that reorder are left out)")
    pred.add_argument("--plot", metavar="FILE.png",
                      help="draw time against size, and against ranks at --plot-size")
    pred.add_argument("--plot-size", default=None, metavar="SIZE",
                      help="size for the time-against-ranks panel (default: the largest)")
    cal = sub.add_parser("calibrate", help="measure this machine (under mpirun -n 2)")
    cal.add_argument("-o", "--output", required=True, metavar="FILE.json")
    cal.add_argument("--inter-alpha", type=_seconds, default=None, metavar="S",
                     help=f"inter-node latency in s (default {NETWORK_100G.alpha:g}: 100 Gb/s)")
    cal.add_argument("--inter-beta", type=_seconds, default=None, metavar="S_PER_B",
                     help=f"inter-node s/B (default {NETWORK_100G.beta:g}: 100 Gb/s)")
    return parser


def _algorithms(text: str, commutative: bool, machine: Machine | None = None) -> list[str]:
    known = candidates(commutative)
    if commutative and machine is not None and machine.switch is not None:
        known.append(SHARP)
    if text.strip() == "all":
        return known
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name == SHARP and SHARP not in known:
            raise ValueError("sharp is the modelled in-network reduction: give it a switch "
                             "(--switch sharp-llt or sharp-sat) and a commutative op")
        if name not in known:
            raise ValueError(f"unknown or refusing algorithm {name!r} in --algorithms; choose "
                             f"from {', '.join(known)}")
    return names


def predict_table(nranks: int, ranks_per_node: int | None, sizes: Sequence[int],
                  names: Sequence[str], machine: Machine, dtype="float32",
                  commutative: bool = True) -> list[dict]:
    """Return one row per (size, algorithm): time, busbw, winner flag, messages, inter bytes."""
    topology = Topology.simulated(nranks, ranks_per_node or nranks)
    itemsize = np.dtype(dtype).itemsize
    rows = []
    for size in sizes:
        if size < itemsize:
            continue
        found = []
        for name in names:
            accepted = getattr(algorithms.REGISTRY.get(name), "params", {})
            params = ({"ordered": True} if not commutative and (name == "native"
                                                                or "ordered" in accepted) else {})
            try:
                found.append(predict(name, nranks, size, topology, machine, dtype, **params))
            except ValueError as error:
                rows.append({"size": size, "algorithm": name, "skipped": str(error)})
        # the winner among the schedules; native (MPI's C code, modelled) is the reference
        schedules = [p for p in found if p.name != "native"] or found
        best = min(schedules, key=lambda p: p.time).name if found else None
        native = next((p.time for p in found if p.name == "native"), None)
        for result in found:
            rows.append({"size": size, "algorithm": result.name, "time_us": result.time * 1e6,
                         "busbw_gbs": result.busbw / 1e9, "steps": result.steps,
                         "vs_native": native / result.time if native and result.time else None,
                         "inter_bytes_per_rank": result.link_bytes[INTER] / nranks,
                         "winner": result.name == best, "partition": result.partition})
    return rows


def _plot(path: str, rows: list[dict], nranks: int, ranks_per_node: int | None,
          names: Sequence[str], plot_size: int, machine: Machine, dtype) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_size, ax_ranks) = plt.subplots(1, 2, figsize=(13, 5))
    for index, name in enumerate(names):
        mine = [r for r in rows if r["algorithm"] == name and "time_us" in r]
        ax_size.plot([r["size"] for r in mine], [r["time_us"] for r in mine], marker=".",
                     color=f"C{index % 10}", label=name)
    step = ranks_per_node or 1
    counts = sorted({step * (1 << k) for k in range(max(1, nranks // step).bit_length())
                     if step * (1 << k) <= nranks} | {nranks})
    for index, name in enumerate(names):
        times = []
        for count in counts:
            topology = Topology.simulated(count, ranks_per_node or count)
            try:
                times.append(predict(name, count, plot_size, topology, machine, dtype).time * 1e6)
            except ValueError:
                times.append(float("nan"))
        ax_ranks.plot(counts, times, marker=".", color=f"C{index % 10}", label=name)
    ax_size.set_xlabel("bytes per rank")
    ax_ranks.set_xlabel(f"ranks ({ranks_per_node or 'all'} per node), {_human(plot_size)} per rank")
    for ax in (ax_size, ax_ranks):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("predicted time (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"mpiallreduce.model: {nranks} ranks, {ranks_per_node or nranks} per node, "
                 f"{dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_predict(opts, out) -> int:
    machine = Machine.load(opts.machine) if opts.machine else DEFAULT_MACHINE
    if opts.cores_per_node is not None:
        machine = replace(machine, cores=opts.cores_per_node)
    if opts.ranks_per_node is not None and opts.ranks_per_node > opts.ranks:
        raise ValueError(f"--ranks-per-node {opts.ranks_per_node} exceeds --ranks {opts.ranks}")
    check_cores(opts.ranks_per_node or opts.ranks, machine)
    try:
        dtype = np.dtype(opts.dtype)
    except TypeError:
        raise ValueError(f"--dtype {opts.dtype!r} is not a NumPy dtype") from None
    sizes = _sizes(opts.sizes)
    if opts.switch:
        machine = replace(machine, switch=SWITCHES[opts.switch])
    names = _algorithms(opts.algorithms, not opts.non_commutative, machine)
    start = time.perf_counter()
    rows = predict_table(opts.ranks, opts.ranks_per_node, sizes, names, machine, dtype,
                         not opts.non_commutative)
    source = machine.info.get("host") or machine.info.get("source", "")
    print(f"# mpiallreduce.model: {opts.ranks} ranks, {opts.ranks_per_node or opts.ranks} per "
          f"node, {dtype.name}; machine: {opts.machine or 'built-in'} ({source})", file=out)
    print(f"# intra alpha {machine.intra.alpha * 1e6:.2f} us, beta {machine.intra.beta:.3g} s/B; "
          f"inter alpha {machine.inter.alpha * 1e6:.2f} us, beta {machine.inter.beta:.3g} s/B; "
          f"gamma {machine.gamma_for(dtype):.3g} s/B; step {machine.step * 1e6:.2f} us; "
          f"call {machine.call * 1e6:.2f} us", file=out)
    print("# busbw = size/time*2(p-1)/p (GB/s); vs_native = native/time; * marks the fastest "
          "schedule of the size", file=out)
    print(f"# native: Open MPI 5.0 coll/tuned's fixed decision table in C ("
          f"{_native_ranges(opts.ranks, sizes, dtype)}), plus its per-call copy of the message "
          f"and mpi4py's call ({machine.native_call * 1e6:.2f} us), no interpreter terms",
          file=out)
    if machine.switch is not None:
        _print_switch(machine.switch, opts.ranks, opts.ranks_per_node or opts.ranks, out)
    print(f"#{'size(B)':>11} {'algorithm':<20} {'time(us)':>14} {'busbw(GB/s)':>12} "
          f"{'vs_native':>9} {'steps':>6} {'inter(B)/rank':>14} best", file=out)
    for row in rows:
        if "skipped" in row:
            print(f"# {row['size']} {row['algorithm']}: skipped ({row['skipped']})", file=out)
            continue
        print(f"{row['size']:>12} {row['algorithm']:<20} {row['time_us']:>14.2f} "
              f"{row['busbw_gbs']:>12.4f} {row['vs_native'] or 0:>9.2f} {row['steps']:>6} "
              f"{row['inter_bytes_per_rank']:>14.0f} "
              f"{'*' if row['winner'] else ''}", file=out)
    winners: list[tuple[str, int, int]] = []
    for row in rows:
        if row.get("winner"):
            if winners and winners[-1][0] == row["algorithm"]:
                winners[-1] = (row["algorithm"], winners[-1][1], row["size"])
            else:
                winners.append((row["algorithm"], row["size"], row["size"]))
    print("# winners: " + "; ".join(f"{_human(lo)}..{_human(hi)} {name}"
                                    for name, lo, hi in winners), file=out)
    if SHARP in names:
        print(_sharp_summary(rows), file=out)
    print(f"# predicted in {time.perf_counter() - start:.1f} s", file=out)
    if opts.plot:
        plot_size = _sizes(opts.plot_size)[0] if opts.plot_size else sizes[-1]
        _plot(opts.plot, rows, opts.ranks, opts.ranks_per_node, names, plot_size, machine, dtype)
    return 0


def _native_ranges(nranks: int, sizes: Sequence[int], dtype) -> str:
    """What native runs over ``sizes``, as ranges: ``8..2K recursive_doubling; 4K.. ring``."""
    runs: list[list] = []
    for size in sizes:
        name = native_algorithm(nranks, size, np.dtype(dtype).itemsize)
        if runs and runs[-1][0] == name:
            runs[-1][2] = size
        else:
            runs.append([name, size, size])
    return "; ".join(f"{_human(lo)}..{_human(hi)} {name}" for name, lo, hi in runs)


def _print_switch(switch: Switch, nranks: int, per_node: int, out) -> None:
    nnodes = -(-nranks // per_node)
    print(f"# switch {switch.name} (MODELLED ONLY: no machine here has a switch that reduces): "
          f"alpha {switch.alpha * 1e6:.2f} us per operation, {switch.hop * 1e6:.4f} us per "
          f"level and direction, beta {switch.beta:.3g} s/B, {switch.limit} B per operation "
          f"(+{switch.chunk * 1e6:.4f} us per extra one), radix {switch.radix}: "
          f"{switch.levels(nnodes)} levels over {nnodes} nodes", file=out)
    print(f"# switch source: {switch.source}", file=out)
    print("# sharp: binomial reduce to a leader per node, one in-network allreduce among the "
          "leaders (split into operations of the size limit), binomial broadcast in the node",
          file=out)


def _sharp_summary(rows: list[dict]) -> str:
    """One line: the size ranges where sharp beats both cascade and hierarchical, with ratios."""
    by_size: dict[int, dict[str, float]] = {}
    for row in rows:
        if "time_us" in row:
            by_size.setdefault(row["size"], {})[row["algorithm"]] = row["time_us"]
    runs: list[list] = []  # [wins, first size, last size, lowest ratio, highest ratio]
    for size, times in sorted(by_size.items()):
        rivals = [times[name] for name in ("cascade", "hierarchical") if name in times]
        if SHARP not in times or not rivals:
            continue
        ratio = times[SHARP] / min(rivals)
        wins = ratio < 1
        if runs and runs[-1][0] == wins:
            run = runs[-1]
            run[2], run[3], run[4] = size, min(run[3], ratio), max(run[4], ratio)
        else:
            runs.append([wins, size, size, ratio, ratio])
    parts = [f"{'wins' if wins else 'loses'} {_human(lo)}..{_human(hi)} ({low:.2g}-{high:.2g}x)"
             for wins, lo, hi, low, high in runs]
    return ("# sharp against the faster of cascade and hierarchical (time ratio): "
            + ("; ".join(parts) if parts else "not compared (cascade/hierarchical not run)"))


def _run_calibrate(opts, out) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    inter = None
    if opts.inter_alpha is not None or opts.inter_beta is not None:
        inter = Link(NETWORK_100G.alpha if opts.inter_alpha is None else opts.inter_alpha,
                     NETWORK_100G.beta if opts.inter_beta is None else opts.inter_beta)
    machine = calibrate(comm, inter=inter)
    if comm.Get_rank() == 0:
        machine.save(opts.output)
        link = machine.info["measured_link"]
        measured = machine.link(INTER if link == "inter" else INTRA)
        print(f"# {machine.info['mpi_library']} on {machine.info['host']}, "
              f"{machine.info['date']}", file=out)
        print(f"{link}: alpha {measured.alpha * 1e6:.3f} us, beta {measured.beta:.4g} s/B "
              f"({1 / measured.beta / 1e9 if measured.beta else float('inf'):.2f} GB/s)", file=out)
        for name, value in machine.gamma:
            print(f"gamma {name}: {value:.4g} s/B ({1 / value / 1e9 if value else 0:.2f} GB/s)",
                  file=out)
        print(f"step: {machine.step * 1e6:.2f} us, call: {machine.call * 1e6:.2f} us, "
              f"native_call: {machine.native_call * 1e6:.2f} us, cores: {machine.cores}",
              file=out)
        print(f"wrote {opts.output}", file=out)
    return 0


def main(argv=None, out=None) -> int:
    """Run the command line; return the exit status (0, or 2 for bad input)."""
    out = sys.stdout if out is None else out
    opts = build_parser().parse_args(argv)
    try:
        if opts.command == "predict":
            return _run_predict(opts, out)
        return _run_calibrate(opts, out)
    except (ValueError, TypeError, OSError) as error:
        print(f"python -m mpiallreduce.model {opts.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
