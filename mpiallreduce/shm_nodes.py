"""Hierarchical and cascade across nodes with the shared-memory transport inside each node.

Transport layer, with :mod:`.shm` and :mod:`.executor`: the ranks of each node of a topology
(real nodes, or simulated ones: ``Topology.simulated``, ``MPIALLREDUCE_RANKS_PER_NODE``, which
all live on this machine) share a :class:`~.shm.Node` of their own, made from a ``Split`` of
the private duplicate by node; across nodes the ranks run a point-to-point schedule
(:class:`~.executor.Plan`, on the private duplicate's ranks). What each rank does is plain
data from :func:`mpiallreduce.algorithms.nodes.node_phase`. One run is one epoch of the node:

- every rank copies its input into its slot and publishes ``2e - 1`` ("arrived"); every rank
  waits for its node and compares the signatures (count, dtype, op, plan), as ``shm`` does;
- each owner reduces its block of every slot in local order (rank order on contiguous nodes);
- cascade: each owner allreduces its block across nodes with the ranks of its local index,
  copies it into its slot and publishes ``2e``; every rank waits for ``2e`` and copies the
  blocks out;
- hierarchical: every other owner copies its reduced block into its slot and publishes ``2e``;
  the leader waits for them, gathers the blocks, allreduces the vector with the other leaders,
  copies it into its slot and publishes ``2e``; every other rank waits for the leader alone and
  copies the vector out.

Slots are reused by call parity as in :mod:`.shm` (a rank starts call ``e + 1`` only after its
node's ranks all started call ``e``, so they have finished reading call ``e - 1``).

Collectives (all at points every rank reaches alike, decided from agreed call arguments): the
first plan of a topology's node partition on a communicator splits it and checks, on every
rank together, that each node lies in one shared-memory node (:func:`node_for`); a window grows
inside a node (``Node.reserve``) from the agreed count, at the same call on every node.

Signatures are compared inside a node only: a node whose ranks run different calls raises
there (the same ValueError on its ranks), while the other nodes' ranks wait in the cross-node
phase (a timeout ends it), as point-to-point plans run in different orders do. The argument
check (``check=True``) runs separately for these plans, across every rank, before the run.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _hooks
from ._waiting import meet
from .errors import CollectiveTimeout
from .executor import Plan, _PlanBase, flat
from .ops import DTYPES
from .partition import block
from .shm import KIND_DATA, Node, ShmPlan, digest, signature_words
from .shm.plan import copy_call

#: the algorithms this transport runs (their index is folded into the signature).
ALGORITHMS = ("hierarchical", "cascade")


def _delete_nodes(comm, keyval, table) -> None:
    for node in table.values():
        if node is not None:
            node.close()


#: the nodes of a communicator by topology partition (a dict on its private duplicate), each
#: this rank's :class:`~.shm.Node`, or None where some node does not share memory.
KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_nodes)


def node_for(state, topology, deadline: float | None = None, what: str = "allreduce"
             ) -> Node | None:
    """This rank's shared-memory node among ``topology``'s nodes, or None where some node of
    it does not lie in one shared-memory node (on every rank alike). Made on first use for the
    topology's partition (collective over the communicator: a ``Split``, ``Split_type``s and
    an ``Allreduce``); later calls find it. ``node.crowded`` (the same on every rank): some
    machine runs more of the communicator's ranks than it has cores (``os.cpu_count()``).
    """
    private = state.private
    table = private.Get_attr(KEYVAL)
    if table is None:
        table = {}
        private.Set_attr(KEYVAL, table)
    key = topology.node
    if key in table:
        return table[key]
    if deadline is not None:
        meet(private, deadline, state.fail,
             f"{what} on rank {private.Get_rank()}: setting up shared memory")
    rank = private.Get_rank()
    comm = private.Split(key[rank], rank)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    machine = private.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    # every node in one shared-memory node; no machine with more of these ranks than cores
    mine = np.array([shared.Get_size() == comm.Get_size(),
                     machine.Get_size() <= (os.cpu_count() or 1)], dtype=np.int32)
    shared.Free()
    machine.Free()
    every = np.empty_like(mine)
    private.Allreduce(mine, every, op=MPI.MIN)
    if every[0]:
        node = table[key] = Node(private, state, comm=comm)
        node.crowded = not every[1]
    else:
        comm.Free()
        table[key] = None
    return table[key]


class NodesPlan(ShmPlan):
    """hierarchical or cascade with the shared-memory intra-node phase, bound once.

    Looks like the other plans to everything above (``run``, ``start`` through the plans
    without steps, ``free``, ``nbytes``, ``algorithm``); build with :func:`build`.
    """

    #: its node is part of the communicator: the run checks its node's calls, not the call
    whole = False

    def __init__(self, node: Node, call, phase, *, name: str, members: tuple[int, ...],
                 plan_id: int, persistent: bool, timeout, state):
        _PlanBase.__init__(self, state.private, call.send, call.recv, call.reducer,
                           timeout=timeout, state=state)
        self.algorithm = name
        self.transport = "shm"
        self._node = node
        self._members = members  # the communicator's rank of each local rank
        self._label = f"{name} allreduce"  # as the schedule's messages name it
        self._agreement = self._disagree = None
        self._scratch = np.empty(0, dtype=call.recv.dtype)
        self._local = ()
        for array in (call.send, call.recv):
            memory = getattr(array, "_block", None)
            if memory is not None and memory.freed:
                raise ValueError("a buffer of this call is a shared array that has been freed")
        result = self._result
        count, dtype = result.size, result.dtype
        fields = [count, DTYPES.index(dtype), call.reducer.index, plan_id, -1, -1, -1, -1]
        # the algorithm and its split folded in: hierarchical and cascade runs never pair up
        shape = (ALGORITHMS.index(name), phase.owners, len(members))
        words = signature_words(KIND_DATA, fields + [digest(KIND_DATA, shape)])
        signed = (memoryview(np.array(words, dtype=np.int64)).cast("B").cast("q"), words[1])
        self._signed = (signed, signed)
        self._peer_digests = tuple(tuple((node.headers[q], lo + 1) for q in node.peers)
                                   for lo, _ in node.areas)
        self._segments, self._capacity = node.segments, node.capacity  # (as ShmPlan's)
        lo, hi = phase.span
        # across nodes: the point-to-point steps on this rank's span, without AVG's division
        # (the run divides once, after the cross phase)
        self._cross = None
        if phase.cross:
            reducer = replace(call.reducer, average=False)
            # named as the whole plan (timeout messages, traces: a run of ``name`` on the span)
            self._cross = Plan(state.private, phase.cross, None, result[lo:hi], reducer, name,
                               persistent=persistent, state=state, tag_base=plan_id)
        # (ranks, headers) a leader waits for (the other owners), and its followers (the leader)
        owners = tuple(range(1, min(phase.owners, node.size)))
        self._owners = (owners, tuple(node.headers[q] for q in owners))
        self._leader = ((0,), (node.headers[0],))
        source = flat(call.send) if call.send is not None else result
        tracer = _hooks.tracer
        if tracer is not None:  # tracing (.tracing): this plan's phases bound traced, now
            self._phase = tracer.marks(self, "shm", "nodes")
        self._programs = tuple(self._bind_nodes(parity, source, phase) for parity in (0, 1))
        self._run = self._run_leader if phase.leader and node.rank == 0 else (
            self._run_follower if phase.leader else self._run_cascade)
        if tracer is not None:  # the run's ends, its waits and its cross phase are methods
            marks = self._phase
            self._run = marks.around(self._run)
            self._wait_for = marks.before("wait", self._wait_for)
            if self._cross is not None:  # (its own run, traced as a schedule, nests in it)
                self._across = marks.before("across", self._across)
                tracer.rename(self._cross, f"{name} across nodes")

    @property
    def nbytes(self) -> int:
        return self._scratch.nbytes + (0 if self._cross is None else self._cross.nbytes)

    def free(self) -> None:
        super().free()
        if self._cross is not None:
            self._cross.free()

    # -- binding ----------------------------------------------------------------------------

    def _bind_nodes(self, parity: int, source: np.ndarray, phase) -> tuple:
        """(load, reduce, gather, publish, pull) for one parity.

        load: the input into this rank's slot. reduce: this rank's block of every slot into
        the result. gather (hierarchical's leader): the other owners' reduced blocks into the
        result, once they published them. publish: after the cross phase (and AVG's division),
        this rank's part of the result into its slot. pull: once the peers published, the
        rest of the result.
        """
        node, result = self._node, self._result
        rank, count = node.rank, result.size
        slots = self._slots(parity)
        owners = min(phase.owners, node.size)
        load = [copy_call(slots[rank], source)]
        reduce, gather, publish, pull = [], [], [], []
        span = phase.span
        if rank < owners:
            lo, hi = block(count, owners, rank)
            # one float64 summed or multiplied (AVG divides after the cross phase, so not AVG):
            # shm's Python-float reduction, without NumPy's per-call cost
            scalar = (hi - lo == count and not self._average and node.size > 1
                      and self._scalar(slots))
            if scalar:
                reduce.append(scalar)
            elif hi > lo:
                reduce += self._reduce_into(result[lo:hi], [slot[lo:hi] for slot in slots])
            if phase.leader and rank > 0:
                span = (lo, hi)
        if phase.leader and rank == 0:  # gathers the blocks, publishes the whole vector
            for q in range(1, owners):
                start, stop = block(count, owners, q)
                gather.append(copy_call(result[start:stop], slots[q][start:stop]))
            span = (0, count)
        elif phase.leader:
            pull.append(copy_call(result, slots[0]))
        else:
            for q in range(owners):
                if q != rank:
                    start, stop = block(count, owners, q)
                    pull.append(copy_call(result[start:stop], slots[q][start:stop]))
        lo, hi = span
        if hi > lo:
            if self._average and (not phase.leader or rank == 0):
                publish.append(partial(np.divide, result[lo:hi], self._nranks, result[lo:hi]))
            publish.append(copy_call(slots[rank][lo:hi], result[lo:hi]))
        mark = self._phase
        return (tuple(mark("arrive", None, load)), tuple(mark("reduce", None, reduce)),
                tuple(mark("gather", None, gather)), tuple(mark("publish", None, publish)),
                tuple(mark("copy out", None, pull)))

    def _reduce_into(self, out: np.ndarray, operands: list[np.ndarray]) -> list:
        if len(operands) == 1:  # a node of one rank
            return [copy_call(out, operands[0])]
        return super()._reduce_into(out, operands)

    # -- running ------------------------------------------------------------------------------

    def _across(self, timeout, deadline) -> None:
        """This rank's cross-node phase (point to point), within what is left of ``deadline``."""
        cross = self._cross
        if cross is None:
            return
        if deadline is None:
            cross.run()
            return
        try:
            cross.run(max(deadline - time.monotonic(), 1e-6))
        except CollectiveTimeout as exc:
            self._broken = str(exc)
            self._timed_out.append(self._broken)
            raise

    def _wait_for(self, node: Node, target: int, some, timeout, deadline, step: int) -> None:
        """Wait until the node's ranks ``some`` (``(ranks, headers)``; None: all) published
        ``target``."""
        for header in node.peer_headers if some is None else some[1]:
            if header[0] < target:
                break
        else:  # all there already (no call into the waiting loop)
            if node.sync is not None:
                node.sync()
            return
        missing = node.wait(target, deadline, some, self._where())
        if missing is not None:
            names = ", ".join(str(self._members[q]) for q in missing)
            self.fail(f"{self._label} on rank {self._members[node.rank]}: no answer from "
                      f"rank(s) {names} in step {step} within {timeout:g} s (a rank did not "
                      f"make this call, or ranks run plans or calls on this communicator in "
                      f"different orders)")

    def _arrive(self, node: Node, epoch: int, value: int, timeout, deadline, step: int) -> None:
        """Publish ``value``, wait for the node's ``2 * epoch - 1 + step``, and (step 0)
        compare the signatures (as shm's, naming the communicator's ranks)."""
        node.publish(value)
        self._wait_for(node, 2 * epoch - 1 + step, None, timeout, deadline, step)
        if step == 0:
            parity = epoch & 1
            mine = self._signed[0][1]
            for header, word in self._peer_digests[parity]:
                if header[word] != mine:
                    self._mismatch(node.signatures[parity], timeout)

    def _start_epoch(self, node: Node, epoch: int, timeout, deadline) -> tuple:
        """Load, sign, publish "arrived", wait for the node, compare, reduce; the program."""
        parity = epoch & 1
        program = self._programs[parity]
        for call in program[0]:
            call()
        self._sign(node, parity, timeout)
        self._arrive(node, epoch, 2 * epoch - 1, timeout, deadline, 0)
        for call in program[1]:
            call()
        return program

    def _run_cascade(self, node: Node, epoch: int, timeout, deadline) -> None:
        _, _, _, publish, pull = self._start_epoch(node, epoch, timeout, deadline)
        self._across(timeout, deadline)
        for call in publish:
            call()
        self._arrive(node, epoch, 2 * epoch, timeout, deadline, 1)
        for call in pull:
            call()

    def _run_leader(self, node: Node, epoch: int, timeout, deadline) -> None:
        _, _, gather, publish, _ = self._start_epoch(node, epoch, timeout, deadline)
        if gather:
            self._wait_for(node, 2 * epoch, self._owners, timeout, deadline, 1)
            for call in gather:
                call()
        self._across(timeout, deadline)
        for call in publish:
            call()
        node.publish(2 * epoch)

    def _run_follower(self, node: Node, epoch: int, timeout, deadline) -> None:
        _, _, _, publish, pull = self._start_epoch(node, epoch, timeout, deadline)
        for call in publish:
            call()
        node.publish(2 * epoch)
        self._wait_for(node, 2 * epoch, self._leader, timeout, deadline, 1)
        for call in pull:
            call()


def build(node: Node, call, phase, *, name: str, topology, plan_id: int, persistent: bool,
          timeout, deadline, what: str) -> NodesPlan:
    """Bind ``name`` for ``call`` with the shared-memory intra-node phase on ``node``.

    The window grows here (inside the node, collective there) from the call's agreed count.
    """
    rank = node.state.private.Get_rank()
    members = topology.members[topology.node[rank]]
    node.reserve(call.recv.nbytes, deadline, what)
    return NodesPlan(node, call, phase, name=name, members=members, plan_id=plan_id,
                     persistent=persistent, timeout=timeout, state=node.state)
