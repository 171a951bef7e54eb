"""What ``auto`` picks: a schedule only in the measured ranges, never an algorithm that refuses the op."""

import numpy as np
import pytest
from mpi4py import MPI

from mpiallreduce import algorithms
from mpiallreduce.ops import reducer
from mpiallreduce.select import LARGE_MESSAGE_BYTES, choose


def _noncommutative(inbuf, inoutbuf, datatype):
    pass


@pytest.mark.parametrize("nranks", [1, 2, 3, 8])
@pytest.mark.parametrize("nbytes", [0, 8, 1 << 20, LARGE_MESSAGE_BYTES - 1,
                                    LARGE_MESSAGE_BYTES, 1 << 31])
def test_auto_picks_the_pipelined_ring_above_the_crossover(nranks, nbytes):
    picked = choose(nranks, nbytes, reducer(MPI.SUM, np.dtype("float32")))
    # at 2 ranks the measured range of the pipelined ring starts lower, at 4 MiB (RULES)
    crossover = 4 << 20 if nranks == 2 else LARGE_MESSAGE_BYTES
    assert (picked == "ring_segmented") == (nranks > 1 and nbytes >= crossover), picked


# the measured ranges of select.RULES, written out: (ranks, bytes, pick)
PICKS = [(1, 64 << 10, "native"), (2, 8, "native"), (2, 8 << 10, "native"),
         (2, 16 << 10, "recursive_doubling"), (2, (128 << 10) - 1, "recursive_doubling"),
         (2, 128 << 10, "native"), (2, 2 << 20, "native"), (2, 4 << 20, "ring_segmented"),
         (3, 1 << 10, "native"), (3, 2 << 10, "knomial"), (4, 32 << 10, "knomial"),
         (5, (64 << 10) - 1, "knomial"), (5, 64 << 10, "native"), (6, 16 << 10, "native"),
         (8, 1 << 20, "native"), (8, 32 << 20, "ring_segmented")]


@pytest.mark.parametrize("nranks, nbytes, expected", PICKS)
def test_auto_picks_a_schedule_only_where_one_was_measured_faster(nranks, nbytes, expected):
    assert choose(nranks, nbytes, reducer(MPI.SUM, np.dtype("float64"))) == expected


def test_auto_never_picks_an_order_breaking_algorithm_for_a_non_commutative_op():
    op = MPI.Op.Create(_noncommutative, commute=False)
    try:
        red = reducer(op, np.dtype("int64"))
        for nranks in (2, 5, 16):
            for nbytes in (8, LARGE_MESSAGE_BYTES, 1 << 33):
                picked = choose(nranks, nbytes, red)
                assert picked == "native" or not algorithms.get(picked).commutative_only
    finally:
        op.Free()


def test_one_node_runs_shm_up_to_the_measured_sizes_at_two_ranks(monkeypatch):
    """At 2 ranks (not outnumbering the cores) the chunked large regime won below 16 MiB in
    both modes, in place up to 32 MiB (select.SHM_RULES, SHM_IN_PLACE_RULES); from 32 MiB
    neither mode runs it."""
    from mpiallreduce import select

    monkeypatch.setattr(select, "tables", lambda: {})
    monkeypatch.setattr(select.os, "cpu_count", lambda: 2)
    for nbytes in (8, 64 << 10, 8 << 20, (16 << 20) - 8):
        assert select.one_node_choice(2, nbytes, in_place=True) == "shm"
        assert select.one_node_choice(2, nbytes, in_place=False) == "shm"
    for nbytes in (16 << 20, (32 << 20) - 8):
        assert select.one_node_choice(2, nbytes, in_place=True) == "shm"
        assert select.one_node_choice(2, nbytes, in_place=False) is None
    for nbytes in (32 << 20, 1 << 30):
        assert select.one_node_choice(2, nbytes, in_place=True) is None
        assert select.one_node_choice(2, nbytes, in_place=False) is None


# -- the rules as data: the same decisions as before they moved to the data file ---------------

DECISION_SIZES = sorted({0, 1, 8, 4095, 4096 + 8} | {1 << k for k in range(0, 31)}
                        | {(1 << k) - 8 for k in range(4, 31)})
#: (ranks, ranks per node) of the grid: one node, two or more nodes, and past MEASURED_RANKS
#: (where the cost model decides)
DECISION_LAYOUTS = [(1, 1), (2, 2), (2, 1), (3, 3), (3, 2), (4, 4), (4, 2), (5, 5), (5, 3),
                    (8, 8), (8, 4), (9, 9), (16, 16), (16, 8), (64, 8)]


def _decisions(monkeypatch) -> dict[str, str]:
    """auto's decision for every (cores, ranks, placement, op and dtype, mode) of the grid, as
    run-length strings over DECISION_SIZES: what ``_plans.resolve`` returns (with a stand-in
    for the communicator's state), ``select.persistent_native`` and ``select.choose`` given
    the topology. No tuning table; the library's 8-bit saturation stands in as a fixed rule."""
    import itertools
    import types

    from mpiallreduce import _plans, select
    from mpiallreduce.topology import Topology

    monkeypatch.setattr(select, "tables", lambda: {})
    monkeypatch.setattr(_plans, "native_deviates",
                        lambda name, dtype: name == "SUM" and np.dtype(dtype).itemsize == 1)
    user = MPI.Op.Create(_noncommutative, commute=False)
    rows = {}
    try:
        ops = {"f64sum": (MPI.SUM, "float64"), "f32max": (MPI.MAX, "float32"),
               "i8sum": (MPI.SUM, "int8"), "noncomm": (user, "float64")}
        ops = {label: (reducer(op, np.dtype(dtype)), np.dtype(dtype))
               for label, (op, dtype) in ops.items()}

        def rle(values):
            return " ".join(f"{v}*{len(list(g))}" for v, g in itertools.groupby(map(str, values)))

        for cores in (2, 64):
            monkeypatch.setattr(select.os, "cpu_count", lambda cores=cores: cores)
            for nranks, per_node in DECISION_LAYOUTS:
                topology = Topology.simulated(nranks, per_node)
                state = types.SimpleNamespace(default_topology=lambda *a, t=topology: t)
                for label, (red, dtype) in ops.items():
                    for mode in ("out", "in", "shared"):
                        row = []
                        for nbytes in DECISION_SIZES:
                            call = types.SimpleNamespace(
                                algorithm="auto", reducer=red, topology=None,
                                recv=types.SimpleNamespace(nbytes=nbytes, dtype=dtype),
                                send=None if mode != "out" else object())
                            row.append(_plans.resolve(call, nranks, state,
                                                      shared=mode == "shared"))
                        rows[f"cores={cores} p={nranks} per_node={per_node} {label} {mode}"] = \
                            rle(row)
                rows[f"cores={cores} p={nranks} persistent_native"] = rle(
                    select.persistent_native(nranks, nbytes) for nbytes in DECISION_SIZES)
                for label, (red, _) in ops.items():
                    rows[f"cores={cores} p={nranks} choose {label} given topology"] = rle(
                        select.choose(nranks, nbytes, red, topology) for nbytes in DECISION_SIZES)
    finally:
        user.Free()
    return rows


def test_auto_decides_as_before_the_rules_became_data(monkeypatch):
    """tests/auto_decisions.json was captured from select.py's constants before they moved to
    mpiallreduce/rules/builtin.json; every decision of the grid must be the same."""
    import json
    import pathlib

    expected = json.loads((pathlib.Path(__file__).parent / "auto_decisions.json").read_text())
    assert expected["sizes"] == DECISION_SIZES
    found = _decisions(monkeypatch)
    differ = [key for key in expected["rows"] if found.get(key) != expected["rows"][key]]
    assert set(found) == set(expected["rows"]) and not differ, differ[:5]


def test_every_built_in_rule_names_its_measurement():
    from mpiallreduce import select

    rules = select.builtin()
    assert sum(len(r) for r in rules.rules.values()) >= 8
    for kind in select.KINDS:
        for rule in rules.of(kind):
            record = rules.provenance[rule.provenance]
            assert all(record[field] for field in select.PROVENANCE_FIELDS), rule
    assert set(select.SETTINGS) <= set(rules.settings)


def test_no_dated_measurement_in_select_or_tune():
    """The figures live in the rules file and docs/; the code keeps the why."""
    import pathlib
    import re

    import mpiallreduce

    root = pathlib.Path(mpiallreduce.__file__).parent
    for name in ("select.py", "tune.py"):
        text = (root / name).read_text()
        assert not re.search(r"20\d\d-\d\d-\d\d", text), name


BAD_RULES = {
    "format": ({"format": "x"}, "not a mpiallreduce-rules/1 file"),
    "kind": ({"rules": [{"kind": "x"}]}, "kind, mode and op"),
    "nranks": ({"rules": [{"kind": "schedule", "mode": "any", "op": "any", "nranks": [3, 2],
                           "bytes": [0, None], "algorithm": "ring", "provenance": "p"}]},
               "nranks must be"),
    "bytes": ({"rules": [{"kind": "schedule", "mode": "any", "op": "any", "nranks": [2, 2],
                          "bytes": [8, 8], "algorithm": "ring", "provenance": "p"}]},
              "bytes must be"),
    "algorithm": ({"rules": [{"kind": "schedule", "mode": "any", "op": "any", "nranks": [2, 2],
                              "bytes": [0, None], "algorithm": "nope", "provenance": "p"}]},
                  "unknown algorithm"),
    "no provenance": ({"rules": [{"kind": "schedule", "mode": "any", "op": "any",
                                  "nranks": [2, 2], "bytes": [0, None], "algorithm": "ring",
                                  "provenance": "q"}]}, "provenance 'q'"),
    "provenance fields": ({"provenance": {"p": {"machine": "m"}}}, "lacks date"),
    "setting": ({"settings": {"x": {"value": "1", "provenance": "p"}}}, "setting 'x'"),
}


@pytest.mark.parametrize("name", BAD_RULES)
def test_a_bad_rules_file_is_refused_with_the_reason(name):
    from mpiallreduce import select

    data, message = BAD_RULES[name]
    data = {"format": select.FORMAT, "provenance": {"p": dict.fromkeys(
        select.PROVENANCE_FIELDS, "x")}, **data}
    with pytest.raises(ValueError, match=message):
        select.parse_rules(data)
