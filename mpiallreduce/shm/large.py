"""The large regimes: a message past :func:`.protocol.small_bytes`, each rank reducing one
block (``partition.block``) of it.

- :class:`ChunkedPlan` (a private result): a chunk at a time (:func:`.protocol.chunk_bytes`,
  two chunk buffers per parity slot, so the slots stay in the caches): each rank copies the
  peers' blocks of its chunk in, publishes, reduces its own block across all ranks in rank
  order (its own input read where it is), publishes, and copies the other blocks out;
- :class:`DirectPlan` (a shared-array result, :mod:`.arrays`): inputs are read straight from
  the peers' arrays, and each rank writes its block straight into every rank's result.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..partition import block
from .node import Node
from .plan import ShmPlan, copy_call
from .protocol import STEP_SHIFT, STEP_WORD, chunk_bytes, round_up


class ChunkedPlan(ShmPlan):
    """An shm plan of the large regime on a private result, a chunk at a time."""

    def _bind(self, source, input_block, input_at, recv_block, recv_at) -> None:
        self._trace("chunked", "chunk")
        # each parity's chunk calls are bound at its first run (:meth:`_chunks`): a one-shot
        # call runs one parity only, and binding a parity is costly for a large message
        # (128 chunks at 64 MiB)
        self._programs = [None, None]
        self._binding = (source, input_block, input_at)
        if self.traced:  # the run's ends and its waits are methods: stamped around them
            marks = self._phase
            self._run = marks.around(self._run)
            self._arrive = marks.before("wait", self._arrive, 0)
            self._chunk_wait = marks.before("wait", self._chunk_wait, argument=4)

    def _chunks(self, parity: int) -> tuple:
        """The parity's chunk calls (:meth:`_bind_chunks`), bound once."""
        chunks = self._programs[parity] = self._bind_chunks(parity, *self._binding)
        return chunks

    def _bind_chunks(self, parity: int, source: np.ndarray, input_block, input_at) -> tuple:
        """Calls of the large regime on a private result for one parity, chunk by chunk:
        a tuple of (load, reduce, pull) per chunk.

        The parity's slot holds two chunk buffers; chunk ``c`` goes through buffer ``c % 2``.
        load: the peers' blocks (``partition.block``) of this rank's input of the chunk into
        its buffer (none where the input is a shared array: the peers read it in place);
        reduce: this rank's block of the chunk across every rank's input in rank order (its
        own read where it is) into its buffer, then into the result; pull: the other blocks
        of the chunk out of the peers' buffers.
        Only a chunk's worth of slot memory is touched between waits, so it stays in the
        caches: the message itself is read once and the result written once.
        """
        node, result = self._node, self._result
        rank, p, count, dtype = node.rank, node.size, result.size, result.dtype
        per = max(1, chunk_bytes(result.nbytes) // dtype.itemsize)  # elements per chunk
        stride = round_up(per * dtype.itemsize)
        base = parity * (self._capacity // 2)
        peer_inputs = (input_block.peers(input_at, dtype, count) if input_block is not None
                       else None)
        # every rank's two chunk buffers, as long as their longest chunk (the slot holds no
        # more: a message of under two chunks has a slot of its own size); chunks slice them
        buffers = [[np.frombuffer(segment, dtype=dtype, count=min(per, count - j * per),
                                  offset=base + j * stride) for segment in self._segments]
                   for j in range(1 if count <= per else 2)]
        # the addresses, read once (reading ``ctypes.data`` is slow, and a chunked plan makes
        # thousands of copies): every copy's distance is theirs plus offsets; a chunk's slot q
        # of buffer j lies at slot_at[j][q]
        item = dtype.itemsize
        source_at, result_at = source.ctypes.data, result.ctypes.data
        slot_at = [[buffer.ctypes.data for buffer in pair] for pair in buffers]
        chunks = []
        for c, start in enumerate(range(0, count, per)):
            stop = min(start + per, count)
            size = stop - start
            slots = [buffer[:size] for buffer in buffers[c % 2]]
            lo, hi = block(size, p, rank)
            load = ()
            if peer_inputs is None:
                # the peers' blocks of our input (our own block is read where it is)
                load = tuple(copy_call(slots[rank][a:b], source[start + a:start + b],
                                       slot_at[c % 2][rank] - source_at - start * item)
                             for a, b in ((0, lo), (hi, size)) if b > a)
                operands = [slot[lo:hi] for slot in slots]
                operands[rank] = source[start + lo:start + hi]
            else:
                operands = [array[start + lo:start + hi] for array in peer_inputs]
            load = tuple(self._phase("arrive", c, load))
            reduce, copy = [], []
            if hi > lo:
                # into our buffer first (never an operand, so rank order holds in place too),
                # then into the result
                mine = slots[rank][lo:hi]
                reduce += self._reduce_into(mine, operands)
                if self._average:
                    reduce.append(partial(np.divide, mine, self._nranks, mine))
                copy.append(copy_call(result[start + lo:start + hi], mine,
                                      result_at + start * item - slot_at[c % 2][rank]))
            pull = []
            for q in range(p):
                first, last = block(size, p, q)
                if q != rank and last > first:
                    pull.append(copy_call(result[start + first:start + last],
                                          slots[q][first:last],
                                          result_at + start * item - slot_at[c % 2][q]))
            phase = self._phase
            chunks.append((load, (*phase("reduce", c, reduce), *phase("copy out", c, copy)),
                           tuple(phase("copy out", c, pull))))
        return tuple(chunks)


    def _run(self, node: Node, epoch: int, timeout, deadline) -> None:
        """The chunked large regime (:meth:`_bind_chunks`). The first chunk's input, with the
        signature, publishes the counter ``2e - 1`` (the step that compares signatures); then
        per chunk ``c`` the step word says "reduced c" (``2c + 1``) and "loaded c + 1"
        (``2c + 2``) above ``e << STEP_SHIFT``. Chunk ``c + 1`` reuses the buffer of chunk
        ``c - 1``, free once every peer loaded chunk ``c`` (which it does after pulling
        ``c - 1``); the epoch's first chunk, as every call, takes the parity slot that every
        peer finished reading when it started the previous epoch."""
        parity = epoch & 1
        chunks = self._programs[parity] or self._chunks(parity)
        header, sync = node.header, node.sync
        base = epoch << STEP_SHIFT
        last = len(chunks) - 1
        for call in chunks[0][0]:
            call()
        self._sign(node, parity, timeout)
        self._arrive(node, epoch, 2 * epoch - 1, timeout, deadline, 0)
        for c, (_, reduce, pull) in enumerate(chunks):
            if c:
                self._chunk_wait(node, base + 2 * c, timeout, deadline, c, "load")
            for call in reduce:
                call()
            if sync is not None:
                sync()
            header[STEP_WORD] = base + 2 * c + 1
            if c == last:
                header[0] = 2 * epoch
            self._chunk_wait(node, base + 2 * c + 1, timeout, deadline, c, "reduce")
            for call in pull:
                call()
            if c < last:
                for call in chunks[c + 1][0]:
                    call()
                if sync is not None:
                    sync()
                header[STEP_WORD] = base + 2 * c + 2

    def _chunk_wait(self, node: Node, target: int, timeout, deadline, chunk: int,
                    what: str) -> None:
        """Wait until every peer's step word reaches ``target`` (chunk steps of the large
        regime); a deadline that passes names the missing ranks."""
        for peer in node.peer_steps:
            if peer[0] < target:
                missing = node.wait(target, deadline, (node.peers, node.peer_steps),
                                    self._where())
                if missing is not None:
                    self.fail(f"{self._label} on rank {node.rank}: no answer from rank(s) "
                              f"{', '.join(map(str, missing))} at the {what} of chunk {chunk} "
                              f"within {timeout:g} s (a rank stopped in the middle of this "
                              f"call)")
                return
        if node.sync is not None:
            node.sync()


class DirectPlan(ShmPlan):
    """An shm plan of the large regime on a shared-array result: read and written in place."""

    def _bind(self, source, input_block, input_at, recv_block, recv_at) -> None:
        node, result = self._node, self._result
        if self.reducer.ufunc is None:  # a user op folds into scratch (see _bind_large)
            lo, hi = block(result.size, node.size, node.rank)
            self._scratch = np.empty(hi - lo, dtype=result.dtype)
        self._trace("shared")
        self._programs = tuple(
            self._bind_large(parity, source, input_block, input_at, recv_block, recv_at)
            for parity in (0, 1))
        if self.traced:  # the run's ends and its waits are methods: stamped around them
            marks = self._phase
            self._run = marks.around(self._run)
            self._arrive = marks.before("wait", self._arrive, None)

    def _bind_large(self, parity: int, source: np.ndarray, input_block, input_at, recv_block,
                    recv_at) -> tuple:
        """Calls of the large regime on a shared result for one parity: (load, reduce).

        load: a private input into this rank's own shared result before "arrived"; reduce:
        this rank's block across all inputs, written into every rank's result (complete once
        every rank published "done": nothing to copy out). The slots are not used (a private
        result goes through :meth:`_bind_chunks`).
        """
        node, result = self._node, self._result
        rank, p, count, dtype = node.rank, node.size, result.size, result.dtype
        lo, hi = block(count, p, rank)
        load, reduce = [], []
        if input_block is not None:
            inputs = input_block.peers(input_at, dtype, count)
        else:
            # a private input into a shared result: copy it into our own shared result, then
            # reduce from the peers' results
            inputs = recv_block.peers(recv_at, dtype, count)
            load.append(copy_call(inputs[rank], source))
        mine = [operand[lo:hi] for operand in inputs]
        # the result is a shared array: write our block into every rank's array
        outputs = recv_block.peers(recv_at, dtype, count)
        target = outputs[rank][lo:hi]
        aliased = input_block is None or (input_block is recv_block and input_at == recv_at)
        if aliased and self.reducer.ufunc is not None:
            # our block of our own array first, the others fold into it: any order is
            # exact enough for the commutative ufunc ops, and one rank computes each block
            reduce += self._reduce_into(target, [mine[rank]] + mine[:rank] + mine[rank + 1:])
        elif aliased:
            # a user op keeps rank order: fold into scratch, not into an operand
            reduce += self._reduce_into(self._scratch, mine)
            reduce.append(copy_call(target, self._scratch))
        else:
            reduce += self._reduce_into(target, mine)
        if self._average:
            reduce.append(partial(np.divide, target, self._nranks, target))
        copy = [copy_call(outputs[q][lo:hi], target) for q in range(p) if q != rank]
        phase = self._phase
        return (tuple(phase("arrive", None, load)),
                (*phase("reduce", None, reduce), *phase("copy out", None, copy)))


    def _run(self, node: Node, epoch: int, timeout, deadline) -> None:
        parity = epoch & 1
        load, reduce = self._programs[parity]
        for call in load:
            call()
        self._sign(node, parity, timeout)
        self._arrive(node, epoch, 2 * epoch - 1, timeout, deadline, 0)
        for call in reduce:
            call()
        # every rank's result is complete once every rank wrote its block into it
        self._arrive(node, epoch, 2 * epoch, timeout, deadline, 1)

