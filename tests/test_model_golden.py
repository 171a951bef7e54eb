"""The model's predictions on a fixed grid equal the stored ones (``tests/model_golden.json``).

The stored figures were written by this file (``python tests/test_model_golden.py --write``)
from the model's slow derivation (building and simulating every rank, no fast path): the fast
paths must change how fast ``predict`` runs, never what it answers. Times within a relative 1e-12 (the
order of float additions may move), every count exactly. Rewrite the file only for a change
that is meant to move predictions, and say so in the commit.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mpiallreduce.model import DEFAULT_MACHINE, Machine, candidates, predict
from mpiallreduce.topology import Topology

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "model_golden.json"
SCRIPTS = HERE.parent / "docs" / "results"

#: (label, machine file or None for the built-in one)
MACHINES = (("built-in", None), ("calibrated", "machine-heldout-b.json"),
            ("sites", "machine-sites.json"))
#: (ranks, ranks per node, nodes per site or None)
SHAPES = ((1, 1, None), (2, 2, None), (3, 3, None), (4, 2, None), (5, 5, None), (8, 8, None),
          (12, 4, None), (13, 1, None), (17, 17, None), (24, 8, None), (64, 8, None),
          (100, 10, None), (600, 8, None), (1024, 8, None), (64, 8, 4), (96, 4, 8))
SIZES = (4, 12, 100, 1000, 5000, 16384, 100003 * 4, 3 << 20, (1 << 24) + 12)
ALGORITHMS = tuple(candidates(True)) + ("shm",)


def _machine(file):
    # the calibrated file's 2 cores would refuse most shapes: its curves are what is tested
    return DEFAULT_MACHINE if file is None else replace(Machine.load(SCRIPTS / file), cores=None)


def _cases():
    for label, file in MACHINES:
        for ranks, per_node, per_site in SHAPES:
            if label == "sites" and per_site is None:
                continue
            for size in SIZES:
                if ranks >= 600 and size not in (12, 5000, 3 << 20, (1 << 24) + 12):
                    continue
                for name in ALGORITHMS:
                    if name == "shm" and ranks != per_node:
                        continue
                    if ranks >= 600 and name in ("tree", "knomial", "recursive_doubling"):
                        continue
                    for in_place in (False, True):
                        if in_place and (ranks >= 600 or label == "sites"):
                            continue
                        yield label, file, ranks, per_node, per_site, size, name, in_place


def _figures(file, ranks, per_node, per_site, size, name, in_place) -> dict:
    topology = Topology.simulated(ranks, per_node, per_site)
    try:
        result = predict(name, ranks, size, topology, _machine(file), in_place=in_place)
    except ValueError as error:
        return {"refused": type(error).__name__}
    return {"time": result.time, "sent_bytes": int(result.sent_bytes.sum()),
            "link_bytes": [int(b) for b in result.link_bytes],
            "link_messages": [int(m) for m in result.link_messages], "steps": int(result.steps)}


def _key(label, ranks, per_node, per_site, size, name, in_place) -> str:
    return f"{label}|{ranks}|{per_node}|{per_site}|{size}|{name}|{'in' if in_place else 'out'}"


def _write() -> None:
    rows = {_key(label, *rest[:4], *rest[4:]): _figures(file, *rest)
            for label, file, *rest in _cases()}
    GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(key)}: {json.dumps(value)}"
                                          for key, value in sorted(rows.items())) + "\n}\n")
    print(f"wrote {len(rows)} predictions to {GOLDEN}")


def _stored() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("label", [label for label, _ in MACHINES])
def test_predictions_equal_the_stored_ones(label):
    stored = _stored()
    wrong = []
    seen = 0
    for label_, file, *rest in _cases():
        if label_ != label:
            continue
        key = _key(label_, *rest)
        assert key in stored, f"{key}: not in {GOLDEN.name}; rewrite it with --write"
        seen += 1
        expected, found = stored[key], _figures(file, *rest)
        if set(expected) != set(found):
            wrong.append(f"{key}: {expected} != {found}")
            continue
        for field, value in expected.items():
            if isinstance(value, float):
                if not math.isclose(found[field], value, rel_tol=1e-12, abs_tol=1e-18):
                    wrong.append(f"{key}: {field} {found[field]!r} != stored {value!r}")
            elif found[field] != value:
                wrong.append(f"{key}: {field} {found[field]!r} != stored {value!r}")
    assert seen > 100
    assert not wrong, f"{len(wrong)} of {seen} predictions moved:\n" + "\n".join(wrong[:20])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        _write()
    else:
        print(__doc__)
