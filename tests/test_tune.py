"""Tuning tables: written by tune, read by select.choose; bad or mismatched ones fall back.

No MPI run here except the one subprocess test of ``python -m mpiallreduce.tune``.
"""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun
from mpi4py import MPI

from mpiallreduce import select, tune
from mpiallreduce.algorithms.ring_segmented import default_segment_bytes
from mpiallreduce.ops import reducer

SUM = reducer(MPI.SUM, np.dtype("float64"))


def _noncommutative(inbuf, inoutbuf, datatype):
    pass


@pytest.fixture
def noncommutative():
    op = MPI.Op.Create(_noncommutative, commute=False)
    yield reducer(op, np.dtype("float64"))
    op.Free()


def _table(nranks=4, commutative=None, noncommutative=None):
    return {"nranks": nranks, "classes": {
        "commutative": commutative or [
            {"min_bytes": 0, "max_bytes": 1024, "algorithm": "knomial"},
            {"min_bytes": 1024, "max_bytes": 1 << 20, "algorithm": "native"},
            {"min_bytes": 1 << 20, "max_bytes": None, "algorithm": "rabenseifner"}],
        "noncommutative": noncommutative or [
            {"min_bytes": 0, "max_bytes": None, "algorithm": "tree"}]}}


@pytest.fixture
def table_file(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(select.TUNING_ENV, str(path))
    select.reload()
    yield path
    select.reload()


def test_a_written_table_round_trips_to_the_same_choice(table_file, noncommutative):
    select.write_table(str(table_file), _table())
    assert [select.choose(4, n, SUM) for n in (8, 1023, 1024, 4096, 1 << 20, 1 << 30)] == [
        "knomial", "knomial", "native", "native", "rabenseifner", "rabenseifner"]
    assert select.choose(4, 8, noncommutative) == "tree"
    select.reload()  # read again from the file: the same answers
    assert select.choose(4, 100, SUM) == "knomial" and select.choose(4, 2 << 20, SUM) == "rabenseifner"


def test_other_sizes_and_trivial_cases_use_the_built_in_rule(table_file, noncommutative):
    select.write_table(str(table_file), _table(nranks=4))
    large = select.LARGE_MESSAGE_BYTES
    assert select.choose(3, 8, SUM) == "native" and select.choose(3, large, SUM) == "ring_segmented"
    assert select.choose(1, 8, SUM) == "native" and select.choose(4, 0, SUM) == "native"
    assert select.choose(5, large, noncommutative) == "native"


def test_writing_keeps_the_tables_of_other_sizes_and_replaces_its_own(table_file):
    select.write_table(str(table_file), _table(nranks=2))
    select.write_table(str(table_file), _table(nranks=4))
    select.write_table(str(table_file), _table(nranks=2, commutative=[
        {"min_bytes": 0, "max_bytes": None, "algorithm": "ring"}]))
    data = json.loads(table_file.read_text())
    assert [t["nranks"] for t in data["tables"]] == [2, 4]
    assert select.choose(2, 8, SUM) == "ring" and select.choose(4, 8, SUM) == "knomial"


BAD = {
    "not json": "{",
    "wrong format": json.dumps({"format": "other", "tables": []}),
    "unknown algorithm": json.dumps({"format": select.FORMAT, "tables": [_table(commutative=[
        {"min_bytes": 0, "max_bytes": None, "algorithm": "nope"}])]}),
    "gap": json.dumps({"format": select.FORMAT, "tables": [_table(commutative=[
        {"min_bytes": 0, "max_bytes": 64, "algorithm": "ring"},
        {"min_bytes": 128, "max_bytes": None, "algorithm": "ring"}])]}),
    "no open end": json.dumps({"format": select.FORMAT, "tables": [_table(commutative=[
        {"min_bytes": 0, "max_bytes": 64, "algorithm": "ring"}])]}),
    "order-breaking for a non-commutative op": json.dumps({"format": select.FORMAT, "tables": [
        _table(noncommutative=[{"min_bytes": 0, "max_bytes": None, "algorithm": "ring"}])]}),
    "bad nranks": json.dumps({"format": select.FORMAT, "tables": [_table(nranks="4")]}),
    "not a list": json.dumps({"format": select.FORMAT, "tables": {"4": 1}}),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_table_warns_once_and_falls_back(table_file, name, noncommutative):
    table_file.write_text(BAD[name])
    with pytest.warns(RuntimeWarning, match="ignoring tuning table"):
        assert select.choose(4, 8, SUM) == "native"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loaded once: no second warning
        assert select.choose(4, select.LARGE_MESSAGE_BYTES, SUM) == "ring_segmented"
        assert select.choose(4, 8, noncommutative) == "native"


def test_a_missing_file_or_off_means_the_built_in_rule(tmp_path, monkeypatch):
    monkeypatch.setenv(select.TUNING_ENV, str(tmp_path / "absent.json"))
    select.reload()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select.choose(4, 8, SUM) == "native"
    assert select.digest() == 0
    monkeypatch.setenv(select.TUNING_ENV, "off")
    assert select.table_path() is None and select.tables() == {}
    monkeypatch.delenv(select.TUNING_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert select.table_path() == str(tmp_path / "mpiallreduce" / "tuning.json")
    select.reload()


def test_write_refuses_a_table_choose_would_ignore(tmp_path):
    with pytest.raises(ValueError, match="unknown algorithm"):
        select.write_table(str(tmp_path / "t.json"), _table(commutative=[
            {"min_bytes": 0, "max_bytes": None, "algorithm": "nope"}]))
    assert not (tmp_path / "t.json").exists()


def test_ranges_merge_equal_neighbours():
    assert tune.ranges([8, 16, 32, 64], ["native", "native", "ring", "ring"]) == [
        {"min_bytes": 0, "max_bytes": 32, "algorithm": "native"},
        {"min_bytes": 32, "max_bytes": None, "algorithm": "ring"}]


def test_a_size_keeps_native_unless_beaten_beyond_the_noise():
    """tune's pick per size is :func:`mpiallreduce.decide.decide`'s, native the incumbent."""
    steady = [10.0, 10.1, 9.9, 10.0, 10.2]
    clear = tune.verdict({"native": steady, "ring": [5.0, 5.1, 4.9, 5.0, 5.2]}, one_node=True)
    assert (clear.pick, clear.decided) == ("ring", True)
    close = tune.verdict({"native": steady, "ring": [9.5, 11.0, 8.0, 9.9, 10.5]}, one_node=True)
    assert close.pick == "native" and not close.decided
    assert close.text.startswith("within noise: keeping native")
    one_round = tune.verdict({"native": [10.0], "ring": [1.0]}, one_node=False)
    assert one_round.pick == "native" and "within noise" in one_round.text
    far = {"native": steady, "cascade": [1.0] * 5}
    assert tune.verdict(far, one_node=True).pick == "native"
    assert tune.verdict(far, one_node=False).pick == "cascade"


@pytest.mark.parametrize("one_node", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("size", [8, 1 << 16, 8 << 20, 64 << 20])
def test_the_incumbent_is_what_the_built_in_rules_run(table_file, one_node, in_place, size):
    """tune asks what learning asks: does anything beat what auto runs without a table? (A
    size within the noise then keeps that, not native.)"""
    expected = select.one_node_choice(2, size, in_place, use_tables=False) if one_node else None
    expected = expected or select.choose(2, size, reducer(MPI.SUM, np.dtype(np.float64)),
                                         use_tables=False, in_place=in_place)
    assert tune.incumbent(2, size, MPI.SUM, in_place, one_node) == expected
    # a table for the size changes nothing: the incumbent is the rules', not the table's
    select.write_table(str(table_file), _table(commutative=[
        {"min_bytes": 0, "max_bytes": None, "algorithm": "tree"}]))
    select.reload()
    assert tune.incumbent(2, size, MPI.SUM, in_place, one_node) == expected
    if one_node and size == 8:
        assert expected == "shm"
    rounds = {"native": [1.0] * 5, "shm": [1.0] * 5, "ring": [1.0] * 5, "tree": [1.0] * 5}
    assert tune.verdict(rounds, one_node, expected).pick == (
        expected if expected in rounds else "native")


def test_candidates_are_every_registered_algorithm_that_accepts_the_op_class():
    from mpiallreduce.algorithms import REGISTRY
    assert [c.algorithm for c in tune.candidates("commutative")] == ["native", "shm", *REGISTRY]
    order_keeping = [c.algorithm for c in tune.candidates("noncommutative")]
    assert "knomial" in order_keeping and "shm" in order_keeping and "ring" not in order_keeping
    # on one node, nothing made for several nodes is timed
    one_node = [c.algorithm for c in tune.candidates("commutative", one_node=True)]
    assert one_node == [name for name in ["native", "shm", *REGISTRY]
                        if name not in ("hierarchical", "cascade")]


def test_ring_segmented_default_segment_follows_message_size_and_cache():
    assert default_segment_bytes(8) == 256 << 10
    assert default_segment_bytes(16 << 20) == 256 << 10
    assert default_segment_bytes(32 << 20) == 512 << 10
    assert default_segment_bytes(64 << 20) == 1 << 20
    assert default_segment_bytes(1 << 34) == 1 << 20


@needs_mpirun
def test_tune_under_mpirun_writes_a_table_choose_reads(tmp_path):
    path = tmp_path / "tuning.json"
    env = {**launcher_environment(), select.TUNING_ENV: str(path)}
    result = subprocess.run(
        ["timeout", "240", str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
         "mpiallreduce.tune", "--sizes", "8:64", "--repeats", "1"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote the table for 2 rank(s) to {path}" in result.stdout
    tables = select.parse(json.loads(path.read_text()))
    assert set(tables[2]) == set(select.TABLE_CLASSES)  # both modes by default
    data = json.loads(path.read_text())
    assert data["format"] == select.FORMAT  # the format of the built-in rules
    record = data["provenance"][data["tables"][0]["provenance"]]
    assert set(record) >= set(select.PROVENANCE_FIELDS)
    assert "mpiallreduce.tune --sizes 8:64 --repeats 1" in record["command"]
    assert set(record["measured"]["commutative"]) == {"8", "16", "32", "64"}
    # one round measures no spread: every size keeps what the built-in rules run there (on
    # this one node, shm), and says so
    ruled = {size: tune.incumbent(2, int(size), MPI.SUM, False, one_node=True)
             for size in ("8", "16", "32", "64")}
    assert set(record["verdicts"]["commutative"]) == set(ruled)
    for size, text in record["verdicts"]["commutative"].items():
        assert text.startswith(f"within noise: keeping {ruled[size]}")
    assert f"-> within noise: keeping {ruled['8']}" in result.stdout
    assert [r["algorithm"] for r in data["tables"][0]["classes"]["commutative"]] \
        == sorted(set(ruled.values()))


def test_a_table_keeps_its_provenance_and_a_rewrite_drops_only_its_own(table_file):
    record = {"machine": "m", "date": "d", "command": "c", "measured": {"commutative": {}}}
    select.write_table(str(table_file), {**_table(nranks=2), "provenance": "tune-n2"}, record)
    select.write_table(str(table_file), {**_table(nranks=4), "provenance": "tune-n4"},
                       {**record, "machine": "other"})
    data = json.loads(table_file.read_text())
    assert data["provenance"] == {"tune-n2": record, "tune-n4": {**record, "machine": "other"}}
    select.write_table(str(table_file), _table(nranks=4))  # no provenance: its record goes
    assert json.loads(table_file.read_text())["provenance"] == {"tune-n2": record}
    assert select.choose(2, 8, SUM) == "knomial"


def test_a_table_of_the_older_format_is_still_read(table_file):
    table_file.write_text(json.dumps({"format": select.LEGACY_FORMAT, "tables": [_table()]}))
    assert select.choose(4, 8, SUM) == "knomial"


def test_a_table_naming_a_missing_provenance_is_refused(tmp_path):
    with pytest.raises(ValueError, match="provenance 'x'"):
        select.write_table(str(tmp_path / "t.json"), {**_table(), "provenance": "x"})
