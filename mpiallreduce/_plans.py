"""Plan building: resolve ``auto``, build (and cache) schedules, bind plans, cache one-shot calls."""

from __future__ import annotations

import time
import weakref
from dataclasses import replace
from functools import partial

import numpy as np
from mpi4py import MPI

from . import _form, algorithms, learn, select, shm, shm_nodes
from ._agree import Signature, agree, disagree, prepare
from ._checks import ALGORITHMS, Call, allreduce_call, in_shared_memory, plain_timeout
from ._schedules import SCHEDULES, builder_params, steps  # noqa: F401 - the package's names here
from ._state import CALLS, LAST, SHAPES, CommState
from ._state import state as comm_state
from .algorithms.compose import check_intra
from .algorithms.nodes import NODE_PHASED, node_phase
from .executor import Plan, run_program, scratch_size
from .native_plan import NativePlan
from .ops import native_deviates


def resolve(call: Call, nranks: int, state: CommState | None = None,
            deadline: float | None = None, what: str = "allreduce",
            shared: bool = False, learned: bool = True) -> str:
    """The algorithm a call runs: its own, or what ``auto`` picks (the same on every rank).

    ``auto`` never hands 8/16-bit SUM/PROD to a native library that saturates them (Open MPI's
    ``op/avx``): it runs a schedule there, whose NumPy combines wrap as C does. Given the
    communicator's ``state``, ``auto`` picks what :func:`select.one_node_choice` says (``shm``,
    or out of place a schedule where one measured faster, for commutative ops) where every rank
    is on one node (the first time, the topology discovery is collective: every rank resolves
    its first ``auto`` call at the same call, a miss of every cache). A tuning table for the
    communicator size overrides that rule. Where it asks the cost model (more ranks than were
    measured) without a topology given, the model gets the communicator's own, not one node.
    ``shared``: see :func:`select.one_node_choice` (decided alike on every rank by the caller);
    an in-place call on a shared array (``mpiallreduce.shared_empty``) is one too, which the
    argument check compares across ranks.
    With learning on (:mod:`.learn`), that choice is the first guess: the case's learned choice,
    or ``learn.LEARNING`` while it is being learned (``learned=False``: the rules' alone).
    """
    name = call.algorithm
    if name != "auto":
        return name
    shared = shared or (call.send is None and in_shared_memory(call.recv))
    if learned and state is not None:
        ruled = resolve(call, nranks, state, deadline, what, shared, learned=False)
        return learn.resolve(state, call, nranks, ruled, what, shared, lambda: (
            call.topology or state.default_topology(deadline, what)), deadline)
    red, nbytes = call.reducer, call.recv.nbytes
    one_node = None if state is None else select.one_node_choice(
        nranks, nbytes, call.send is None, red.commutative, shared)
    if one_node is not None:
        topology = call.topology
        if topology is None:
            topology = state.default_topology(deadline, what)
        if topology.nnodes == 1:
            return one_node
    if nranks > 1 and native_deviates(red.name, call.recv.dtype):
        return "recursive_doubling" if nbytes < select.MODULAR_RING_BYTES else "ring"
    topology = call.topology
    if topology is None and state is not None and nranks > select.MEASURED_RANKS \
            and select.lookup(select.tables(), nranks, nbytes, red.commutative,
                              call.send is None) is None:
        topology = state.default_topology(deadline, what)
    name = select.choose(nranks, nbytes, red, topology, in_place=call.send is None)
    # a table measured on one node names shm; a communicator of that size across nodes (the
    # same on every rank: the topology is agreed) gets the built-in choice instead
    if name == "shm" and nranks > 1 and state is not None \
            and (topology or state.default_topology(deadline, what)).nnodes > 1:
        name = select.choose(nranks, nbytes, red, topology, use_tables=False)
    return name


def build(call: Call, state: CommState, *, explicit: bool, persistent: bool,
          timeout: float | None, deadline: float | None = None, what: str = "allreduce",
          borrow_scratch: bool = False, shared: bool = False, algorithm: str | None = None,
          learned: bool = True):
    """Bind a plan for ``call`` (``algorithm``: this one, not the call's or ``auto``'s, the
    call itself kept as it is: a learning plan's candidates, :class:`.learn.Learner`).

    ``explicit`` plans (``mar.plan``) take a slot of tags of their own, and native ones a
    communicator of their own; one-shot calls share slot 0 of the private duplicate.
    ``persistent`` plans own persistent requests (cached one-shot plans are). Every plan owns
    its scratch, except a blocking one-shot call's (``borrow_scratch``), which borrows the
    communicator's: it runs to completion in the caller's thread before anything else can use
    it (a request in flight has scratch of its own). ``timeout`` is the plan's default for its
    runs; ``deadline`` (time.monotonic) bounds the collective set-up a build may need.
    ``learned=False``: ``auto`` is the rules' choice, never learned (a reproducible sum's inner
    exchanges: their cost is not the call's to trade).
    """
    private = state.private
    nranks, rank = private.Get_size(), private.Get_rank()
    name = algorithm or resolve(call, nranks, state, deadline, what, shared, learned)
    if name == learn.LEARNING:
        return learn.Learner(state, call, partial(
            build, call, state, explicit=explicit, persistent=persistent, timeout=timeout,
            what=what, borrow_scratch=borrow_scratch, shared=shared), explicit,
            entry=lambda plan, objects: CallEntry(call, plan, state, objects))
    if name == "native":
        comm = state.duplicate(deadline, what) if explicit else private
        return NativePlan(comm, call.send, call.recv, call.reducer, timeout=timeout, state=state,
                          owned=explicit)
    topology = call.topology
    if name == "shm":  # the node-local shared-memory transport, not a schedule
        return build_shm(call, state, explicit=explicit, timeout=timeout, deadline=deadline,
                         what=what)
    if algorithms.get(name).uses_topology and topology is None:
        # Every rank reaches this point for the same algorithm, so the discovery's collectives match.
        topology = state.default_topology(deadline, what)
    if name in NODE_PHASED:
        plan = _node_phased(name, call, state, topology, explicit=explicit,
                            persistent=persistent, timeout=timeout, deadline=deadline, what=what)
        if plan is not None:
            return plan
    plan_steps = steps(name, rank, nranks, call.recv.size, topology, builder_params(name, call))
    scratch = (state.scratch_for(call.recv.dtype, scratch_size(plan_steps)) if borrow_scratch
               else None)
    tag_base = state.take_slot() if explicit else 0
    return Plan(private, plan_steps, call.send, call.recv, call.reducer, name,
                persistent=persistent, scratch=scratch, timeout=timeout, state=state,
                tag_base=tag_base)


def build_shm(call: Call, state: CommState, *, explicit: bool, timeout, deadline, what: str,
              signature=None, exact: bool = False):
    """Bind an shm plan for ``call``: every run compares the argument-check fields too (those
    ``signature(timeout)`` gives, by default the call's), an explicit plan's as agreed when it
    was built, a one-shot call's with the timeout of the run (as the check would). ``exact``:
    see :func:`.shm.build`."""
    topology = call.topology
    if topology is None and state.private.Get_size() > 1:
        topology = state.default_topology(deadline, what)
    signature = call.signature if signature is None else signature
    agreement = ((signature(timeout),) * 2 if explicit
                 else (signature(None), signature(1.0)))
    return shm.build(call, state, topology=topology, timeout=timeout, deadline=deadline,
                     plan_id=state.take_slot() if explicit else 0, what=what,
                     agreement=agreement, disagree=partial(_disagree, state.checker, what),
                     exact=exact)


def _node_phased(name: str, call: Call, state: CommState, topology, *, explicit: bool,
                 persistent: bool, timeout, deadline, what: str):
    """hierarchical or cascade with the shared-memory intra-node phase (:mod:`.shm_nodes`),
    or None for the point-to-point schedule.

    ``intra="auto"`` (the default) takes shared memory wherever every node of the topology
    lies in one shared-memory node (real nodes, or simulated ones on one machine), some node
    has two ranks or more, and no machine runs more of the ranks than it has cores
    (``node.crowded``, agreed); ``"shm"``
    insists (ValueError on every rank where it cannot); ``"p2p"`` runs the schedule. Decided
    from the agreed arguments and topology and from :func:`.shm_nodes.node_for`, whose first
    use per node partition is collective (every rank builds the call's first plan alike).
    """
    params = dict(builder_params(name, call))
    intra = params.pop("intra", "auto")
    check_intra(intra)
    nranks = state.private.Get_size()
    if intra == "p2p" or nranks == 1 or call.recv.size == 0:
        return None
    node = shm_nodes.node_for(state, topology, deadline, what)
    if node is None:
        if intra == "shm":
            raise ValueError(f"{name} with intra='shm' needs every node of {topology!r} in one "
                             f"shared-memory node, and some is not; use intra='auto' or 'p2p'")
        return None
    if intra == "auto" and (node.crowded or max(topology.node_sizes) == 1):
        # where ranks outnumber cores the schedule measured faster at every size (4 ranks on
        # 2 cores, docs/algorithms.md); nodes of one rank have nothing to share
        return None
    phase = node_phase(name, state.private.Get_rank(), call.recv.size, topology,
                       small=call.recv.nbytes <= shm.SMALL_BYTES, **params)
    return shm_nodes.build(node, call, phase, name=name, topology=topology,
                           plan_id=state.take_slot() if explicit else 0, persistent=persistent,
                           timeout=timeout, deadline=deadline, what=what)


def _disagree(checker: MPI.Intracomm, what: str, fields: list[int]) -> None:
    disagree(checker, what, fields, None, ALGORITHMS)


def checks_itself(call: Call, state: CommState, learned: bool = True) -> bool:
    """Does this one-shot allreduce's run check its own arguments, so that ``check=True`` needs
    no separate agreement? Where it runs ``shm`` and binds without a collective: the run then
    compares every rank's signature, the agreement's fields included (:mod:`.shm`), and raises
    the agreement's message on every rank where they differ.

    Decided from the arguments and from state every rank holds alike (the node, its window,
    the discovered topology), never from the call cache: a rank whose cache lost the call
    decides as the ranks that find it. A rank that decides otherwise (its arguments differ)
    runs the separate check at the same epoch, which the others' runs see and join.
    ``learned``: as :func:`resolve` (False where the call never takes what ``auto`` learned).
    """
    if call.collective != "allreduce":
        return False
    topology = call.topology if call.topology is not None else state.topology
    if topology is None or topology.nnodes != 1:
        return False  # discovering it would be collective; several nodes never run shm
    return resolve(call, state.private.Get_size(), state, learned=learned) == "shm" \
        and shm.fits(call, state)


# -- the one-shot call cache --------------------------------------------------------------------------

_WORLD = MPI.COMM_WORLD


#: the entry points whose calls the call cache keeps, numbered: a call's slot is
#: ``id(recvbuf) + kind``. Objects lie on 8-byte boundaries at least (CPython's allocator aligns
#: them to 16), so the slots of one array under different kinds never coincide.
ALLREDUCE, IALLREDUCE, REPRODUCIBLE = 0, 1, 2


def cached_call(kind, bind, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout,
                params: dict):
    """Run a call through the call cache: the one call path of every entry point that keeps
    what its first call bound (``allreduce``, ``iallreduce``, ``reproducible=True``).

    Normalise (``comm=None`` is ``COMM_WORLD``, a NumPy timeout a float), find the
    :class:`BoundCall` kept for these very objects, agree (with ``check``, unless its run checks
    the arguments itself) and run it. A call the cache does not hold, or whose entry these arrays
    or this timeout do not fit, is ``bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology,
    check, timeout, params)``'s: it checks and runs the call as a first one, and may keep it
    under :func:`call_key`.

    ``kind``: the entry point's number (:data:`ALLREDUCE`, :data:`IALLREDUCE`,
    :data:`REPRODUCIBLE`), which marks its entries in ``slot``, the key's third item:
    ``id(recvbuf) + kind``, under which ``LAST`` holds the entry last bound to ``recvbuf``.
    """
    if comm is None:
        comm = _WORLD
    if timeout is not None and type(timeout) not in (int, float):
        timeout = plain_timeout(timeout)
    # kept flat: every lookup here shows in the cost of an 8-byte call
    slot = id(recvbuf) + kind  # (an int: no tuple to build and hash)
    entry = LAST.get(slot)  # the entry last bound to recvbuf, verified object by object
    if entry is not None:
        objects = entry.objects
        if objects[1] is not sendbuf or objects[3] is not op or objects[0] is not comm \
                or objects[4] is not topology or entry.algorithm != algorithm \
                or entry.params != params:
            # another entry may hold recvbuf with other objects (without one, LAST holds none
            # for it: CallCache keeps it so, and a fresh array per call skips this lookup)
            entry = CALLS.get(call_key(slot, comm, sendbuf, op, algorithm, topology, params))
        # The entry holds the objects of its key alive, so equal ids are the same objects.
        # Freeing the communicator or a timeout on it drops its entries (CommState), and a plan
        # reads its arrays as flat memory, so only an element type assigned since
        # (x.dtype = ...) rebinds (a new shape of one array object is checked as a first call's)
        if entry is not None and recvbuf.dtype is entry.dtype \
                and (entry.in_place or (sendbuf.dtype is entry.dtype
                                        and sendbuf.shape == recvbuf.shape)) \
                and (timeout is None or (type(timeout) in (int, float) and timeout > 0)):
            if check and not entry.fused:  # a fused entry's run checks the arguments itself
                entry.agree(timeout)
            if timeout is None:
                direct = entry.direct
                if direct is not None:
                    direct(*entry.args)
                    return entry.result
            elif entry.timed is not None:  # (the timeout checked above)
                entry.timed(timeout)
                return entry.result
            return entry.run(timeout)
    return bind(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout, params)


def call_key(slot, comm, sendbuf, op, algorithm, topology, params: dict) -> tuple | None:
    """The call cache's key of a call (``slot``: see :func:`cached_call`), or None where a
    parameter value cannot be hashed (such a call is not kept)."""
    key = (id(comm), id(sendbuf), slot, id(op), algorithm, id(topology),
           tuple(params.items()) if params else ())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _call_each(calls: tuple) -> None:
    for call in calls:
        call()


class _Known:
    """What a remembered one-shot call (by its objects or by its shape) shares: its
    communicator's state and its signature packed for the agreement check, with and without a
    timeout (``signatures``)."""

    __slots__ = ()
    #: the call a failed agreement names
    what = "allreduce"

    def agree(self, timeout) -> None:
        """The separate agreement check of a repeated call (not for ``fused`` ones)."""
        state = self.state
        agree(state.checker, self.what, self.signatures[timeout is not None], None, ALGORITHMS,
              timeout, state)


class BoundCall(_Known, _form.compiled.BoundFields if _form.compiled is not None else object):
    """What the call cache keeps of a call for the next one with the same objects: all that
    :func:`cached_call` reads, whatever the entry point.

    ``objects``: comm, sendbuf, recvbuf, op, topology as passed (held, so their ``id`` and
    memory stay theirs); ``algorithm`` and ``params`` as requested; ``dtype`` (the result's)
    and ``in_place`` as bound (a plan reads its arrays as flat memory: a new shape of the same
    array changes nothing). ``fused``: the run checks the call's arguments itself (an shm plan on
    a node, :func:`checks_itself`), so ``check=True`` skips :meth:`agree`. The run, fastest
    first: ``direct(*args)`` without a deadline and ``timed(timeout)`` with one (each None where
    the call has no such form), after which the call returns ``result``; else ``run(timeout)``,
    which returns what the call returns. ``nbytes`` and ``free()`` are for the cache's bounds.
    In the compiled form these fields are the C members of ``_compiled.BoundFields``.
    """

    __slots__ = () if _form.compiled is not None else (
        "state", "objects", "algorithm", "params", "dtype", "in_place", "signatures", "nbytes",
        "fused", "direct", "args", "timed", "result")

    def __init__(self, call: Call, state: CommState, objects: tuple, signature=None):
        """``signature(timeout)``: the fields the agreement compares (by default the call's)."""
        signature = call.signature if signature is None else signature
        self.state = state
        self.objects = objects
        self.algorithm, self.params = call.algorithm, call.params  # as requested
        self.dtype = call.recv.dtype
        self.in_place = call.send is None
        self.signatures = (Signature(signature(None)), Signature(signature(1.0)))
        self.nbytes = 0
        self.fused = False
        self.direct = self.args = self.timed = None
        self.result = objects[2]


class CallEntry(BoundCall):
    """A bound one-shot allreduce (:class:`BoundCall`).

    ``direct(*args)``: the native call itself, with the MPI datatype given so that mpi4py need
    not infer it, when nothing else is needed (no AVG division, one piece), a schedule's flat
    calls, or an shm plan's run; else None and the plan runs. ``timed(timeout)``: an shm
    small-regime run with a timeout, or a schedule's flat run with one (``Plan.run_timed``),
    else None.
    """

    __slots__ = ("plan", "run")

    def __init__(self, call: Call, plan, state: CommState, objects: tuple):
        super().__init__(call, state, objects)
        self.plan = plan
        self.run = plan.run
        self.nbytes = arrays_bytes(call) + plan.nbytes
        self.fused = fused(plan)
        if self.fused:
            # with a timeout (checked by the caller) the small regime's timed closure
            self.direct, self.args, self.timed = plan.direct, (), plan._timed
        elif isinstance(plan, NativePlan) and len(plan.pieces) == 1 and not call.reducer.average \
                and not plan.traced:
            datatype = MPI.Datatype.fromcode(call.recv.dtype.char)
            send, recv = plan.pieces[0]
            self.direct = plan.comm.Allreduce
            self.args = (send if send is MPI.IN_PLACE else [send, datatype], [recv, datatype],
                         call.reducer.mpi_op)
        elif isinstance(plan, Plan) and plan._fast is not None:
            # a schedule: its run without deadline, the flat calls (the cache drops the entry
            # before the plan is freed or its communicator breaks, so nothing needs checking)
            self.direct, self.args = run_program, (plan._fast, plan)
            if plan._fast_timed is not None:  # and with a deadline, its flat polled steps
                self.timed = plan.run_timed

    def free(self) -> None:
        self.plan.free()


def fused(plan) -> bool:
    """Whether ``plan``'s run checks the call's arguments itself (an shm plan on a node)."""
    return isinstance(plan, shm.ShmPlan) and plan.whole and plan._node is not None


#: most bytes per rank for which a schedule's call is also remembered by its shape, through
#: staging buffers (two copies per call, cheap at these sizes).
STAGE_BYTES = 1 << 16


class Shape(_Known):
    """A one-shot allreduce known by its shape, for calls with fresh arrays each time.

    Holds the communicator, op, topology and dtype of the call (so their ids in the key stay
    theirs) and the packed signatures. Native: the MPI datatype and the private duplicate's
    ``Allreduce``, called on the caller's arrays. A schedule (``schedule``, up to
    :data:`STAGE_BYTES`): a plan bound to staging buffers of its own, built the first time a
    call finds the shape (most cached calls never do), with the caller's data copied in and the
    result out. The arrays of a call that finds it are checked on the spot (:func:`fresh_arrays`).
    """

    __slots__ = ("state", "objects", "datatype", "op", "nranks", "average", "signatures",
                 "allreduce", "schedule", "plan", "run", "staged_call", "fused", "previous",
                 "live", "small", "held")

    def __init__(self, call: Call, state: CommState, objects: tuple, schedule: bool,
                 fused: bool = False):
        self.state = state
        self.objects = objects  # comm, op, topology, the result's dtype as passed
        self.datatype = MPI.Datatype.fromcode(call.recv.dtype.char)
        self.op = call.reducer.mpi_op
        self.nranks = state.private.Get_size()
        self.average = call.reducer.average
        self.signatures = (Signature(call.signature(None)), Signature(call.signature(1.0)))
        self.allreduce = state.private.Allreduce
        self.schedule = schedule
        self.fused = fused  # its staged plan runs shm: the run checks the arguments itself
        self.previous = None  # the arrays of the last call through this shape, held weakly
        self.plan = self.run = None
        # the compiled form's small-regime shm run of the staged plan where it can run on the
        # caller's memory (``_compiled.SmallRun.takes_pointers``): the compiled call path then
        # runs this shape with no staging copies (``_compiled.run_shape``); else None
        self.small = None
        # the arrays of the compiled form's last call through ``small``, held (at most
        # STAGE_BYTES each: a shape's call is no larger): the same arrays again are bound to a
        # cache entry, as :meth:`repeats` says in the Python form
        self.held = None
        self.staged_call = None
        self.live = True  # until the cache drops it (mar.Comm keeps shapes it found)
        if schedule:  # the call on staging buffers of its own (not the caller's arrays)
            size, dtype = call.recv.size, call.recv.dtype
            self.staged_call = replace(
                call, send=None if call.send is None else np.empty(size, dtype=dtype),
                recv=np.empty(size, dtype=dtype))

    def repeats(self, sendbuf, recvbuf: np.ndarray) -> bool:
        """Whether this call passes the very arrays of the shape's previous call (still alive):
        a caller that reuses its arrays, whose call should then be bound to them (the cold path:
        a call cache entry, no staging). Otherwise :meth:`remember` these arrays."""
        previous = self.previous
        if previous is not None and previous[1]() is recvbuf \
                and (previous[0] is sendbuf if sendbuf is MPI.IN_PLACE else previous[0]() is sendbuf):
            return True
        self.remember(sendbuf, recvbuf)
        return False

    def remember(self, sendbuf, recvbuf: np.ndarray) -> None:
        """Keep the arrays of this call, weakly (arrays made per call die at once, and a new one
        may get a dead one's ``id``), for :meth:`repeats`."""
        self.previous = (sendbuf if sendbuf is MPI.IN_PLACE else weakref.ref(sendbuf),
                         weakref.ref(recvbuf))

    def call(self, sendbuf, recvbuf: np.ndarray, check: bool) -> np.ndarray:
        """Run the call on the caller's arrays (checked by :func:`fresh_arrays`), no timeout."""
        if check and not self.fused:
            self.agree(None)
        if self.schedule:
            return self.staged(sendbuf, recvbuf)
        self.allreduce(sendbuf if sendbuf is MPI.IN_PLACE else [sendbuf, self.datatype],
                       [recvbuf, self.datatype], self.op)
        if self.average:
            np.divide(recvbuf, self.nranks, out=recvbuf)
        return recvbuf

    def staged(self, sendbuf, recvbuf: np.ndarray) -> np.ndarray:
        """Run the staged plan on the caller's arrays (C-contiguous, checked by the caller).

        One-dimensional arrays (the usual ``np.array([local])``) are copied by assignment,
        which costs half of ``np.copyto`` of a reshaped view at a few elements."""
        plan = self.plan
        if plan is None:  # binding is local: no rank waits for another here
            plan = self.plan = build(self.staged_call, self.state, explicit=False,
                                     persistent=True, timeout=None)
            # without deadline, as CallEntry.direct: the cache drops the shape before its plan
            # is freed or the communicator breaks
            if fused(plan):
                self.run = plan.direct
                if self.fused and getattr(plan.direct, "takes_pointers", False):
                    self.small = plan.direct
            elif isinstance(plan, Plan) and plan._fast is not None:
                self.run = partial(_call_each, plan._fast)
            else:
                self.run = plan.run
        stage = plan.recvbuf if plan.sendbuf is None else plan.sendbuf
        source = recvbuf if sendbuf is MPI.IN_PLACE else sendbuf
        flat = recvbuf.ndim == 1
        if flat:
            stage[...] = source
        else:
            np.copyto(stage, source.reshape(-1))
        self.run()
        if flat:
            recvbuf[...] = plan.recvbuf
        else:
            np.copyto(recvbuf.reshape(-1), plan.recvbuf)
        return recvbuf

    def free(self) -> None:
        self.live = False
        self.held = None
        if self.plan is not None:
            self.plan.free()


def fresh_arrays(sendbuf, recvbuf: np.ndarray) -> bool:
    """Would :func:`._checks.allreduce_call` accept these arrays as they are (C-contiguous,
    writable result, same shape, not overlapping), given the dtype and size already match?"""
    flags = recvbuf.flags
    if not (flags.c_contiguous and flags.writeable):
        return False
    if sendbuf is MPI.IN_PLACE:
        return True
    return (type(sendbuf) is np.ndarray and sendbuf.dtype is recvbuf.dtype
            and sendbuf.shape == recvbuf.shape and sendbuf.flags.c_contiguous
            and ((sendbuf.base is None and recvbuf.base is None and sendbuf is not recvbuf)
                 or not np.may_share_memory(sendbuf, recvbuf)))


def shape_key(comm, sendbuf, recvbuf: np.ndarray, op, algorithm, topology, params: dict) -> tuple:
    # (the dtype by its id, as the other objects: the shape holds it; a dtype's hash is
    # computed per call)
    return (id(comm), id(op), algorithm, id(topology), id(recvbuf.dtype), recvbuf.size,
            sendbuf is MPI.IN_PLACE, tuple(params.items()) if params else ())


def cacheable(sendbuf, recvbuf, call: Call) -> bool:
    """Only arrays the caller passed (a result allocated per call never repeats) and predefined
    ops (a user op may be freed and its handle reused while the plan holds it)."""
    return (isinstance(recvbuf, np.ndarray)
            and (sendbuf is MPI.IN_PLACE or isinstance(sendbuf, np.ndarray))
            and call.reducer.index >= 0)


def bind_one_shot(slot, sendbuf, recvbuf, op, comm, algorithm, topology, check, timeout,
                  params: dict, allocated: bool = False):
    """A blocking allreduce the call cache does not hold, nor a shape (the arguments of
    :func:`cached_call`'s ``bind``): checked and agreed, bound, run, and kept under
    :func:`call_key` where it can be (:func:`one_shot`). ``allocated``: ``recvbuf`` was made
    for this call, so only its shape is remembered. ``api._bind`` and the reproducible vector
    sums' words end here."""
    call = prepare("allreduce", comm, check, lambda comm: allreduce_call(
        sendbuf, recvbuf, op, comm, algorithm, topology, params), timeout=timeout,
        checks_itself=checks_itself)
    if call.recv.size == 0:
        return call.recv
    # a result made here is remembered by its shape only: the cache holds no caller's arrays
    key = None if allocated else call_key(slot, comm, sendbuf, op, algorithm, topology, params)
    cache = key is not None and cacheable(sendbuf, recvbuf, call)
    return one_shot(comm_state(comm), call, key, (comm, sendbuf, recvbuf, op, topology), cache,
                    timeout, allocated=allocated)


def one_shot(state: CommState, call: Call, key: tuple, objects: tuple, cache: bool,
             timeout: float | None, allocated: bool = False) -> np.ndarray:
    """Run a checked one-shot allreduce, through a cached plan when ``cache``.

    A call with plain arrays is also remembered by its shape (:class:`Shape`), and so is one
    whose result the caller left to mpiallreduce (``allocated``), which is never cached itself.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    shape = None
    if cache:
        comm, sendbuf, recvbuf, op, topology = objects
        shape = shape_key(comm, sendbuf, recvbuf, op, call.algorithm, topology, call.params)
        try:
            hash(shape)
        except TypeError:  # a parameter value that cannot be hashed: no memory of it
            shape = None
    if cache and state.calls.fits(arrays_bytes(call), shape):
        plan = build(call, state, explicit=False, persistent=True, timeout=None, deadline=deadline)
        _remember_shape(state, call, objects, plan, shape)
        if not state.calls.put(key, CallEntry(call, plan, state, objects)):
            # its scratch tipped it over the cache's bytes: run it this once, and let calls
            # of this shape skip it (built per call, its scratch fresh each time, rabenseifner
            # in place at 64 MiB runs an order of magnitude slower than out of place; a
            # second plan built here as well would double an uncached call's cost)
            state.calls.refuse(shape)
            try:
                return plan.run(timeout)
            finally:
                plan.free()
        return plan.run(timeout)
    plan = build(call, state, explicit=False, persistent=False, timeout=None, deadline=deadline,
                 borrow_scratch=True)
    if allocated:
        _remember_shape(state, call, objects, plan)
    try:
        return plan.run(timeout)
    finally:
        plan.free()


def arrays_bytes(call: Call) -> int:
    """The bytes of a call's arrays, which a cache entry keeps alive (:class:`CallEntry`)."""
    return call.recv.nbytes + (0 if call.send is None else call.send.nbytes)


def _remember_shape(state: CommState, call: Call, objects: tuple, plan, key=None) -> None:
    """Keep the call's shape where a call like it can run through one: native in one piece, or a
    schedule of at most :data:`STAGE_BYTES` (staged). ``key``: its :func:`shape_key`, where the
    caller has it."""
    comm, sendbuf, recvbuf, op, topology = objects
    native = isinstance(plan, NativePlan)
    # traced, a native call is staged as a schedule's is: its staged plan, bound traced, records
    # its runs (the bare MPI call a plain native shape makes would record nothing)
    staged = not native or plan.traced
    if (native and len(plan.pieces) == 1 and not plan.traced) \
            or (staged and call.recv.nbytes <= STAGE_BYTES):
        if key is None:
            key = shape_key(comm, sendbuf, recvbuf, op, call.algorithm, topology, call.params)
        known = SHAPES.get(key)
        if known is not None and known.schedule == staged and known.fused == fused(plan):
            return  # (the same call: keep the staged plan it may have built)
        state.calls.put_shape(key, Shape(call, state, (comm, op, topology, recvbuf.dtype),
                                         schedule=staged,
                                         fused=fused(plan)))


if _form.compiled is not None:  # the compiled twin of cached_call (same results, same errors)
    _form.compiled.install(LAST, CALLS, call_key, plain_timeout, SHAPES, STAGE_BYTES,
                           (ALLREDUCE, IALLREDUCE))
    cached_call = _form.compiled.cached_call  # noqa: F811
