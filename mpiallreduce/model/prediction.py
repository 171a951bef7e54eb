"""predict and choose: dispatch to the simulator, native's stand-in, or the modelled switch."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np

from .. import algorithms
from ..algorithms.compose import check_intra, choose_inner
from ..algorithms.nodes import NODE_PHASED
from ..partition import block
from ..topology import Topology
from .machine import DEFAULT_MACHINE, INTRA, Machine, check_cores
from .native import OMPI_COPIES, OMPI_FRESH_BYTES, _ompi_choice, native_algorithm
from .programs import (
    ROTATION_INVARIANT,
    _base_parts,
    _places,
    _quotient,
    _ring_base,
    _rotated_ring,
    _table,
    reused_bytes,
)
from .shm_layout import COMPILED_REDUCE_DTYPES, SMALL_BYTES, chunk_bytes, small_bytes
from .simulate import (
    Prediction,
    _Costs,
    _counts,
    _run,
    _simulate_ring_dense,
    _simulate_ring_sparse,
    _simulate_table,
)


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
            in_place: bool = False, **params) -> Prediction:
    """Predict allreduce ``name`` on ``nranks`` ranks of ``nbytes`` bytes each.

    Args:
        name: a registered algorithm, ``"native"`` (:func:`native_algorithm` on
            :meth:`Machine.native`, plus Open MPI's per-call copies and ``native_call``; no
            knowledge of nodes; ``ordered=True`` for a non-commutative op), ``"shm"`` (the
            node-local shared-memory transport, one node only), or ``"sharp"`` (the modelled
            in-network reduction, which needs ``machine.switch``).
        topology: which rank is on which node (default: all on one node).
        machine: model parameters (default: :data:`DEFAULT_MACHINE`).
        dtype: element type; ``nbytes`` is rounded down to whole elements.
        symmetric: simulate one representative per class of ranks (see the module doc);
            ``False`` builds and simulates every rank.
        in_place: ``sendbuf`` is ``MPI.IN_PLACE``: the executor's reducing receives land in
            scratch (and are copied back between the sizes of ``SCRATCH_COMBINE``), Open MPI
            skips the copies of sendbuf into recvbuf, and a schedule sends from the result it
            writes (``machine.reuse_curve`` prices those bytes on one node,
            :func:`.programs.reused_bytes`).
        params: builder parameters (``inner=``, ``segment_bytes=``); ``intra=`` for
            hierarchical and cascade: ``"auto"`` (the default, as the library's plans decide:
            the shared-memory intra-node phase wherever some node holds two ranks or more),
            ``"shm"`` or ``"p2p"`` (the point-to-point schedule, simulated step by step).

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
                               bool(params.get("ordered")), in_place)
    if name == "sharp":
        return _predict_sharp(nranks, nbytes, topology, machine, dtype)
    if name == SHM:
        return _predict_shm(nranks, nbytes, topology, machine, dtype, in_place)
    if name in NODE_PHASED and _node_phased(nranks, int(nbytes) // itemsize, topology, params):
        return _predict_node_phased(name, nranks, nbytes, topology, machine, dtype, in_place,
                                    params)
    count = int(nbytes) // itemsize
    key = tuple(sorted(params.items()))
    nclasses = len(machine.links)
    parts = _base_parts(name, nranks, count) if symmetric and nranks > 1 and count else None
    costs = _Costs(machine, np.dtype(dtype).name, bool(in_place), count * itemsize)
    # bytes of its result a rank sends from and writes (one node: Machine.reuse_curve)
    reuse = (machine.reuse_at(count * itemsize)
             * reused_bytes(name, nranks, count, itemsize, key, bool(in_place))
             if machine.reuse_curve is not None and topology.nnodes == 1 else 0.0)
    if parts is not None:
        if name in ROTATION_INVARIANT:
            base = _ring_base(name, nranks, itemsize, key)
            finish, totals, steps = _simulate_ring_sparse(base, nranks, count, topology,
                                                          itemsize, costs)
            label = "every rank (rotated, busy ranks only)"
        else:
            table = _table(name, nranks, topology, itemsize, key, parts, nclasses)
            finish, totals, steps = _simulate_table(table, count, itemsize, costs)
            label = "every rank (slot spans)"
        return Prediction(name, nranks, int(nbytes), float(finish.max()) + machine.call + reuse,
                          finish.copy(), *totals, steps, label)
    # levels above the network make the ring's quotient a class per position in a site, so
    # the ring of single blocks runs every rank at once in NumPy instead
    ring = (_rotated_ring(name, nranks, count, itemsize, key)
            if symmetric and len(_places(topology, nclasses)) > 1 else None)
    if ring is not None:
        finish, totals, steps = _simulate_ring_dense(ring, nranks, topology, costs)
        return Prediction(name, nranks, int(nbytes), float(finish.max()) + machine.call + reuse,
                          finish, *totals, steps, "every rank (rotated ring, NumPy)")
    quotient = _quotient(name, nranks, count, topology, itemsize, key, symmetric, nclasses)
    clocks = _run(quotient, costs)
    class_of = np.asarray(quotient.class_of)
    sent_bytes, sent_messages, link_bytes, link_messages, pairs, steps = _counts(quotient)
    link_bytes, link_messages = link_bytes[:nclasses], link_messages[:nclasses]
    finish = clocks[class_of] if len(clocks) else np.zeros(nranks)
    total = (float(finish.max()) if finish.size else 0.0) + machine.call + reuse
    return Prediction(name, nranks, int(nbytes), total, finish, sent_bytes[class_of],
                      sent_messages[class_of], tuple(link_bytes), tuple(link_messages), pairs,
                      steps, quotient.partition)


def _predict_native(nranks, nbytes, topology, machine, dtype, symmetric, ordered=False,
                    in_place=False) -> Prediction:
    """Open MPI's fixed decision in C: no interpreter terms, its copies, mpi4py's call.

    Copies of the whole message per call (:func:`native_copies`, from Open MPI 5.0's
    ``coll_base_allreduce.c``) at the calibrated allocate-and-copy rate for that size, and
    the first writes into its temporary where malloc maps it afresh each call
    (:func:`native_faulted`, at the machine's ``fault`` rate), and on one node the stand-in's
    reused bytes in place (``reuse_curve``): Open MPI works in recvbuf or its temporary.
    """
    itemsize = np.dtype(dtype).itemsize
    stand_in = native_algorithm(nranks, int(nbytes), itemsize, not ordered)
    result = predict(stand_in, nranks, nbytes, topology, machine.native(), dtype, symmetric)
    result.name = "native"
    if nranks > 1:
        size = int(nbytes) // itemsize * itemsize
        if machine.reuse_curve is not None and topology.nnodes == 1:
            # Open MPI's algorithms load sendbuf into recvbuf or a temporary first and then
            # send from what they write, as ours do in place
            result.time += machine.reuse_at(size) * reused_bytes(
                stand_in, nranks, size // itemsize, itemsize, (), True)
        copies = native_copies(nranks, int(nbytes), itemsize, not ordered, in_place)
        result.time += copies * size * float(machine.copy_at(size)) + machine.native_call
        if machine.fault:
            result.time += machine.fault * native_faulted(nranks, size, itemsize, not ordered)
    return result


def native_faulted(nranks: int, nbytes: int, itemsize: int = 4, commutative: bool = True) -> int:
    """Bytes of Open MPI 5.0's whole-message temporary its slowest rank writes first per call,
    where the temporary is mapped afresh every call (``nbytes`` at least
    :data:`~.native.OMPI_FRESH_BYTES`; below, it reuses heap pages): recursive doubling copies
    the input into it (all of it), Rabenseifner receives the halved blocks of its
    reduce-scatter into it (``nbytes`` (1 - 1/pof2)). The ring's temporaries are blocks, and
    the tree stand-in's algorithms are not counted."""
    if nranks < 2 or nbytes < OMPI_FRESH_BYTES:
        return 0
    stand_in = native_algorithm(nranks, nbytes, itemsize, commutative)
    if stand_in == "recursive_doubling":
        return nbytes
    if stand_in == "rabenseifner":
        pof2 = 1 << (nranks.bit_length() - 1)
        return nbytes - nbytes // pof2
    return 0


def native_copies(nranks: int, nbytes: int, itemsize: int = 4, commutative: bool = True,
                  in_place: bool = False) -> int:
    """Whole-message copies the slowest rank of Open MPI 5.0's allreduce makes per call.

    Recursive doubling copies its input (sendbuf, or recvbuf in place) into a temporary it
    allocates, and the rank whose result ends in that temporary copies it back: two, in
    place too. The ring and Rabenseifner copy sendbuf into recvbuf out of place only (one, or
    none in place); basic_linear and nonoverlapping (stood in for by ``tree``) are not counted.
    """
    stand_in = native_algorithm(nranks, nbytes, itemsize, commutative)
    choice = _ompi_choice(nranks, nbytes, commutative)
    if choice not in OMPI_COPIES or stand_in == "tree":
        return 0
    if stand_in == "recursive_doubling":
        return 2
    return 0 if in_place else 1


#: the modelled in-network algorithm: no executor runs it (no machine here has such a switch).
SHARP = "sharp"
#: the node-local shared-memory transport (:mod:`mpiallreduce.shm`): not a schedule of messages.
SHM = "shm"


class _NodeCosts:
    """What the shared-memory transport's phases cost on a node of this machine: copies and
    combines at their calibrated rates, and a phase of ``ranks`` ranks working at once bounded
    by the node's bandwidth at that size (``node_curve``, else ``node_bandwidth``)."""

    def __init__(self, machine: Machine, dtype):
        self.machine, self.dtype = machine, np.dtype(dtype).name

    def phase(self, ranks: int, per_rank_seconds: float, traffic_per_rank: float,
              rate_at: int = 0) -> float:
        # the node's rate where each rank moves this phase's bytes (its caches for small ones;
        # measured with NumPy's copies, so at least ``rate_at``'s where no call is made)
        bandwidth = (self.machine.node_bandwidth_at(max(traffic_per_rank / 2, rate_at))
                     if ranks > 1 and traffic_per_rank else 0.0)
        if bandwidth > 0:
            return max(per_rank_seconds, ranks * traffic_per_rank / bandwidth)
        return per_rank_seconds

    def copy(self, nbytes: int, rate_at: int = 0) -> float:
        """A copy of ``nbytes`` at the calibrated rate of copies of ``max(nbytes, rate_at)``
        bytes (``rate_at``: a copy made without a call of its own, see :data:`IN_LOOP_BYTES`)."""
        return (nbytes * float(self.machine.copy_at(min(max(nbytes, rate_at), RESIDENT_COPY)))
                if nbytes else 0.0)

    def combine(self, nbytes: int, call: bool = True, rate_at: int = 0) -> float:
        """γ on ``nbytes`` (at the rate of ``max(nbytes, rate_at)``), and the per-call cost of
        a combine unless ``call`` is false."""
        return (nbytes * float(self.machine.gamma_at(self.dtype, max(nbytes, rate_at)))
                + (self.machine.combine if call else 0.0))

    def reduce(self, ranks: int, nbytes: int, call: bool = True, peer: bool = True,
               rate_at: int = 0) -> float:
        """Combine ``nbytes`` of each of ``ranks`` slots (with ``peer``, the peers' freshly
        written ones cost ``shm_peer`` per byte beyond γ); ``call``: each combine is a call of
        its own."""
        return (ranks - 1) * (self.combine(nbytes, call, rate_at)
                              + (nbytes * self.machine.shm_peer_at(nbytes) if peer else 0.0))


#: the largest copy whose calibrated rate (allocate and copy) the transport's copies into
#: their existing slots and results take: from glibc's largest mmap threshold (32 MiB) the
#: calibration's target is mapped afresh each time and its rate carries the page faults
#: (``fault``), which a slot written every call never pays (with the 64 MiB rate, shm at
#: 64 MiB was predicted far slower than it runs)
RESIDENT_COPY = OMPI_FRESH_BYTES // 2


#: the size whose calibrated copy and combine rates (NumPy calls, timed by size) carry no
#: per-call cost: the compiled small regime's memcpy and loop make no call per copy, so at
#: every size they take these rates (the small sizes' own hold NumPy's call, and with them
#: the model put shm at 1-8 KiB well above its measured time)
IN_LOOP_BYTES = 64 << 10


def _predict_shm(nranks, nbytes, topology, machine, dtype, in_place=False) -> Prediction:
    """The shared-memory transport on one node (:mod:`mpiallreduce.shm`), by its regimes.

    Small (up to ``small_bytes(p)`` per rank): copy the input into the rank's slot, publish, wait
    for every peer, then every rank combines all p slots into its result ((p-1) combines of
    the whole message). Large, a chunk (``shm.chunk_bytes``) at a time: copy the p-1 peers'
    blocks in, publish and wait, combine this rank's block (1/p) across the p inputs, copy it
    into the slot and the result, publish and wait, copy the p-1 other blocks out. Each phase
    runs on every rank of the node at once, so its bytes (reads and writes of all p ranks)
    cannot move faster than the node's bandwidth at that size (``node_curve``, else
    ``node_bandwidth``). ``shm_small``/``shm_large`` are the calibrated seconds
    per call (per chunk in the large regime) beyond the copies and combines (Python, counters,
    waits),
    ``shm_peer`` the seconds per byte read from the peers' freshly written slots.
    """
    if topology.nnodes > 1:
        raise ValueError("shm runs on one node only: predict it with all ranks on one node")
    itemsize = np.dtype(dtype).itemsize
    size = int(nbytes) // itemsize * itemsize
    p = nranks
    node = _NodeCosts(machine, dtype)
    if p == 1 or size == 0:
        time_ = node.copy(size) if not in_place else 0.0
        steps = 0
    elif size <= small_bytes(p):
        # the compiled call path reduces float32 and float64 in C, no combine calls: its cost
        # per call is shm_small's (measured at 8 B); other types' load and reduce call NumPy:
        # shm_call where measured, else a combine's per-call cost per combine
        numpy_calls = np.dtype(dtype).name not in COMPILED_REDUCE_DTYPES
        calls = numpy_calls and machine.shm_call is None
        rate_at = 0 if numpy_calls else IN_LOOP_BYTES
        time_ = (machine.shm_small + (machine.shm_call if numpy_calls and not calls else 0.0)
                 + node.phase(p, node.copy(size, rate_at), 2 * size, rate_at)
                 + node.phase(p, node.reduce(p, size, calls, rate_at=rate_at),
                              (2 * p - 1) * size, rate_at))
        steps = 1
    else:
        part = -(-size // p)
        chunks = -(-size // chunk_bytes(size))
        time_ = (chunks * machine.shm_large
                 + node.phase(p, node.copy((p - 1) * part), 2 * (p - 1) * part)
                 + node.phase(p, node.reduce(p, part, peer=False) + node.copy(part),
                              (p + 3) * part)
                 + node.phase(p, (p - 1) * (node.copy(part) + machine.combine),
                              2 * (p - 1) * part))
        steps = 2
    zeros = np.zeros(nranks, dtype=np.int64)
    return Prediction(SHM, nranks, size, time_, np.full(nranks, time_), zeros, zeros.copy(),
                      (0, 0), (0, 0), None, steps, "closed form (shared memory)")


def _node_phased(nranks: int, count: int, topology: Topology, params: dict) -> bool:
    """Whether hierarchical or cascade runs its intra-node phase over shared memory, as
    :func:`mpiallreduce._plans._node_phased` decides it: ``intra="shm"``, or ``"auto"`` where
    some node holds two ranks or more (the library's plans also fall back to the schedule
    where ranks outnumber cores, which the model refuses to predict)."""
    intra = params.get("intra", "auto")
    check_intra(intra)
    if intra == "p2p" or nranks == 1 or count == 0:
        return False
    return intra == "shm" or max(topology.node_sizes) > 1


def _cross(name: str, group: int, nbytes: int, topology: Topology, machine: Machine, dtype,
           inner: str, ordered: bool) -> Prediction | None:
    """The cross-node phase of a node-phased run: ``inner`` among ``group`` ranks, one per node
    (every message on the inter-node link); cascade over the coarser levels where the topology
    has them (their units become the nodes, the inter link inside them too)."""
    if group <= 1 or not nbytes:
        return None
    first = [unit[0] for unit in topology.members]  # local rank 0 of every node: a group
    if name == "cascade" and len(topology.levels) > 1:
        # the next level's units become the nodes: the network is their intra-node link, the
        # next level's link (if the machine has one) their network
        coarse = Topology.from_levels(*[[level[rank] for rank in first]
                                        for level in topology.levels[1:]])
        shifted = replace(machine, intra=machine.inter,
                          inter=machine.levels[0][1] if machine.levels else machine.inter,
                          levels=machine.levels[1:])
        return predict("cascade", group, nbytes, coarse, shifted, dtype, inner=inner,
                       intra="p2p")
    accepted = algorithms.REGISTRY[inner].params  # an order-keeping inner may take ordered=
    # one rank per node; the coarser levels kept, so messages between racks or sites take
    # their links where the machine gives them
    leaders = Topology.from_levels(list(range(group)),
                                   *[[level[rank] for rank in first]
                                     for level in topology.levels[1:]])
    return predict(inner, group, nbytes, leaders, machine, dtype,
                   **({"ordered": True} if ordered and "ordered" in accepted else {}))


def _predict_node_phased(name, nranks, nbytes, topology, machine, dtype, in_place,
                         params) -> Prediction:
    """hierarchical or cascade with the shared-memory intra-node phase (:mod:`.shm_nodes`).

    One epoch per node: every rank copies its input into its slot (in place too: ``in_place``
    changes nothing here); the node's owners reduce
    their blocks of every slot (hierarchical: every rank a block, or the leader all of it up to
    ``shm.SMALL_BYTES``; cascade: the smallest node's size of owners); then the cross-node
    phase (:func:`_cross`: the leaders allreduce the vector, or each owner its block with the
    owners of its local index); then every rank copies the result out of the slots
    (hierarchical: the owners' blocks gathered by the leader, copied into its slot, and the
    vector copied out by every other rank; cascade: each owner's block into its slot, every
    rank copies the other blocks out). The slowest node sets when the cross phase starts and
    ends; each phase of a node is bounded by the node's bandwidth as ``shm``'s are; per call
    for the counters, waits and Python ``phased_small`` up to ``shm.small_bytes`` of the
    largest node, else ``phased_large`` (calibrated on one node; where a machine has none,
    ``shm_small``/``shm_large``), ``call`` for the cross phase's plan inside :func:`_cross`'s
    prediction.
    """
    itemsize = np.dtype(dtype).itemsize
    count = int(nbytes) // itemsize
    size = count * itemsize
    node = _NodeCosts(machine, dtype)
    ordered = bool(params.get("ordered"))
    hierarchical = name == "hierarchical"
    if ordered and not topology.contiguous:  # as node_phase refuses it
        raise ValueError(f"hierarchical keeps rank order only when every node is a block of "
                         f"consecutive ranks; {topology!r} is not (use a commutative op)")
    small = hierarchical and size <= SMALL_BYTES
    sizes = set(topology.node_sizes)
    core = min(sizes)
    before, after = 0.0, 0.0
    for m in sizes:
        owners = 1 if small else (m if hierarchical else core)
        lo, hi = block(count, owners, 0)
        part = (hi - lo) * itemsize  # the widest block
        reduce_ = node.phase(owners, node.reduce(m, part), (m + 1) * part)
        if hierarchical:
            # the other owners publish their blocks and the leader gathers them (a leader
            # reducing all of it has nothing to gather)
            gather = node.copy(part) + node.copy(size - part) if owners > 1 else 0.0
            out = node.copy(size) + node.copy(size)  # the leader publishes, the others copy
        else:
            gather = 0.0
            out = node.copy(part) + node.phase(m, node.copy(size - part if m == owners
                                                             else size), 2 * size)
        before = max(before, node.phase(m, node.copy(size), 2 * size) + reduce_ + gather)
        after = max(after, out)
    if hierarchical:
        inner = choose_inner(params.get("inner"), count, ordered)
        cross = _cross(name, topology.nnodes, size, topology, machine, dtype, inner, ordered)
        groups = [list(topology.leaders)]
    else:
        lo, hi = block(count, core, 0)
        inner = choose_inner(params.get("inner"), hi - lo)
        cross = _cross(name, topology.nnodes, (hi - lo) * itemsize, topology, machine, dtype,
                       inner, False)
        groups = [[unit[local] for unit in topology.members] for local in range(core)]
    if size <= small_bytes(max(sizes)):
        fixed = machine.shm_small if machine.phased_small is None else machine.phased_small
    else:
        fixed = machine.shm_large if machine.phased_large is None else machine.phased_large
    total = fixed + before + (0.0 if cross is None else cross.time) + after
    # the messages are the cross phase's (every owner group's as the widest one's), all on
    # the network; the intra-node phases move bytes through shared memory, not messages
    sent_bytes = np.zeros(nranks, dtype=np.int64)
    sent_messages = np.zeros(nranks, dtype=np.int64)
    link_bytes = link_messages = (0, 0)
    if cross is not None:
        for group in groups:
            sent_bytes[group] += cross.sent_bytes
            sent_messages[group] += cross.sent_messages
        link_bytes = (0, len(groups) * sum(cross.link_bytes))
        link_messages = (0, len(groups) * sum(cross.link_messages))
    return Prediction(name, nranks, size, total, np.full(nranks, total), sent_bytes,
                      sent_messages, link_bytes, link_messages, None,
                      2 + (0 if cross is None else cross.steps),
                      f"closed form (shared memory in {topology.nnodes} node(s), {inner} across)")


def _predict_sharp(nranks, nbytes, topology, machine, dtype) -> Prediction:
    """Reduce to a leader per node, one in-network allreduce among leaders, broadcast back.

    The two node phases are ``hierarchical`` on one node of each node size as :func:`predict`
    gives it (over shared memory where a node holds two ranks or more, else the binomial
    reduce and broadcast with the interpreter's step terms); the switch phase is one executor step
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
