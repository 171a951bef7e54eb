"""Node-local shared-memory transport: one window per node, per-rank headers, three regimes.

With :mod:`..executor`, the transport layer: the only code that moves data between ranks. It
imports nothing above the transport: its callers hand it the communicator's state (and the
package registers how :func:`shared_empty` finds one, :func:`serve_states`). Its rooms:

- :mod:`.protocol`: the protocol's words (epoch, parity slot, publish, arrive and signature
  are defined there), header layout, regime sizes, the one mismatch report, the test hook;
- :mod:`.node`: a node's shared window, counters and epochs (:class:`Node`), and the memory of
  shared arrays (:class:`SharedBlock`);
- :mod:`.arrays`: shared arrays (:class:`SharedArray`, :func:`shared_empty`);
- :mod:`.plan`: what every regime's plan shares (:class:`ShmPlan`); :mod:`.small`
  (:class:`SmallPlan`) and :mod:`.large` (:class:`ChunkedPlan`, :class:`DirectPlan`): the
  regimes, one class each;
- :mod:`.regimes`: which regime a call gets, :func:`build`, :func:`fits`.

Every rank numbers its shm calls on a communicator (its *epoch*); call ``e`` publishes the
counter ``2e - 1`` once its data is in place ("arrived") and ``2e`` once its part is done
(the large regime's chunks count their steps in a word of their own,
:data:`.protocol.STEP_WORD`). Regimes are chosen from the agreed count and dtype, never from
per-rank state.

Every wait checks the peers' signatures first, so ranks that run different calls (count,
dtype, op, plan, shared-array placement) raise the same ValueError without a message. A data
signature also carries a digest of the call's argument-check fields (:mod:`.._agree`: algorithm
as requested, parameters, topology, whether a timeout is set, ...), so a one-shot call whose
run goes through here needs no separate check (``check=True`` is free): a difference there, or
a peer that checks the arguments of another call at this epoch, sends every rank to the
agreement's exchange (the plan's ``disagree``), which raises the agreement's message everywhere.

Setting a constant of the package (``shm.CLOSE_SECONDS = 1.0``, as tests do) sets it in the
room that reads it.
"""

from __future__ import annotations

import sys
import types

from . import arrays, large, node, plan, protocol, regimes, small
from .arrays import SharedArray, serve_states, shared_empty, shared_zeros
from .large import ChunkedPlan, DirectPlan
from .node import CHECK_KEYVAL, CLOSE_SECONDS, KEYVAL, Node, SharedBlock, node_of
from .plan import ShmPlan
from .protocol import (
    ALIGN,
    CHUNK_BYTES,
    DATA_FIELDS,
    FENCE,
    HEADER_BYTES,
    KIND_CHECK,
    KIND_DATA,
    MAX_CHUNKS,
    MIN_WINDOW,
    PLACEMENT,
    SIGNATURE_WORDS,
    SMALL_BYTES,
    SMALL_BYTES_TWO_RANKS,
    SPIN_READS,
    STALLS,
    STEP_SHIFT,
    STEP_WORD,
    TSO_MACHINES,
    YIELD_SECONDS,
    Stalls,
    chunk_bytes,
    describe,
    differs,
    digest,
    signature_words,
    slot_bytes,
    small_bytes,
)
from .regimes import build, fits, regime_of
from .small import SmallPlan

__all__ = [
    "ALIGN", "CHECK_KEYVAL", "CHUNK_BYTES", "CLOSE_SECONDS", "ChunkedPlan", "DATA_FIELDS",
    "DirectPlan", "FENCE", "HEADER_BYTES", "KEYVAL", "KIND_CHECK", "KIND_DATA", "MAX_CHUNKS",
    "MIN_WINDOW", "Node", "PLACEMENT", "SIGNATURE_WORDS", "SMALL_BYTES", "SMALL_BYTES_TWO_RANKS",
    "SPIN_READS", "STALLS", "STEP_SHIFT", "STEP_WORD", "SharedArray", "SharedBlock", "ShmPlan",
    "SmallPlan", "Stalls", "TSO_MACHINES", "YIELD_SECONDS", "build", "chunk_bytes", "describe",
    "differs", "digest", "fits", "node_of", "regime_of", "serve_states", "shared_empty",
    "shared_zeros", "signature_words", "slot_bytes", "small_bytes",
]

#: the rooms whose module-level constants the package's own names stand for
_ROOMS = (protocol, node, arrays, plan, small, large, regimes)


class _Package(types.ModuleType):
    """The package's module: setting an upper-case name (a constant, or the test hook
    ``STALLS``) sets it in every room that holds it too, where the code reads it."""

    def __setattr__(self, name: str, value) -> None:
        if name.isupper():
            for room in _ROOMS:
                if name in vars(room):
                    setattr(room, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
