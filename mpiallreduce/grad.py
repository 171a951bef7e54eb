"""Gradient synchronisation for data-parallel training: buckets, compression, sharding, async.

- :class:`GradSync` averages (or sums) a list of gradient arrays across ranks. It packs them, in
  reverse registration order (the order backpropagation produces them), into flat buckets of at
  most ``bucket_bytes`` (25 MiB by default, as PyTorch DDP) and one dtype each, binds one
  persistent plan per bucket, starts a bucket's reduction (:func:`mpiallreduce.start`, in the
  progress thread) as soon as all its arrays are marked :meth:`~GradSync.ready`, and unpacks the
  results into the arrays on :meth:`~GradSync.wait` (an array of ``solo_bytes`` or more is a
  bucket of its own, reduced in its own memory; on one node the first steps time that against
  packing it, and keep the faster: ``packing``). Buckets start in bucket order on every
  rank (a complete bucket waits for the ones before it), which the ordering rule needs. Where a
  bucket's plan runs ``shm`` (every rank on one node), its flat buffer is a shared array
  (:func:`mpiallreduce.shared_empty`), so the reduction reads the peers' buckets in place: no
  copy into or out of the transport (:meth:`~GradSync.free` releases them).
  ``compression="fp16"``/``"bf16"`` sends 16-bit words reduced with float32 combines,
  ``compression=TopK(ratio)`` sends the top-k entries with error feedback
  (:mod:`.compression`, with the error bounds).
- :class:`ShardedSGD` is ZeRO stage 1: reduce-scatter the gradients, update this rank's shard
  of the parameters and of the optimizer state, allgather the parameters.
- :class:`DelayedSync` is the asynchronous mode: the averaged gradient of step t is applied at
  step t + 1, so its allreduce runs while step t + 1 computes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from . import api, collectives
from . import compression as codecs
from ._checks import view
from .compression import TopK
from .nonblocking import start
from .ops import AVG
from .partition import block
from .shm import shared_empty

#: default bucket cap in bytes (PyTorch DDP's ``bucket_cap_mb=25``).
BUCKET_BYTES = 25 << 20
#: an uncompressed gradient of at least this many bytes is a bucket of its own, reduced in place
#: in the array itself. Packing saves one call's overhead (microseconds, tens across nodes) but
#: copies the array in and out; at 1 MiB those copies move 4 MiB through memory, hundreds of
#: microseconds, far more than the call they save. On one node shm reduces a private array a
#: chunk at a time (a handshake between the ranks per chunk), a shared bucket in one step: which
#: costs less there changed from job to job, so ``packing="auto"`` times both.
SOLO_BYTES = 1 << 20
#: steps ``overlap="auto"`` times in each mode before it keeps the faster one.
PROBE_STEPS = 5


@dataclass
class _Bucket:
    """Arrays (indices into the synchroniser's list) packed end to end in one flat buffer."""

    members: list  # indices, in packing order (reverse registration order)
    offsets: list  # start of each member in ``flat``
    flat: np.ndarray
    words: np.ndarray | None = None  # 16-bit payload (cast compression)
    values: np.ndarray | None = None  # top-k: this rank's selected values and their indices
    indices: np.ndarray | None = None
    plan: object = None
    request: object = None
    waiting: int = 0  # members not yet marked ready this step
    solo: bool = False  # ``flat`` is the one member's own memory: nothing to copy
    viewed: bool = False  # the members are views of ``flat`` (``views=True``): nothing to copy
    shared: bool = False  # ``flat`` is a shared array (the plan runs shm): freed with the sync


def _views(bucket: _Bucket, arrays: list):
    for index, offset in zip(bucket.members, bucket.offsets):
        yield arrays[index], bucket.flat[offset:offset + arrays[index].size]


class GradSync:
    """Average (or sum) gradient arrays across ranks in buckets, overlapped with backprop.

    Args:
        arrays: the gradient arrays (C-contiguous, any shapes and dtypes MPI can reduce). They
            are read when marked ready and overwritten with the result by :meth:`wait`.
        comm: the communicator (default ``MPI.COMM_WORLD``); building is collective.
        op: ``mpiallreduce.AVG`` (default) or ``MPI.SUM``.
        algorithm: any allreduce algorithm (cast compression composes with all of them);
            top-k's allgathers use it where it names an allgather algorithm, else ``auto``.
        bucket_bytes: cap on a bucket's bytes (an array larger than the cap gets its own bucket).
        compression: ``None``, ``"fp16"``, ``"bf16"`` or a :class:`~.compression.TopK`.
        solo_bytes: without compression, an array of at least this many bytes is a bucket of
            its own reduced in place in the array (no copy in or out; default
            :data:`SOLO_BYTES`; ``None``: none is). A solo array holds the result as soon as
            its bucket completes, which may be before :meth:`wait`: do not write it between
            ``ready`` and ``wait``.
        packing: ``False`` keeps the arrays of ``solo_bytes`` solo; ``True`` packs every array
            into buckets; ``"auto"`` (default) keeps them solo, except where the plans run
            ``shm`` (every rank on one node): there shm reduces a shared bucket in one step
            but a private array a chunk at a time, with a handshake per chunk, and which costs
            less, the copies into the buckets and out or the handshakes, changed from one job
            to the next on the same machine, as did whether MPI's own in-place reduction of
            each array (the loop GradSync replaces) beat both (docs/tutorials/training.md). So there it
            times the first :data:`PROBE_STEPS` steps of each way, ``"packed"``, ``"solo"``
            and (with ``algorithm="auto"``) ``"native"``: the arrays as ``"solo"`` with
            ``native`` plans (with each overlap mode, where ``overlap`` is ``"auto"`` too),
            keeps the fastest (``way`` says which), agreed across ranks as the overlap mode
            is, and frees the other ways' buckets and plans.
        overlap: ``True`` starts a bucket's reduction as soon as it is ready (it progresses
            while backprop goes on: worth it with a spare core per rank or a network card doing
            the transfers); ``False`` starts every bucket at :meth:`wait` (nothing competes with
            backprop for the cores); ``"auto"`` (default) times :data:`PROBE_STEPS` steps each
            way, from the first ``ready`` to the end of ``wait``, and keeps the faster
            (``overlap_mode`` says which). The choice is agreed across ranks: the mode whose
            slowest rank's median step is shorter (one small allreduce, once), so every rank
            keeps the same mode and starts its buckets at the same point relative to other
            collectives. Buckets start in bucket order on every rank. Do not write a gradient
            between ``ready`` and ``wait``.
        views: ``True`` makes ``arrays`` views of the buckets after construction (each holding
            its array's values, as NumPy arrays): write the gradients there (``p.grad =
            torch.from_numpy(sync.arrays[i])``) and nothing is copied into the buckets or out,
            as with DDP's ``gradient_as_bucket_view``. The views live until :meth:`free`;
            arrays that are buckets of their own (solo) stay the caller's. With ``packing="auto"``
            on one node every array is packed (a view copies nothing: nothing to time).

    Results equal a per-array ``allreduce`` of each array element for element (the same
    additions; bit for bit where the algorithm's order of additions does not depend on an
    element's position, as for tree, recursive_doubling and exactly representable sums).
    """

    def __init__(self, arrays, comm=None, op=AVG, algorithm="auto", bucket_bytes=BUCKET_BYTES,
                 compression=None, solo_bytes=SOLO_BYTES, overlap="auto", views=False,
                 packing="auto"):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        # views of the caller's memory (torch tensors too), never copies: results land there
        self.arrays = [view(a, f"gradient {i}") for i, a in enumerate(arrays)]
        for i, array in enumerate(self.arrays):
            if not array.flags.c_contiguous or not array.flags.writeable:
                raise ValueError(f"gradient {i} must be a writable C-contiguous array")
        if op is not AVG and op is not MPI.SUM:
            raise ValueError("GradSync op must be mpiallreduce.AVG or MPI.SUM")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if solo_bytes is not None and (not isinstance(solo_bytes, int) or solo_bytes <= 0):
            raise ValueError(f"solo_bytes must be a positive int or None, got {solo_bytes!r}")
        for name, mode in (("overlap", overlap), ("packing", packing)):
            if mode is not True and mode is not False and mode != "auto":
                raise ValueError(f"{name} must be True, False or 'auto', got {mode!r}")
        self.overlap = overlap
        self._step_start: float | None = None
        self.op, self.algorithm = op, algorithm
        self.codec = None
        self.topk = compression if isinstance(compression, TopK) else None
        if compression is not None and self.topk is None:
            self.codec = codecs.cast(compression)
        if compression is not None:
            for i, array in enumerate(self.arrays):
                codecs.check_float(array, f"gradient {i}")
        if compression is not None or packing is True:
            solo_bytes = None  # a compressed bucket encodes into buffers of its own anyway
        #: each way of reducing the arrays this sync holds (see ``packing``), as (buckets,
        #: bucket of each array); one once chosen
        self._forms = {way: (buckets, {i: b for b, bucket in enumerate(buckets)
                                       for i in bucket.members})
                       for way, buckets in self._build(bucket_bytes, solo_bytes,
                                                       packing, views).items()}
        #: this step's way: "packed", "solo" or "native" (see ``packing``)
        self.way = next(iter(self._forms))
        #: whether this step starts buckets as they become ready (see ``overlap``)
        self.overlap_mode = overlap is not False
        overlaps = (True, False) if overlap == "auto" else (overlap,)
        #: seconds per step of each (way, overlap) still to be timed: empty once chosen
        self._timings = {(way, start): [] for way in self._forms for start in overlaps}
        if len(self._timings) == 1:
            self._timings.clear()
        #: once chosen: each way's median step in seconds (its slowest rank's), as agreed
        self.timed: dict = {}
        if views:
            for bucket in self.buckets:
                self._view(bucket)
        self._next = 0  # the next bucket to start, in bucket order
        self._marked = [False] * len(self.arrays)
        self._reset()

    # -- building ------------------------------------------------------------------------------

    def _build(self, bucket_bytes: int, solo_bytes, packing, views: bool) -> dict:
        """The buckets of each way to hold: ``{"packed" | "solo" | "native": buckets}``.

        Solo arrays (those of ``solo_bytes``) only where some array is that large. Where they
        are, the first one's plan says whether the plans run shm (agreed, so alike on every
        rank) before any other is bound: then ``packing="auto"`` holds every way to time them
        (``views``: "packed" alone; "native" only under ``algorithm="auto"``),
        ``packing=False`` "solo"; elsewhere "solo" (copies of megabytes cost far more than the
        calls they would save).
        """
        groups = pack(self.arrays, bucket_bytes, solo_bytes)
        probe = next((self._bucket(members, solo_bytes) for members in groups
                      if self._solo(members, solo_bytes)), None)
        if probe is None:  # nothing solo: the one way packs every array
            return {"packed": [self._bucket(members, None) for members in groups]}
        forms = {}
        timed = packing == "auto" and probe.plan.algorithm == "shm"
        if timed:
            forms["packed"] = [self._bucket(members, None)
                               for members in pack(self.arrays, bucket_bytes, None)]
            if views:
                probe.plan.free()
                return forms
        forms["solo"] = [probe if members == probe.members else self._bucket(members, solo_bytes)
                         for members in groups]
        if timed and self.algorithm == "auto":
            forms["native"] = [self._bucket(members, solo_bytes, "native") for members in groups]
        return forms

    @property
    def probing(self) -> bool:
        """Whether the first steps are still timing ways (``overlap``/``packing`` "auto")."""
        return bool(self._timings)

    @property
    def buckets(self) -> list:
        """This step's buckets (of its way)."""
        return self._forms[self.way][0]

    def _solo(self, members: list, solo_bytes) -> bool:
        """Whether a bucket of ``members`` is the one array's own memory, reduced in place."""
        return len(members) == 1 and self.codec is None and self.topk is None \
            and solo_bytes is not None and self.arrays[members[0]].nbytes >= solo_bytes

    def _bucket(self, members: list, solo_bytes, algorithm: str | None = None) -> _Bucket:
        offsets, total = [], 0
        for index in members:
            offsets.append(total)
            total += self.arrays[index].size
        first = self.arrays[members[0]]
        solo = self._solo(members, solo_bytes)
        algorithm = algorithm or self.algorithm
        flat = first.reshape(-1) if solo else np.empty(total, first.dtype)
        bucket = _Bucket(members, offsets, flat, solo=solo)
        if self.topk is not None:
            k = sum(self.topk.k(self.arrays[i].size) for i in members)
            bucket.values = np.empty(k, bucket.flat.dtype)
            bucket.indices = np.empty(k, np.int64)
        elif self.codec is not None:
            bucket.words = np.empty(total, np.uint16)
            bucket.plan = api.plan(MPI.IN_PLACE, bucket.words, op=self.codec.op, comm=self.comm,
                                   algorithm=algorithm)
        else:
            bucket.plan = api.plan(MPI.IN_PLACE, bucket.flat, op=self.op, comm=self.comm,
                                   algorithm=algorithm)
            if bucket.plan.algorithm == "shm" and not solo:
                # one node: bind again on a bucket in the node's shared memory, which the
                # ranks reduce straight from each other's buckets (the choice is agreed, so
                # every rank makes the collective shared_empty here)
                bucket.plan.free()
                bucket.flat = shared_empty(total, first.dtype, comm=self.comm)
                bucket.shared = True
                bucket.plan = api.plan(MPI.IN_PLACE, bucket.flat, op=self.op, comm=self.comm,
                                       algorithm=algorithm)
        return bucket

    def _view(self, bucket: _Bucket) -> None:
        """Make the bucket's members views of its flat buffer, holding their values."""
        if bucket.solo:
            return
        for index, (array, part) in zip(bucket.members, list(_views(bucket, self.arrays))):
            np.copyto(part, array.reshape(-1))
            self.arrays[index] = np.asarray(part).reshape(array.shape)
        bucket.viewed = True

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank contributes per step (before the algorithm's traffic factor)."""
        if self.topk is not None:
            return sum(b.values.nbytes + b.indices.nbytes for b in self.buckets)
        if self.codec is not None:
            return sum(b.words.nbytes for b in self.buckets)
        return sum(b.flat.nbytes for b in self.buckets)

    # -- a step ----------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._step_start = None
        self._next = 0
        self._marked = [False] * len(self.arrays)
        for buckets, _ in self._forms.values():
            for bucket in buckets:
                bucket.waiting = len(bucket.members)
                bucket.request = None

    def ready(self, index: int) -> None:
        """Mark gradient ``index`` final for this step; start every bucket that can start."""
        if self._marked[index]:
            raise ValueError(f"gradient {index} is already marked ready in this step")
        if self._step_start is None:
            self._step_start = time.perf_counter()
        self._marked[index] = True
        self.buckets[self._forms[self.way][1][index]].waiting -= 1
        if self.overlap_mode:
            self._start_ready()

    def _start_ready(self) -> None:
        """Start every bucket whose gradients are all ready, in bucket order."""
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        if not bucket.solo and not bucket.viewed:
            for array, view in _views(bucket, self.arrays):
                np.copyto(view, array.reshape(-1))
        nranks = self.comm.Get_size()
        if self.topk is not None:
            # top-k has no non-blocking form here: its two allgathers run now, in this thread
            position = 0
            for index, offset in zip(bucket.members, bucket.offsets):
                size = self.arrays[index].size
                k = self.topk.k(size)
                self.topk.select(index, bucket.flat[offset:offset + size],
                                 bucket.values[position:position + k],
                                 bucket.indices[position:position + k], offset)
                position += k
            codecs.sparse_sum(bucket.values, bucket.indices, bucket.flat, self.comm,
                                   self.algorithm)
            if self.op is AVG:
                np.divide(bucket.flat, nranks, out=bucket.flat)
            return
        if self.codec is not None:
            codecs.encode_for_sum(self.codec, bucket.flat, bucket.words, nranks,
                                       self.op is AVG)
        bucket.request = start(bucket.plan)

    def wait(self) -> list:
        """Wait for every bucket, unpack the results into the arrays, and return the arrays."""
        missing = [i for i, marked in enumerate(self._marked) if not marked]
        if missing:
            raise ValueError(f"gradients {missing} were not marked ready in this step")
        try:
            self._start_ready()  # overlap off: every bucket starts now
            for bucket in self.buckets:
                if bucket.request is not None:
                    bucket.request.wait()
                if self.codec is not None:
                    np.copyto(bucket.flat, codecs.decoded(self.codec.decode, bucket.words))
                if not bucket.solo and not bucket.viewed:
                    for array, view in _views(bucket, self.arrays):
                        np.copyto(array.reshape(-1), view)
            elapsed = time.perf_counter() - self._step_start
        finally:
            self._reset()
        self._choose_mode(elapsed)
        return self.arrays

    def _choose_mode(self, elapsed: float) -> None:
        """Record this step's time while ways are probed (``overlap`` or ``packing`` "auto");
        probe each (way, overlap mode) in turn, then keep the fastest.

        The overlap mode decides whether buckets start in ``ready`` or in ``wait``, and the
        way which plans run, so both order calls against every other collective on
        the communicator (the other sync of a :class:`DelayedSync`, the caller's own): every
        rank must hold the same ones. The probes go round by step count, alike everywhere; the
        final choice compares each way's slowest rank (a step lasts as long as its slowest
        rank's), agreed with one MAX allreduce of the medians, once; then the other ways'
        buckets are freed (collective: every rank is in this ``wait``).
        """
        timings = self._timings
        if not timings:
            return  # one way only, or the choice is made
        timings[self.way, self.overlap_mode].append(elapsed)
        least = min(timings, key=lambda way: len(timings[way]))  # the first of the fewest
        if len(timings[least]) < PROBE_STEPS:
            self.way, self.overlap_mode = least
            return
        ways = list(timings)
        medians = np.array([statistics.median(timings[way]) for way in ways])
        # MPI's own MAX: exact, so every rank compares the same numbers. Called in the same
        # wait() on every rank, after this sync's buckets completed. A bucket of another sync
        # may be in flight: its plan has a tag slot (schedules) or a communicator (native) of
        # its own, or ran whole at its start (shm), so this one-shot call cannot match it.
        api.allreduce(MPI.IN_PLACE, medians, op=MPI.MAX, comm=self.comm, algorithm="native",
                      check=False)
        self.way, self.overlap_mode = ways[int(np.argmin(medians))]
        self.timed = dict(zip(ways, medians.tolist()))
        timings.clear()
        for way in [way for way in self._forms if way != self.way]:
            self._free_buckets(self._forms.pop(way)[0])

    def synchronize(self) -> list:
        """Mark every gradient ready (in reverse order, as backprop would) and wait."""
        for index in reversed(range(len(self.arrays))):
            self.ready(index)
        return self.wait()

    def free(self) -> None:
        """Free the plans, then the shared buckets (collective: on every rank together)."""
        for buckets, _ in self._forms.values():
            self._free_buckets(buckets)

    @staticmethod
    def _free_buckets(buckets: list) -> None:
        for bucket in buckets:
            if bucket.plan is not None:
                bucket.plan.free()
        for bucket in buckets:
            if bucket.shared:
                bucket.flat.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()


def pack(arrays: list, bucket_bytes: int, solo_bytes: int | None = None) -> list[list[int]]:
    """Group array indices into buckets: reverse order, one dtype per bucket, at most the cap.

    A bucket closes when the next array has another dtype or would take it past
    ``bucket_bytes``; an array bigger than the cap, or of at least ``solo_bytes``, is a bucket
    of its own.
    """
    buckets: list[list[int]] = []
    nbytes, dtype, alone = 0, None, False
    solo = float("inf") if solo_bytes is None else solo_bytes
    for index in reversed(range(len(arrays))):
        array = arrays[index]
        if not buckets or array.dtype != dtype or nbytes + array.nbytes > bucket_bytes \
                or alone or array.nbytes >= solo:
            buckets.append([])
            nbytes, dtype, alone = 0, array.dtype, array.nbytes >= solo
        buckets[-1].append(index)
        nbytes += array.nbytes
    return buckets


class SGD:
    """Momentum SGD, elementwise: ``v = momentum·v + g; x -= lr·v`` (state: ``v``)."""

    def __init__(self, lr: float, momentum: float = 0.0):
        self.lr, self.momentum = lr, momentum

    def update(self, params: np.ndarray, grads: np.ndarray, velocity: np.ndarray) -> None:
        np.multiply(velocity, self.momentum, out=velocity)
        velocity += grads
        params -= self.lr * velocity


class ShardedSGD:
    """ZeRO stage 1: each rank keeps optimizer state for, and updates, one shard of the params.

    ``step(grads)``: reduce-scatter the flat gradient (SUM, then divided by p for ``AVG``),
    update this rank's block (:func:`mpiallreduce.partition.block`) of the flat parameters with
    its block of the momentum, allgather the parameters, and unpack them into ``params``. The
    result equals an unsharded update with allreduce-averaged gradients (elementwise optimizer,
    same arithmetic), and optimizer memory per rank is 1/p of it.

    Args:
        params: parameter arrays (one floating dtype), updated in place.
        optimizer: an :class:`SGD` (anything with ``update(params, grads, state)``).
        comm: communicator (default ``MPI.COMM_WORLD``).
        op: ``mpiallreduce.AVG`` (default) or ``MPI.SUM``: how gradients combine.
        algorithm: used for the reduce-scatter and allgather where it names one of theirs
            (``ring``, ``native``; ``recursive_halving`` / ``recursive_doubling``), else ``auto``.
    """

    def __init__(self, params, optimizer: SGD, comm=None, algorithm="auto", op=AVG):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        if op is not AVG and op is not MPI.SUM:
            raise ValueError("ShardedSGD op must be mpiallreduce.AVG or MPI.SUM")
        self.average = op is AVG
        self.params = list(params)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(f"ShardedSGD needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.optimizer = optimizer
        self.sizes = [p.size for p in self.params]
        n, nranks, rank = sum(self.sizes), self.comm.Get_size(), self.comm.Get_rank()
        self.flat_params = np.concatenate([p.reshape(-1) for p in self.params])
        self.flat_grads = np.empty_like(self.flat_params)
        self.lo, self.hi = block(n, nranks, rank)
        self.grad_shard = np.empty(self.hi - self.lo, self.flat_params.dtype)
        self.velocity = np.zeros_like(self.grad_shard)  # this rank's shard of the state
        names = api.COLLECTIVE_ALGORITHMS
        self.rs_algorithm = algorithm if algorithm in names["reduce_scatter"] else "auto"
        self.ag_algorithm = algorithm if algorithm in names["allgather"] else "auto"

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank contributes per step: its full gradient, then its parameter shard."""
        return self.flat_grads.nbytes + self.grad_shard.nbytes

    def step(self, grads) -> list:
        np.concatenate([g.reshape(-1) for g in grads], out=self.flat_grads)
        collectives.reduce_scatter(self.flat_grads, self.grad_shard, op=MPI.SUM, comm=self.comm,
                                   algorithm=self.rs_algorithm)
        if self.average:
            np.divide(self.grad_shard, self.comm.Get_size(), out=self.grad_shard)
        shard = self.flat_params[self.lo:self.hi]
        self.optimizer.update(shard, self.grad_shard, self.velocity)
        collectives.allgather(MPI.IN_PLACE, self.flat_params, comm=self.comm,
                              algorithm=self.ag_algorithm)
        offset = 0
        for param, size in zip(self.params, self.sizes):
            np.copyto(param.reshape(-1), self.flat_params[offset:offset + size])
            offset += size
        return self.params


class DelayedSync:
    """Asynchronous mode: ``step(grads)`` starts averaging ``grads`` and returns the average of
    the previous step's gradients (``None`` on the first step); ``flush()`` returns the last.

    Every replica applies the same averaged gradient, one step late, so replicas stay identical
    while the allreduce of step t overlaps the computation of step t + 1. Two
    :class:`GradSync` instances over private copies alternate, so the buffers of the reduction in
    flight are never touched. Arguments as :class:`GradSync`.
    """

    def __init__(self, arrays, comm=None, op=AVG, algorithm="auto", bucket_bytes=BUCKET_BYTES):
        self.syncs = [GradSync([np.array(a, copy=True) for a in arrays], comm, op, algorithm,
                               bucket_bytes) for _ in range(2)]
        self.step_index = 0
        self.in_flight: GradSync | None = None

    @property
    def payload_bytes(self) -> int:
        return self.syncs[0].payload_bytes

    def step(self, grads):
        sync = self.syncs[self.step_index % 2]
        self.step_index += 1
        for copy, grad in zip(sync.arrays, grads):
            np.copyto(copy, grad)
        for index in reversed(range(len(sync.arrays))):
            sync.ready(index)
        previous, self.in_flight = self.in_flight, sync
        return None if previous is None else previous.wait()

    def flush(self):
        """Wait for the reduction in flight (if any) and return its average."""
        previous, self.in_flight = self.in_flight, None
        return None if previous is None else previous.wait()

    def free(self) -> None:
        for sync in self.syncs:
            sync.free()
