"""Which shm plan a call gets: :func:`regime_of` picks the regime from the agreed count, dtype
and placement; :func:`build` binds it (making or growing the node's window); :func:`fits`
says whether it would bind without a collective.
"""

from __future__ import annotations

import numpy as np

from ..executor import flat
from .large import ChunkedPlan, DirectPlan
from .node import KEYVAL, node_of
from .plan import ShmPlan, is_small, placed
from .protocol import round_up, slot_bytes
from .small import SmallPlan


def regime_of(node, call) -> type[ShmPlan]:
    """The plan class of ``call`` on ``node`` (every rank alike: from the agreed count and dtype
    and the shared arrays' placement, which the signatures compare): :class:`SmallPlan` up to
    :func:`.protocol.small_bytes`, then :class:`DirectPlan` on a shared-array result,
    :class:`ChunkedPlan` on a private one."""
    result = flat(call.recv)
    source = flat(call.send) if call.send is not None else result
    send_block, _, recv_block, _ = placed(node, call, source, result)
    if is_small(node, result.nbytes, send_block, recv_block):
        return SmallPlan
    return ChunkedPlan if recv_block is None else DirectPlan


def build(call, state, *, topology, plan_id: int, timeout, deadline, what: str,
          agreement=None, disagree=None, exact: bool = False) -> ShmPlan:
    """Bind an shm plan for ``call`` on a one-node communicator.

    Raises ValueError (on every rank alike: the topology is agreed) when the communicator spans
    several nodes. The window is made or grown here, from the call's agreed count and dtype.
    ``agreement``: the argument-check fields of a run without and with a timeout, folded into
    every run's signature; ``disagree(fields)`` raises the agreement's message on every rank.
    ``exact``: a one-float64 SUM or AVG of several ranks, added up exactly (``ops.exact_sum``).
    """
    private = state.private
    nranks = private.Get_size()
    if nranks == 1:
        return ShmPlan(None, call, plan_id=plan_id, timeout=timeout, state=state)
    if topology is not None and topology.nnodes > 1:
        raise ValueError(f"algorithm 'shm' needs every rank on one node, but the communicator "
                         f"spans {topology.nnodes} nodes ({topology!r}); use 'hierarchical' or "
                         f"'cascade' across nodes")
    if call.recv.size == 0:
        return ShmPlan(None, call, plan_id=plan_id, timeout=timeout, state=state)
    node = node_of(state, deadline, what)
    if node.size != nranks:
        raise ValueError(f"algorithm 'shm' needs every rank on one node, but only {node.size} "
                         f"of {nranks} ranks share this one; use 'hierarchical' or 'cascade'")
    node.reserve(slot_bytes(call.recv.nbytes), deadline, what)
    if exact and (call.recv.size != 1 or call.recv.dtype != np.float64
                  or call.reducer.name not in ("SUM", "AVG")):
        raise ValueError("an exact shm plan sums one float64")
    return regime_of(node, call)(node, call, plan_id=plan_id, timeout=timeout, state=state,
                                 agreement=agreement, disagree=disagree, exact=exact)


def fits(call, state) -> bool:
    """Would :func:`build` bind ``call`` without a collective (the node exists, its window is
    large enough, the buffers are live), given that it runs ``shm`` on this communicator?"""
    node = state.private.Get_attr(KEYVAL)
    if call.recv.size == 0 or node is None or node.closed or node.size == 1 \
            or node.size != state.private.Get_size():
        return False
    if 2 * round_up(slot_bytes(call.recv.nbytes)) > node.capacity:
        return False
    return not any(getattr(array, "_block", None) is not None and array._block.freed
                   for array in (call.send, call.recv))
