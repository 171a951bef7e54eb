"""The ring on a topology with sites (every rank at once in NumPy) against building and
simulating every rank's own program: the fast path gives the same numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mpiallreduce.model import Machine, predict
from mpiallreduce.topology import Topology

SITES = Machine.load(Path(__file__).resolve().parent.parent / "docs" / "results" / "machine-sites.json")


@pytest.mark.parametrize("name", ["ring", "ring_segmented"])
@pytest.mark.parametrize("nranks, per_node, per_site", [(16, 4, 2), (24, 2, 4), (48, 8, 2)])
@pytest.mark.parametrize("blocks", [1, 3, 64])
def test_the_dense_ring_equals_every_rank_simulated(name, nranks, per_node, per_site, blocks):
    topology = Topology.simulated(nranks, per_node, per_site)
    size = nranks * blocks * 4  # whole blocks: every rank's own bytes are rank 0's
    fast = predict(name, nranks, size, topology, SITES)
    full = predict(name, nranks, size, topology, SITES, symmetric=False)
    assert fast.partition == "every rank (rotated ring, NumPy)"
    assert math.isclose(fast.time, full.time, rel_tol=1e-12)
    assert (fast.sent_bytes == full.sent_bytes).all()
    assert (fast.sent_messages == full.sent_messages).all()
    assert fast.link_bytes == full.link_bytes and fast.link_messages == full.link_messages
    assert fast.steps == full.steps and fast.pairs == full.pairs


def test_the_site_link_slows_the_dense_ring():
    topology = Topology.simulated(32, 4, 4)
    slow = predict("ring", 32, 32 * 1024, topology, SITES).time
    flat = predict("ring", 32, 32 * 1024, Topology.simulated(32, 4), SITES).time
    # 2(p-1) steps, each waiting for a message across a site boundary
    assert slow >= 2 * 31 * SITES.levels[0][1].alpha > 100 * flat
