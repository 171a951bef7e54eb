"""Property-based tests: every registered schedule passes the verifier for random p, counts,
segment sizes and (once topology.py exists) topologies. New algorithms are covered as they
register; no MPI needed."""

from __future__ import annotations

import inspect

from hypothesis import given, settings
from hypothesis import strategies as st

from mpiallreduce.algorithms import REGISTRY, build
from mpiallreduce.verify import verify

try:  # topology.py arrives with the hierarchical algorithms
    from mpiallreduce.topology import Topology
except ImportError:  # pragma: no cover - until then every schedule gets topology=None
    Topology = None

#: size knobs a builder may take, in elements or (``*_bytes``) in bytes
SIZE_PARAMS = ("segment", "segment_size", "chunk", "chunk_size", "segment_bytes")
ITEMSIZES = (1, 2, 4, 8, 16)


def _knobs(name: str) -> tuple[bool, list[str]]:
    """Whether algorithm ``name`` reads a topology, and which size parameters it takes."""
    accepted = inspect.signature(REGISTRY[name].builder).parameters
    return "topology" in accepted, [p for p in SIZE_PARAMS + ("itemsize",) if p in accepted]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(REGISTRY)))
    p = draw(st.integers(1, 64))
    count = draw(st.one_of(st.sampled_from([0, 1, max(p - 1, 0), p, p + 1, 2 * p - 1]),
                           st.integers(0, 4 * p + 5), st.integers(0, 10**7)))
    uses_topology, sizes = _knobs(name)
    params = {}
    if "itemsize" in sizes:
        params["itemsize"] = draw(st.sampled_from(ITEMSIZES))
    total = max(count, 1) * params.get("itemsize", 1)
    for size in sizes:
        if size != "itemsize":  # at most ~64 segments per block keeps each example fast
            params[size] = draw(st.integers(max(total // (64 * p), 1), total))
    topology = None
    if uses_topology and Topology is not None and draw(st.booleans()):
        # contiguous nodes of unequal sizes (round-robin placements are left to topology tests)
        nodes = sorted(draw(st.lists(st.integers(0, 7), min_size=p, max_size=p)))
        topology = Topology.from_nodes(nodes)
    return name, p, count, topology, params


@settings(max_examples=100, deadline=None)
@given(cases())
def test_every_schedule_passes_the_verifier(case):
    name, p, count, topology, params = case
    verify(build(name, p, count, topology=topology, **params))
