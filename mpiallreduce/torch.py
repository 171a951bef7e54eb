"""PyTorch data parallelism on mpiallreduce: DDP communication hooks, and torch.distributed from MPI.

    import mpiallreduce as mar
    mar.torch.init_process_group()                      # Gloo, set up from MPI.COMM_WORLD
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = mar.torch.State()                           # collective: every rank makes one
    model.register_comm_hook(state, mar.torch.allreduce_hook)   # or bf16/fp16/topk_hook

Only ``import mpiallreduce.torch`` (or ``mar.torch``) imports torch; the rest of the package
never does.

**How a bucket is reduced.** DDP calls the hook from its backward pass as each gradient
bucket fills. The hook hands the bucket to the state's communication thread and returns a
``torch.futures.Future`` at once, so backward goes on while the bucket is reduced (DDP's
overlap, as Gloo's own worker threads give it). The thread reduces buckets in the order the
hooks ran, the same order on every rank (DDP's), each through a persistent plan bound once per
bucket to the bucket's own memory (zero-copy: a NumPy view of the CPU tensor, ``auto`` picking
the algorithm: ``shm`` on one node, schedules across nodes), started with
:func:`mpiallreduce.start`; buckets whose plans run schedules overlap each other, then each
future completes as its request does. Without ``MPI_THREAD_MULTIPLE`` there is no thread: the
hook reduces the bucket itself and returns a completed future.

**Semantics** are PyTorch's own hooks' (``torch.distributed.algorithms.ddp_comm_hooks``):
:func:`allreduce_hook` divides the bucket by the number of ranks, then sums (the bits of DDP
with Gloo wherever the sum's order is the same, e.g. on two ranks; where the number of ranks
is a power of two it divides the sum instead, the same bits but for overflowing partial sums
and values subnormal once divided, see ``_Reduction``); :func:`fp16_compress_hook`
and :func:`bf16_compress_hook` cast the bucket to the 16-bit type, divide, sum and cast back.
16-bit payloads (those hooks, and float16/bfloat16 models) travel as 16-bit words reduced by a
user op that adds in float32 and rounds each partial sum to the 16-bit type, as Gloo's 16-bit
sums do (:mod:`.compression`). :func:`topk_hook` sends each bucket's top-k entries with error
feedback (:class:`mpiallreduce.TopK`).

**Failures.** A reduction that fails on a rank (mismatched buckets, a timeout, anything raised)
completes that bucket's future with the exception; with ``State(abort_on_error=True)`` (the
default) the thread also prints the error and calls ``MPI.COMM_WORLD.Abort``, so the ranks
waiting for this one end with the job instead of waiting forever (PyTorch's NCCL backend tears
the process down alike). Run under ``python -m mpi4py`` so that an exception raised elsewhere
on one rank ends the job too.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import threading

import torch
import torch.distributed as dist
from mpi4py import MPI

from . import compression as codecs
from ._checks import view
from .api import plan as _plan
from .compression import TopK
from .nonblocking import start
from .ops import AVG

__all__ = ["Bucket", "State", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook",
           "init_process_group", "topk_hook"]

#: the 16-bit float types and the codec that reduces their words (float32 adds)
_WORDS = {torch.float16: codecs.FP16, torch.bfloat16: codecs.BF16}


class Bucket:
    """A stand-in for DDP's ``GradBucket`` (which Python cannot construct), to call a hook
    outside DDP, on a flat tensor of one's own: the two things the hooks (PyTorch's own too)
    read of a bucket, its index and its flat buffer. ``hook(state, Bucket(0, t)).wait()``."""

    def __init__(self, index: int, buffer: torch.Tensor):
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


def init_process_group(comm=None, backend: str = "gloo", timeout: float | None = None) -> None:
    """Set up ``torch.distributed`` (Gloo) over the ranks of ``comm``; nothing to export.

    Rank 0 opens torch's key-value store (a ``TCPStore`` on a port the system picks, so two
    jobs on one node never collide) and broadcasts its address and port over MPI; every rank
    then joins with its MPI rank and size. The address is 127.0.0.1 when every rank shares
    rank 0's node, else ``MASTER_ADDR`` if set, else rank 0's host name's address.

    Args:
        comm: the MPI communicator (default ``MPI.COMM_WORLD``); torch's default group gets its
            ranks, in its rank order. Collective.
        backend: torch's backend (``"gloo"``: DDP needs one for its own set-up broadcasts).
        timeout: seconds torch's collectives wait (default: torch's).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; call "
                           "mar.torch.init_process_group once, before DDP")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == size
    node.Free()
    wait = datetime.timedelta(seconds=300 if timeout is None else timeout)
    store, failure, address = None, None, None
    if rank == 0:
        host = "127.0.0.1" if one_node else os.environ.get(
            "MASTER_ADDR", socket.gethostbyname(socket.gethostname()))
        try:
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=wait,
                                  wait_for_workers=False)
            address = (host, store.port)
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            failure = f"rank 0 could not open torch's TCPStore on {host}: {exc}"
    address, failure = comm.bcast((address, failure), root=0)
    if failure is not None:
        raise RuntimeError(failure)
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, is_master=False, timeout=wait)
    kwargs = {} if timeout is None else {"timeout": wait}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)


class State:
    """What the hooks keep between steps: the communicator, one plan per bucket, the thread.

    Making one is collective (it duplicates ``comm``: the hooks' messages never meet the
    caller's). Pass the same arguments on every rank.

    Args:
        comm: MPI communicator of DDP's ranks, in the same order (default ``MPI.COMM_WORLD``).
        algorithm: any allreduce algorithm (``"auto"``: ``shm`` on one node).
        timeout: seconds a bucket's reduction may wait for the other ranks (default: forever),
            then :class:`mpiallreduce.CollectiveTimeout`.
        topk: the :class:`mpiallreduce.TopK` of :func:`topk_hook` (default ``TopK(0.01)``).
        abort_on_error: on a failed reduction, print it and ``MPI.COMM_WORLD.Abort(1)`` (the
            module docstring, "Failures"); ``False`` only completes the future with the error.
    """

    def __init__(self, comm=None, algorithm: str = "auto", timeout: float | None = None,
                 topk: TopK | None = None, abort_on_error: bool = True):
        self.comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self.size = self.comm.Get_size()
        self.algorithm, self.timeout = algorithm, timeout
        self.topk = TopK(0.01) if topk is None else topk
        self.abort_on_error = abort_on_error
        self.error: BaseException | None = None  # the first failure; later buckets get it too
        self._reductions: dict = {}  # (hook, bucket index) -> _Reduction
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def submit(self, kind: str, bucket) -> torch.futures.Future:
        """Queue ``bucket``'s reduction (``kind``: which hook); return its future."""
        future = torch.futures.Future()
        item = (kind, bucket.index(), bucket.buffer(), future)
        if not self._threaded:
            self._finish(self._start(item))
            return future
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mpiallreduce-ddp",
                                            daemon=True)
            self._thread.start()
        self._queue.put(item)
        return future

    # -- the communication thread ----------------------------------------------------------------

    def _loop(self) -> None:
        """Start queued buckets in order; complete the oldest when nothing new is queued."""
        pending: list = []
        while True:
            try:
                item = self._queue.get(block=not pending)
            except queue.Empty:
                self._finish(pending.pop(0))
                continue
            if item is None:
                return
            pending.append(self._start(item))

    def _start(self, item):
        """Bind (first time) and start one bucket's reduction: (future, reduction, request)."""
        kind, index, buffer, future = item
        if self.error is not None:
            return future, None, self.error
        try:
            reduction = self._reductions.get((kind, index))
            if reduction is None or not reduction.fits(buffer):
                if reduction is not None:  # DDP rebuilt its buckets: on every rank alike
                    reduction.free()
                reduction = self._reductions[kind, index] = _KINDS[kind](self, index, buffer)
            return future, reduction, reduction.start(buffer)
        except Exception as exc:  # noqa: BLE001 - reported through the future
            return future, None, self._fail(exc, index)

    def _finish(self, started) -> None:
        future, reduction, request = started
        if reduction is None:  # failed at its start
            future.set_exception(request)
            return
        try:
            future.set_result(reduction.finish(request))
        except Exception as exc:  # noqa: BLE001 - reported through the future
            future.set_exception(self._fail(exc, reduction.index))

    def _fail(self, exc: BaseException, index: int) -> BaseException:
        if self.error is None:
            self.error = exc
        if self.abort_on_error:
            print(f"mpiallreduce.torch: rank {MPI.COMM_WORLD.Get_rank()}: the reduction of "
                  f"gradient bucket {index} failed: {type(exc).__name__}: {exc}; aborting the "
                  f"job so that no rank waits for this one forever", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)
        return exc

    def free(self) -> None:
        """Stop the thread, free the plans and the communicator (collective)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for reduction in self._reductions.values():
            reduction.free()
        self._reductions.clear()
        self.comm.Free()


# -- what each hook does with a bucket ---------------------------------------------------------------

class _Reduction:
    """A bucket's buffer, the payload that travels and the plan bound to it.

    ``wire`` None: the payload is the buffer itself, reduced in place. Otherwise a tensor of
    the wire dtype kept for the bucket: the buffer is cast into it and back. 16-bit payloads
    are reduced as their words (``uint16``) with the codec's float32-adding op.

    PyTorch's hooks divide by p, then sum. Where p is a power of two, the plan divides as it
    reduces instead (``mar.AVG``: shm divides each chunk of the sum while it is in the caches),
    saving a pass over the bucket. The bits are the same (scaling by a power of two is exact)
    unless a partial sum overflows where its p-th would not, or a value is subnormal once
    divided (below p times the smallest normal number: 2^-126 p in float32).
    """

    wire: torch.dtype | None = None

    def __init__(self, state: State, index: int, buffer: torch.Tensor):
        self.state, self.index, self.buffer = state, index, buffer
        self.key = (buffer.data_ptr(), buffer.numel(), buffer.dtype)
        wire = self.wire if self.wire is not None else buffer.dtype
        self.payload = buffer if wire == buffer.dtype else torch.empty(buffer.numel(), dtype=wire)
        codec = _WORDS.get(wire)
        words = self.payload.view(torch.uint16) if codec is not None else self.payload
        p = state.size
        self.folded = codec is None and p & (p - 1) == 0 \
            and (buffer.is_floating_point() or buffer.is_complex())
        op = AVG if self.folded else MPI.SUM if codec is None else codec.op
        self.plan = _plan(MPI.IN_PLACE, view(words.detach(), "bucket"), op=op, comm=state.comm,
                          algorithm=state.algorithm, timeout=state.timeout)

    def fits(self, buffer: torch.Tensor) -> bool:
        return (buffer.data_ptr(), buffer.numel(), buffer.dtype) == self.key

    def start(self, buffer: torch.Tensor):
        if self.payload is not self.buffer:
            self.payload.copy_(self.buffer)
        if not self.folded:
            self.payload.div_(self.state.size)  # as PyTorch's hooks: divide, then sum
        return start(self.plan, self.state.timeout)

    def finish(self, request) -> torch.Tensor:
        request.wait()
        if self.payload is not self.buffer:
            self.buffer.copy_(self.payload)
        return self.buffer

    def free(self) -> None:
        self.plan.free()


class _FP16(_Reduction):
    wire = torch.float16


class _BF16(_Reduction):
    wire = torch.bfloat16


class _TopK:
    """Top-k of the bucket with error feedback (one residual per bucket), then the average.

    Nothing is bound to the bucket's memory, so a bucket of the same size and dtype in other
    memory keeps its residual."""

    def __init__(self, state: State, index: int, buffer: torch.Tensor):
        self.state, self.index = state, index
        self.key = (buffer.numel(), buffer.dtype)
        codecs.check_float(view(buffer.detach(), "bucket"), f"gradient bucket {index}")
        state.topk.residuals.pop(index, None)  # a rebuilt bucket holds other gradients
        k = state.topk.k(buffer.numel())
        self.values = view(buffer.detach(), "bucket")[:k].copy()
        self.indices = self.values.astype("int64")

    def fits(self, buffer: torch.Tensor) -> bool:
        return (buffer.numel(), buffer.dtype) == self.key

    def start(self, buffer: torch.Tensor):
        # no non-blocking form: the two allgathers run here, in the communication thread
        flat = view(buffer.detach(), "bucket")
        self.state.topk.select(self.index, flat, self.values, self.indices)
        codecs.sparse_sum(self.values, self.indices, flat, self.state.comm, self.state.algorithm)
        flat /= self.state.size
        return buffer

    def finish(self, buffer) -> torch.Tensor:
        return buffer

    def free(self) -> None:
        self.state.topk.residuals.pop(self.index, None)


_KINDS = {"allreduce": _Reduction, "fp16": _FP16, "bf16": _BF16, "topk": _TopK}


def _hook(kind: str):
    def hook(state, bucket):
        if not isinstance(state, State):
            raise TypeError(f"the hook's state must be a mpiallreduce.torch.State (made on every "
                            f"rank: model.register_comm_hook(mar.torch.State(), hook)), got "
                            f"{type(state).__name__}")
        return state.submit(kind, bucket)
    # DDP's register_comm_hook checks the return annotation (an object, not this module's text)
    hook.__annotations__ = {"return": torch.futures.Future[torch.Tensor]}
    return hook


allreduce_hook = _hook("allreduce")
allreduce_hook.__doc__ = """Average the bucket across ranks (divide, then sum), as DDP with Gloo."""
fp16_compress_hook = _hook("fp16")
fp16_compress_hook.__doc__ = """Average the bucket as float16 (cast, divide, sum, cast back)."""
bf16_compress_hook = _hook("bf16")
bf16_compress_hook.__doc__ = """Average the bucket as bfloat16 (cast, divide, sum, cast back)."""
topk_hook = _hook("topk")
topk_hook.__doc__ = """Average the bucket's top-k entries, error feedback kept per bucket
(``State(topk=mar.TopK(ratio))``; float32/float64 buckets)."""
# DDP refuses a hook *named* bf16_compress_hook without CUDA and NCCL (its own hook needs
# them): the functions' names say whose they are
for _name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "topk_hook"):
    globals()[_name].__qualname__ = _name
    globals()[_name].__name__ = f"mpiallreduce_{_name}"
