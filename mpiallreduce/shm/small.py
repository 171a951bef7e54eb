"""The small regime (up to :func:`.protocol.small_bytes` per rank): every rank copies its
input into its parity slot, publishes, and reduces all p slots itself in rank order (identical
bits everywhere, non-commutative ops exact). One arrival per epoch.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np

from .. import _form
from .node import Node
from .plan import ShmPlan, _single, copy_call
from .protocol import Stalled

#: most ranks of a node whose small-regime runs are compiled (``_compiled.SmallRun`` keeps its
#: pointers in fixed arrays); larger nodes run the Python form's closures
COMPILED_MAX_RANKS = 64


class SmallPlan(ShmPlan):
    """An shm plan of the small regime (see the module)."""

    def _bind(self, source, input_block, input_at, recv_block, recv_at) -> None:
        # (traced: its load and reduce calls hold the run's clock readings)
        self._trace("small")
        self._programs = tuple(self._bind_small(parity, source) for parity in (0, 1))
        self.direct, self._timed = self._bind_direct()
        if _form.compiled is not None and self._node.size <= COMPILED_MAX_RANKS:
            self.direct, self._timed = self._compiled_runs(source)

    def _compiled_runs(self, source: np.ndarray) -> tuple:
        """:meth:`_bind_direct`'s two runs compiled (``_compiled.SmallRun``): the same steps
        with no Python frame on the way to the spin-wait; their slow paths (an earlier epoch
        still running, a peer not there after the spin, differing signatures, ops other than
        float SUM/PROD/AVG) are this plan's own methods and bound calls."""
        node = self._node
        slots = tuple(self._slots(parity) for parity in (0, 1))
        # the exact sum of reproducible calls stays the bound Python reduce, and so do the load
        # and reduce of a plan bound under the stall hook (protocol.STALLS: they hold its
        # stalls, around the compiled publish and wait)
        stalled = isinstance(self._phase, Stalled)
        name = None if self._exact or stalled else self.reducer.name
        # traced (.tracing): the compiled run makes the clock readings the programs hold
        stamps = (self._phase.stamps("run", "arrive", "wait", "reduce", "end")
                  if self.traced and not stalled else None)
        return tuple(_form.compiled.SmallRun(
            node, source, self._result, slots, self._signed, self._peer_digests, self._programs,
            self._arrive, self._mismatch, self._label, name, self._average, timed, stamps)
            for timed in (False, True))

    def _bind_small(self, parity: int, source: np.ndarray) -> tuple:
        """(load, reduce) of the small regime for one parity: single calls. Bound while
        tracing, they hold every clock reading of the run too (the closures of
        :meth:`_bind_direct`, which the call cache runs, have no other place for them)."""
        slots = self._slots(parity)
        rank = self._node.rank
        phase = self._phase
        # (copy_call: memcpy, but from 4 KiB NumPy's byte loop where the slot lies 1-63 bytes
        # past the input modulo 4096, where memcpy's rep movsb runs several times slower:
        # slots start on a page, so an input ending just before one)
        load = [*phase("run", None, ()),
                *phase("arrive", None, [copy_call(slots[rank], source)]),
                *phase("wait", None, ())]
        scalar = self._scalar(slots)
        reduce = [scalar] if scalar else self._reduce_into(self._result, slots)
        if self._average and not scalar:
            reduce.append(partial(np.divide, self._result, self._nranks, self._result))
        reduce = [*phase("reduce", None, reduce), *phase("end", None, ())]
        return _single(load), _single(reduce)

    def _bind_direct(self):
        """:meth:`direct` of the small regime as closures over the bound state: the
        :meth:`_run` of a run without timeout and of one with, written out with locals
        instead of attribute reads (each shows at 8 bytes). Returns (untimed, timed); the
        timed one takes the run's timeout (checked by :meth:`run`)."""
        node = self._node
        header, peers, sync, written, areas = (node.header, node.peer_headers, node.sync,
                                               node.written, node.areas)
        arrive, mismatch, label = self._arrive, self._mismatch, self._label
        monotonic = time.monotonic

        def make(timed: bool):
            words, mine = self._signed[timed]
            programs = tuple((load, reduce, digests, parity, node.signatures[parity])
                             for (load, reduce), digests, parity
                             in zip(self._programs, self._peer_digests, (0, 1)))

            def direct(timeout=None) -> None:
                # (deadline_of, written out: a call less at 8 bytes)
                deadline = None if timeout is None else monotonic() + timeout
                epoch = node.epoch + 1
                node.epoch = epoch
                try:
                    if node.finished != epoch - 1:
                        node.turn(epoch, deadline, label)
                    load, reduce, digests, parity, signatures = programs[epoch & 1]
                    load()
                    if written[parity] is not words:
                        lo, hi = areas[parity]
                        header[lo:hi] = words
                        written[parity] = words
                    if sync is not None:
                        sync()
                    header[0] = 2 * epoch
                    target = 2 * epoch - 1
                    for peer in peers:
                        if peer[0] < target:
                            arrive(node, epoch, 2 * epoch, timeout, deadline, 0)
                            break
                    else:
                        if sync is not None:
                            sync()
                        for theirs, word in digests:
                            if theirs[word] != mine:
                                mismatch(signatures, timeout)
                    reduce()
                except BaseException as error:  # a run left in the middle revokes
                    node.give_up(error, label)
                    raise
                finally:
                    node.finished = epoch
            return direct
        return make(False), make(True)

    def _run(self, node: Node, epoch: int, timeout, deadline) -> None:
        parity = epoch & 1
        load, reduce = self._programs[parity]
        load()
        words, mine = self._signed[timeout is not None]
        if node.written[parity] is not words:
            self._sign(node, parity, timeout)
        # _arrive, written out: this path is what an 8-byte call costs
        if node.sync is not None:
            node.sync()
        node.header[0] = 2 * epoch
        target = 2 * epoch - 1
        for peer in node.peer_headers:
            if peer[0] < target:
                self._arrive(node, epoch, 2 * epoch, timeout, deadline, 0)
                break
        else:
            if node.sync is not None:
                node.sync()
            for header, word in self._peer_digests[parity]:
                if header[word] != mine:
                    self._mismatch(node.signatures[parity], timeout)
        reduce()

