"""predict and choose: dispatch to the simulator, native's stand-in, or the modelled switch."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import algorithms
from ..topology import Topology
from .machine import DEFAULT_MACHINE, INTRA, Machine, check_cores
from .native import OMPI_COPIES, _ompi_choice, native_algorithm
from .programs import ROTATION_INVARIANT, _base_parts, _quotient, _ring_base, _table
from .simulate import Prediction, _counts, _run, _simulate_ring_sparse, _simulate_table


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
