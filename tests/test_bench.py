"""The benchmark: command-line checks (serial), small runs under MPI, and a broken algorithm
that validation must catch. The bench runs in-process through ``bench.main(argv)``; two serial
tests launch it with mpirun as a user would."""

from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import MPIRUN, launcher_environment, needs_mpirun
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import bench
from mpiallreduce.schedule import RECEIVED_FIRST

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["--sizes", "8:64", "--iterations", "3", "--warmup", "1"]
COLUMNS = ("size", "algorithm", "avg", "min", "max", "algbw", "busbw", "vs_native", "check")


# -- serial: the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("text, sizes", [
    ("8:64", [8, 16, 32, 64]),
    ("1K", [1024]),
    ("4k:16KiB", [4096, 8192, 16384]),
    ("1M:2M", [2**20, 2**21]),
    ("1G:1G", [2**30]),
    ("8,64K,8M", [8, 2**16, 2**23]),
    ("8:32,16,1K", [8, 16, 32, 1024]),
])
def test_sizes_are_powers_of_two_from_min_to_max(text, sizes):
    assert bench.parse_sizes(text) == sizes


def test_default_sizes_run_from_8_bytes_to_16_mib():
    sizes = bench.parse_sizes(bench.DEFAULT_SIZES)
    assert sizes[0] == 8 and sizes[-1] == 16 * 2**20 and len(sizes) == 22


@pytest.mark.parametrize("text", ["7:64", "8:100", "0:8", "64:8", "8:16Q", "", "x", "8:", "-8:8", "8,,16",
                                  "8,100"])
def test_bad_sizes_raise_usage_error(text):
    with pytest.raises(bench.UsageError, match="size"):
        bench.parse_sizes(text)


def test_default_iterations_shrink_with_size_within_bounds():
    sizes = bench.parse_sizes("1:1G")
    counts = [bench.default_iterations(s) for s in sizes]
    assert counts[0] == (bench.MAX_ITERATIONS, bench.MAX_ITERATIONS // 10)
    assert counts[-1][0] == bench.MIN_ITERATIONS
    assert all(a[0] >= b[0] for a, b in zip(counts, counts[1:]))
    assert all(1 <= warmup <= iterations for iterations, warmup in counts)


def test_all_means_every_algorithm_auto_included_and_native_always_runs_first():
    names = bench.parse_algorithms("all")
    assert names[0] == "native"
    assert set(names) == set(mar.ALGORITHMS)
    assert bench.parse_algorithms("ring") == ["native", "ring"]
    assert bench.parse_algorithms("auto,native,ring,ring") == ["native", "auto", "ring"]


def test_the_intra_node_variants_are_named_explicitly_and_run_their_parameter():
    from mpiallreduce.bench.options import algorithm_call

    assert bench.parse_algorithms("hierarchical-p2p,cascade-shm") == [
        "native", "hierarchical-p2p", "cascade-shm"]
    assert algorithm_call("hierarchical-p2p") == ("hierarchical", {"intra": "p2p"})
    assert algorithm_call("cascade-shm") == ("cascade", {"intra": "shm"})
    assert algorithm_call("ring") == ("ring", {})


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "8:100"], "powers of two"),
    (["--sizes", "lots"], "bad size"),
    (["--algorithms", "ring,bogus"], "unknown algorithm 'bogus'"),
    (["--op", "BAND", "--dtype", "float32"], "BAND is not defined for dtype float32"),
    (["--op", "AVG", "--dtype", "int32"], "AVG is not defined for dtype int32"),
    (["--op", "NOPE"], "invalid choice"),
    (["--dtype", "float16"], "invalid choice"),
    (["--iterations", "0"], "--iterations 0"),
    (["--ranks-per-node", "0"], "--ranks-per-node 0"),
    (["--sizes", "1:4", "--dtype", "float64"], "smaller than one float64"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--json", "/nonexistent/folder/out.json"], "does not exist"),
])
def test_bad_arguments_exit_2_with_one_clear_message(argv, message, capsys):
    assert bench.main(argv) == bench.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], captured.err
    assert "Traceback" not in captured.err


def test_help_documents_every_option_with_its_default(capsys):
    assert bench.main(["-h"]) == bench.EXIT_OK
    text = capsys.readouterr().out
    parser = bench.build_parser()
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.option_strings[0] in text
        assert "(default:" in action.help, action.option_strings
    for phrase in ("warm", "barrier", "2(p-1)/p", "exit status"):
        assert phrase in text


def test_ranks_per_node_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv(bench.RANKS_PER_NODE_ENV, "3")
    assert bench.parse_args([]).ranks_per_node == 3
    assert bench.parse_args(["--ranks-per-node", "2"]).ranks_per_node == 2
    monkeypatch.setenv(bench.RANKS_PER_NODE_ENV, "two")
    with pytest.raises(bench.UsageError, match="positive integer"):
        bench.parse_args([])
    monkeypatch.delenv(bench.RANKS_PER_NODE_ENV)
    assert bench.parse_args([]).ranks_per_node is None


def test_sizes_below_one_element_are_skipped_with_a_note():
    opts = bench.parse_args(["--sizes", "4:32", "--dtype", "complex128"])
    assert opts.sizes == [16, 32]
    assert any("4, 8" in note for note in opts.notes)


def _valid(op: str, dtype: str) -> bool:
    try:
        mar.ops.reducer(bench.op_of(op), np.dtype(dtype))
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("op, dtype", [
    (op, dtype) for op in bench.OP_NAMES
    for dtype in ("int8", "uint16", "int64", "float32", "complex64", "bool") if _valid(op, dtype)])
def test_inputs_reduce_exactly_in_any_order(op, dtype):
    """The inputs are chosen so that validation can compare bit for bit."""
    red = mar.ops.reducer(bench.op_of(op), np.dtype(dtype))
    xs = [bench.make_input(257, np.dtype(dtype), op, rank) for rank in range(12)]
    forward, backward = xs[0].copy(), xs[-1].copy()
    for x in xs[1:]:
        red.combine(x.copy(), forward, RECEIVED_FIRST)
    for x in reversed(xs[:-1]):
        red.combine(x.copy(), backward, RECEIVED_FIRST)
    assert np.array_equal(forward, backward)
    assert len({x.tobytes() for x in xs}) == len(xs)  # ranks contribute different data


def test_plot_draws_every_algorithm_into_a_png(tmp_path):
    """Rank 0 alone draws the plot, so one rank tests it (matplotlib is slow to import)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert bench.main(["--sizes", "8:16", "--iterations", "2", "--quiet", "--plot", str(png)],
                      comm=MPI.COMM_SELF) == bench.EXIT_OK
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- serial: the real command line under mpirun --------------------------------------------------------

def _mpirun(ranks: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(MPIRUN), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
               "mpiallreduce.bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=launcher_environment())


@needs_mpirun
def test_mpirun_bad_argument_exits_2_once_without_abort_or_traceback():
    result = _mpirun(2, "--algorithms", "bogus")
    assert result.returncode == bench.EXIT_USAGE, result.stderr
    assert result.stderr.count("error: unknown algorithm 'bogus'") == 1, result.stderr
    assert "Traceback" not in result.stderr and "MPI_ABORT" not in result.stderr
    assert result.stdout == ""


@needs_mpirun
def test_sweep_script_merges_rank_counts_into_one_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_sweep.py"), "--ranks", "1", "2",
         "--json", str(out), "--plot", str(png), "--", "--sizes", "8:16", "--iterations", "2"],
        capture_output=True, text=True, timeout=180, env=launcher_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# ranks: 1," in result.stdout and "# ranks: 2," in result.stdout  # the tables
    assert "Traceback" not in result.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(run["ranks"], run["status"], run["meta"]["ranks"]) for run in runs] == [(1, 0, 1),
                                                                                      (2, 0, 2)]
    assert all(len(run["rows"]) == 2 * len(bench.parse_algorithms("all")) for run in runs)
    assert png.stat().st_size > 10_000


# -- MPI: the bench in-process on COMM_WORLD ----------------------------------------------------------

@pytest.fixture
def shared_dir():
    """A directory every rank sees (made on rank 0, removed after the test)."""
    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="mar-bench-") if comm.rank == 0 else None)
    yield pathlib.Path(path)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _run(comm, argv) -> tuple[int, str]:
    """Run bench.main on every rank; return (status, rank 0's stdout) on every rank."""
    out = io.StringIO()
    status = bench.main(argv, comm=comm, out=out)
    text = comm.bcast(out.getvalue() if comm.rank == 0 else None)
    assert comm.allgather(status) == [status] * comm.size
    return status, text


def _table(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            fields = line.split()
            assert len(fields) == len(COLUMNS), line
            row = dict(zip(COLUMNS, fields))
            rows.append({k: v if k in ("algorithm", "check") else float(v) for k, v in row.items()})
    return rows


@pytest.mark.mpi
def test_small_run_writes_well_formed_rows_json_and_csv(shared_dir):
    comm, folder = MPI.COMM_WORLD, shared_dir
    argv = SMALL + ["--json", str(folder / "out.json"), "--csv", str(folder / "out.csv")]
    status, text = _run(comm, argv)
    assert status == bench.EXIT_OK, text
    p = comm.size
    names = bench.parse_algorithms("all")
    assert f"# ranks: {p}," in text and "# dtype: float32, op: SUM" in text
    table = _table(text)
    assert [(r["size"], r["algorithm"]) for r in table] == [
        (s, a) for s in (8, 16, 32, 64) for a in names]
    for row in table:
        assert row["check"] == "ok"
        assert 0 < row["min"] <= row["avg"] <= row["max"]
        if row["algorithm"] == "native":
            assert row["vs_native"] == 1.0
    for name in names:
        assert any(line.startswith(f"# {name}: mean busbw") for line in text.splitlines())
    document = json.loads((folder / "out.json").read_text())
    assert document["meta"]["ranks"] == p and document["meta"]["tool"] == "mpiallreduce.bench"
    assert [(r["size"], r["algorithm"], r["check"]) for r in document["rows"]] == [
        (r["size"], r["algorithm"], r["check"]) for r in table]
    for row, printed in zip(document["rows"], table):
        assert printed["avg"] == pytest.approx(row["avg_us"], abs=0.006)
        assert row["count"] == row["size"] // 4 and row["iterations"] == 3 and row["warmup"] == 1
        assert row["algbw_gbs"] == pytest.approx(row["size"] / row["avg_us"] / 1e3)
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * 2 * (p - 1) / p)
        native = next(r for r in document["rows"]
                      if r["size"] == row["size"] and r["algorithm"] == "native")
        assert row["vs_native"] == pytest.approx(native["avg_us"] / row["avg_us"])
    lines = (folder / "out.csv").read_text().splitlines()
    assert any(line.startswith("# mpi_library:") for line in lines)
    records = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [(int(r["size"]), r["algorithm"]) for r in records] == [
        (r["size"], r["algorithm"]) for r in document["rows"]]
    assert all(float(r["avg_us"]) == pytest.approx(j["avg_us"])
               for r, j in zip(records, document["rows"]))


@pytest.mark.mpi
def test_in_place_integer_max_with_simulated_nodes_validates(monkeypatch):
    monkeypatch.setenv(bench.RANKS_PER_NODE_ENV, "3")  # the flag wins; restored afterwards
    comm = MPI.COMM_WORLD
    status, text = _run(comm, ["--sizes", "2:16", "--iterations", "2", "--in-place",
                               "--op", "max", "--dtype", "int16", "--ranks-per-node", "2"])
    assert status == bench.EXIT_OK, text
    assert os.environ[bench.RANKS_PER_NODE_ENV] == "2"
    assert "ranks per node: 2 (simulated" in text and "in place: yes" in text
    assert "sizes below one int16 element (2 B) skipped" not in text
    table = _table(text)
    assert {r["size"] for r in table} == {2, 4, 8, 16}
    assert all(r["check"] == "ok" for r in table)


class _Corrupting:
    """A plan that runs the real one, then spoils one element: a deliberately broken algorithm."""

    def __init__(self, plan):
        self.plan = plan

    def run(self):
        out = self.plan.run()
        out.flat[0] += 1
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.plan.free()


@pytest.mark.mpi
def test_broken_algorithm_fails_validation_and_exits_nonzero_on_every_rank(monkeypatch):
    real_plan = mar.plan

    def plan(*args, algorithm="auto", **kwargs):
        made = real_plan(*args, algorithm=algorithm, **kwargs)
        return _Corrupting(made) if algorithm == "ring" else made

    monkeypatch.setattr(mar, "plan", plan)
    status, text = _run(MPI.COMM_WORLD, SMALL + ["--algorithms", "ring"])
    assert status == bench.EXIT_FAIL
    table = _table(text)
    assert {r["check"] for r in table if r["algorithm"] == "ring"} == {"FAIL"}
    assert {r["check"] for r in table if r["algorithm"] == "native"} == {"ok"}
    assert "# validation FAILED: ring at 8, ring at 16, ring at 32, ring at 64" in text


@pytest.mark.mpi(min_size=2)  # one rank has nothing to gather
def test_broken_schedule_fails_validation(monkeypatch):
    """A schedule that only reduce-scatters: every rank misses most of the result."""
    comm = MPI.COMM_WORLD
    from mpiallreduce import _plans, algorithms
    from mpiallreduce.algorithms.ring import ring_reduce_scatter

    broken = algorithms.Algorithm("ring", lambda rank, nranks, count, topology=None:
                                  ring_reduce_scatter(rank, nranks, count), True, "broken")
    monkeypatch.setitem(algorithms.REGISTRY, "ring", broken)
    _plans.SCHEDULES.clear()
    try:
        status, text = _run(comm, ["--sizes", "64:128", "--iterations", "2",
                                   "--algorithms", "ring"])
    finally:
        _plans.SCHEDULES.clear()
    assert status == bench.EXIT_FAIL
    assert "# validation FAILED: ring at 64, ring at 128" in text


@pytest.mark.mpi
def test_algorithm_that_refuses_is_skipped_with_a_note(monkeypatch):
    real_plan = mar.plan

    def plan(*args, algorithm="auto", **kwargs):
        if algorithm == "ring":
            raise ValueError("algorithm 'ring' refuses this case")
        return real_plan(*args, algorithm=algorithm, **kwargs)

    monkeypatch.setattr(mar, "plan", plan)
    status, text = _run(MPI.COMM_WORLD, SMALL + ["--algorithms", "ring"])
    assert status == bench.EXIT_OK
    assert text.count("# ring skipped: algorithm 'ring' refuses this case") == 1
    assert {r["algorithm"] for r in _table(text)} == {"native"}


@pytest.mark.mpi
def test_no_validate_and_quiet(shared_dir):
    comm, folder = MPI.COMM_WORLD, shared_dir
    status, text = _run(comm, SMALL + ["--no-validate", "--quiet", "--json",
                                       str(folder / "q.json")])
    assert status == bench.EXIT_OK and text == ""
    rows = json.loads((folder / "q.json").read_text())["rows"]
    assert rows and {r["check"] for r in rows} == {"-"}


# -- repeats, spread and recommendations -------------------------------------------------------------

def _row(size, name, avg, ratio, lo=float("nan"), hi=float("nan"), repeats=1, rounds=None,
         runs=""):
    return bench.Row(size, size // 4, name, 10, 1, avg, avg, avg, 1.0, 1.0, ratio, "ok", repeats,
                     avg, avg, lo, hi, runs, tuple(rounds or [avg] * repeats))


def _advice(rows):
    lines = bench.recommendations(rows)
    return lines[0], lines[1:]


def test_the_advice_leads_with_what_auto_picked_and_its_ratio_to_the_best():
    rows = []
    for size, ran, auto, best in ((8, "native", 10.0, 10.0), (16, "native", 10.4, 10.0),
                                  (1 << 20, "shm", 50.0, 50.0), (2 << 20, "shm", 131.0, 100.0)):
        rows += [_row(size, "native", best, 1.0, repeats=3, rounds=[best, best, 1.5 * best]),
                 _row(size, "ring", best * 1.3, 0.77, repeats=3),
                 _row(size, "auto", auto, best / auto, repeats=3, runs=ran)]
    lead, recommend = _advice(rows)
    assert lead == ("# auto picked (its median time / the best measured median): "
                    "native 8 1.00x, 16 1.04x; shm 1M 1.00x, 2M 1.31x")
    # at 8 and 16 auto ran native (the same code: no challenger); at 2M native's median is 31%
    # faster than auto's, beyond native's spread (25%: it lost one round by half) and auto's
    assert recommend == [
        "# recommend 8-1M: auto: nothing measured faster (its rounds spread 0.0%)",
        "# recommend 2M: native, not auto (ran shm): faster beyond the noise, medians of 3 "
        "interleaved rounds (lead / noise: 2M 31%/25%)"]


def test_recommend_only_a_lead_beyond_the_noise_and_say_within_noise_otherwise():
    """The advice is :func:`mpiallreduce.decide.decide`'s per size: a lead beyond the spread
    of either one's rounds is recommended; a lead within it, a tie or an auto too noisy to
    judge keeps auto, and the line says which."""
    auto = [100.0, 100.0, 100.0]
    rows = [
        # 1M: ring leads by 22%, its rounds spread 1.8%: recommended
        _row(1 << 20, "native", 100.0, 1.0, repeats=3),
        _row(1 << 20, "auto", 100.0, 1.0, repeats=3, rounds=auto, runs="shm"),
        _row(1 << 20, "ring", 82.0, 1.2, repeats=3, rounds=[80.0, 82.0, 83.0]),
        # 2M: ring's median leads by 11%, but its rounds spread 33%: within noise
        _row(2 << 20, "native", 100.0, 1.0, repeats=3),
        _row(2 << 20, "auto", 100.0, 1.0, repeats=3, rounds=auto, runs="shm"),
        _row(2 << 20, "ring", 90.0, 1.1, repeats=3, rounds=[70.0, 90.0, 130.0]),
        # 4M: a tie, and a 3% lead within tree's own 7% spread: within noise
        _row(4 << 20, "native", 100.0, 1.0, repeats=3),
        _row(4 << 20, "auto", 100.0, 1.0, repeats=3, rounds=auto, runs="shm"),
        _row(4 << 20, "ring", 100.0, 1.0, repeats=3, rounds=auto),
        _row(4 << 20, "tree", 97.0, 1.03, repeats=3, rounds=[90.0, 97.0, 104.0]),
        # 8M: the algorithm auto ran is never recommended over auto, however noisy
        _row(8 << 20, "native", 100.0, 1.0, repeats=3),
        _row(8 << 20, "auto", 100.0, 1.0, repeats=3, rounds=auto, runs="shm"),
        _row(8 << 20, "shm", 70.0, 1.4, repeats=3, rounds=[70.0, 70.0, 70.0]),
        # 16M: auto's own rounds spread 75%: too busy to decide, whatever ring shows
        _row(16 << 20, "native", 100.0, 1.0, repeats=3),
        _row(16 << 20, "auto", 100.0, 1.0, repeats=3, rounds=[50.0, 100.0, 200.0], runs="shm"),
        _row(16 << 20, "ring", 10.0, 10.0, repeats=3, rounds=[10.0, 10.0, 10.0]),
    ]
    _, recommend = _advice(rows)
    assert recommend == [
        "# recommend 1M: ring, not auto (ran shm): faster beyond the noise, medians of 3 "
        "interleaved rounds (lead / noise: 1M 22%/1.8%)",
        "# recommend 2M-4M: auto: within noise: keeping auto (ring, tree led by 3.1-11%, "
        "within the rounds' spread of 7.2-33%)",
        "# recommend 8M: auto: nothing measured faster (its rounds spread 0.0%)",
        "# recommend 16M: auto: within noise: keeping auto (its rounds spread 75%, over the 50% "
        "bound: the machine is too busy to decide; rerun when it is idle)",
        "# within noise at 3 of 5 size(s): these rounds cannot tell the algorithms apart there; "
        "more --repeat or an idle machine can"]


def test_on_one_node_the_advice_leaves_hierarchical_and_cascade_out_unless_named():
    steady = [100.0, 100.0, 100.0]
    rows = [_row(1 << 20, "native", 100.0, 1.0, repeats=3, rounds=steady),
            _row(1 << 20, "auto", 100.0, 1.0, repeats=3, rounds=steady, runs="shm"),
            _row(1 << 20, "ring", 99.0, 1.01, repeats=3, rounds=[97.0, 99.0, 101.0]),
            _row(1 << 20, "cascade", 50.0, 2.0, repeats=3, rounds=[50.0, 50.0, 50.0]),
            _row(1 << 20, "hierarchical-shm", 60.0, 1.7, repeats=3, rounds=[60.0] * 3)]
    lines = bench.recommendations(rows, one_node=True)
    assert lines[1] == ("# left out of the advice on one node: cascade, hierarchical-shm (made "
                        "for several nodes; name them in --algorithms to weigh them)")
    assert lines[2].startswith("# recommend 1M: auto: within noise: keeping auto (ring led by")
    assert not any("recommend 1M: cascade" in line for line in lines)
    # named, it is weighed, and it beats every one-node candidate beyond the noise
    named = bench.recommendations(rows, one_node=True, named=("cascade",))
    assert named[1] == ("# left out of the advice on one node: hierarchical-shm (made for "
                        "several nodes; name them in --algorithms to weigh them)")
    assert named[2].startswith("# recommend 1M: cascade, not auto (ran shm)")
    # across nodes (real or simulated) both compete
    assert bench.recommendations(rows)[1].startswith("# recommend 1M: cascade, not auto")


def test_the_algorithms_named_one_by_one_are_kept_apart_from_all():
    assert bench.parse_args(["--algorithms", "all,cascade"], printing=False).named == ("cascade",)
    assert bench.parse_args([], printing=False).named == ()


def test_a_run_without_auto_takes_native_as_the_baseline():
    rows = [_row(8, "native", 2.0, 1.0, repeats=3), _row(8, "ring", 1.9, 1.05, 0.8, 1.3, 3,
                                                          rounds=[1.9, 1.5, 2.2]),
            _row(1 << 20, "native", 900.0, 1.0, repeats=3),
            _row(1 << 20, "ring", 500.0, 1.8, 1.6, 1.9, 3, rounds=[500.0, 480.0, 560.0]),
            _row(2 << 20, "native", 1800.0, 1.0, repeats=3),
            _row(2 << 20, "ring", 1000.0, 1.8, 1.7, 1.9, 3, rounds=[1000.0, 1050.0, 950.0])]
    lines = bench.summary_lines(rows, ["native", "ring"])
    assert "# ring: mean busbw 1.0000 GB/s over 3 size(s); faster than native at 2 size(s): " \
           "1M (1.80x), 2M (1.80x)" in lines
    assert "# auto not measured" in lines[-4]
    assert lines[-3:] == [
        "# recommend 8: native: within noise: keeping native (ring led by 5.3%, within the "
        "rounds' spread of 18%)",
        "# recommend 1M-2M: ring, not native: faster beyond the noise, medians of 3 interleaved "
        "rounds (lead / noise: 1M 80%/8.0%, 2M 80%/5.0%)",
        "# within noise at 1 of 3 size(s): these rounds cannot tell the algorithms apart there; "
        "more --repeat or an idle machine can"]


def test_fewer_rounds_than_needed_recommend_nothing_but_auto():
    rows = [_row(2 << 20, "native", 100.0, 1.0), _row(2 << 20, "ring", 50.0, 2.0),
            _row(2 << 20, "auto", 100.0, 1.0, runs="native")]
    lines = bench.summary_lines(rows, ["native", "ring", "auto"])
    assert "# ring: mean busbw 1.0000 GB/s over 1 size(s); faster than native at 1 size(s): " \
           "2M (2.00x)" in lines
    assert lines[-2] == ("# auto picked (its median time / the best measured median): "
                         "native 2M 2.00x")
    assert lines[-1] == ("# recommend auto: within noise: keeping auto (1 round(s) measure no "
                         "spread: rerun with --repeat 3 for a recommendation)")


def test_one_round_never_calls_1_00x_a_win():
    rows = [_row(2 << 20, "native", 100.0, 1.0), _row(2 << 20, "ring", 99.8, 1.002)]
    lines = bench.summary_lines(rows, ["native", "ring"])
    assert "# ring: mean busbw 1.0000 GB/s over 1 size(s); never faster than native" in lines


@pytest.mark.parametrize("argv, message", [(["--repeat", "0"], "--repeat 0"),
                                           (["--api", "plan,fast"], "--api 'plan,fast'")])
def test_bad_repeat_and_api_exit_2(argv, message, capsys):
    assert bench.main(argv) == bench.EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.mpi
def test_repeats_and_call_modes_in_one_table():
    comm = MPI.COMM_WORLD
    status, text = _run(comm, ["--sizes", "8:16", "--iterations", "3", "--warmup", "1",
                               "--repeat", "2", "--algorithms", "ring", "--api", "plan,call"])
    assert status == bench.EXIT_OK
    assert "rounds: 2 (algorithms interleaved" in text
    labels = [line.split()[1] for line in text.splitlines()
              if line.strip() and not line.startswith("#")]
    assert labels == ["native", "comm.Allreduce", "native/call", "ring", "ring/call"] * 2  # 2 sizes
    assert all("spread " in line for line in text.splitlines()
               if line.strip() and not line.startswith("#"))
    assert "# ring/call: mean busbw" in text and "time / comm.Allreduce: 8 " in text
    # auto was not measured, and two rounds back no recommendation
    assert "# auto not measured" in text
    assert "# recommend native: within noise: keeping native (2 round(s) measure no spread" \
        in text
    assert text.count("# recommend") == 1


def test_trace_takes_one_size():
    with pytest.raises(bench.UsageError, match="--trace records the runs of one size"):
        bench.parse_args(["--sizes", "8:64", "--trace", "t.json"], printing=False)
    assert bench.parse_args(["--sizes", "64K", "--trace", "t.json"], printing=False).trace == "t.json"


@pytest.mark.mpi
def test_trace_records_the_timed_runs_only(shared_dir):
    comm, path = MPI.COMM_WORLD, shared_dir / "trace.json"
    iterations, names = 7, ["ring", "tree"]
    status, text = _run(comm, ["--sizes", "1K", "--iterations", str(iterations), "--warmup", "3",
                               "--algorithms", ",".join(names), "--trace", str(path)])
    assert status == bench.EXIT_OK, text
    assert f"# trace of the timed runs: {path}" in text
    if comm.rank == 0:
        events = json.loads(path.read_text())["traceEvents"]
        runs = [e for e in events if e["ph"] == "X" and "algorithm" in e.get("args", {})]
        for rank in range(comm.size):
            mine = [e["args"]["algorithm"] for e in runs if e["tid"] == rank]
            # the warm-up and validation runs are not recorded; native (the reference the bench
            # always times) is one span per call
            timed = ["native", *names]
            assert mine == [name for name in timed for _ in range(iterations)], (rank, mine)
    comm.Barrier()


def test_against_gloo_needs_torch_and_says_how_to_get_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(bench.UsageError, match=r"mpiallreduce\[torch\]"):
        bench.parse_args(["--against", "gloo"])
    opts = bench.parse_args(["--against", "native"])
    assert [label for _, _, label in opts.cases][0] == "native"
