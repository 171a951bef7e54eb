"""Timeline traces (mar.trace, MPIALLREDUCE_TRACE): valid Chrome Trace JSON, one track per rank,
one run event per run with one step event per step of the rank's program, phases nested inside;
untraced plans unchanged. Results against comm.Allreduce while tracing."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
from conftest import MPIRUN, assert_matches_native, contribution, launcher_environment, needs_mpirun
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import algorithms, executor, tracing

SCHEDULES = list(algorithms.REGISTRY)  # shm and native have no steps to trace
REQUIRED = ("name", "ph", "ts", "dur", "pid", "tid")
PHASES = ("load", "copy", "start", "wait", "combine", "finish")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def validate(document: dict, nranks: int) -> tuple[list[str], dict]:
    """Check a Chrome Trace document; return (problems, per rank: [(run, [(step, phases)])])."""
    problems = []
    events = document.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"], {}
    complete = [e for e in events if e.get("ph") == "X"]
    for event in complete:
        missing = [key for key in REQUIRED if key not in event]
        if missing:
            problems.append(f"event {event} lacks {missing}")
        elif not (isinstance(event["ts"], (int, float)) and event["dur"] >= 0):
            problems.append(f"event {event} has a bad ts or a negative duration")
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    if names != {rank: f"rank {rank}" for rank in range(nranks)}:
        problems.append(f"tracks {names}, expected one per rank 0..{nranks - 1}")
    if {e["tid"] for e in complete} - set(range(nranks)):
        problems.append("events on a track that is no rank")
    tracks = {}
    for rank in range(nranks):
        mine = sorted((e for e in complete if e["tid"] == rank), key=lambda e: (e["ts"], -e["dur"]))
        runs = [e for e in mine if e["cat"] == "mpiallreduce" and "algorithm" in e.get("args", {})]
        steps = [e for e in mine if e["name"].startswith("step ")]
        phases = [e for e in mine if e["name"] in PHASES]
        if len(runs) + len(steps) + len(phases) != len(mine):
            problems.append(f"rank {rank}: events of unknown kinds")
        # times are µs with ns digits: a child ends where its parent does up to rounding
        inside = lambda inner, outer: (outer["ts"] <= inner["ts"] and
                                       inner["ts"] + inner["dur"]
                                       <= outer["ts"] + outer["dur"] + 1e-6)
        tracks[rank] = []
        for run in runs:
            nested = [(s, [f for f in phases if inside(f, s)]) for s in steps if inside(s, run)]
            tracks[rank].append((run, nested))
        for event in steps + phases:
            if not any(inside(event, run) for run in runs):
                problems.append(f"rank {rank}: {event['name']} at {event['ts']} outside every run")
        for step in steps:
            kinds = [f["name"] for f in phases if inside(f, step)]
            if "start" not in kinds or "wait" not in kinds:
                problems.append(f"rank {rank}: {step['name']} without start and wait ({kinds})")
    return problems, tracks


def _trace_path(comm, tmp_path) -> str:
    return comm.bcast(str(tmp_path / "trace.json") if comm.rank == 0 else None, root=0)


def _checked(comm, path: str, check) -> None:
    """Run ``check(document) -> problems`` on rank 0; every rank fails alike if any."""
    problems = None
    if comm.rank == 0:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
        problems = check(document)
    problems = comm.bcast(problems, root=0)
    assert problems == [], "\n".join(problems[:10])


def _nonempty_steps(name: str, rank: int, nranks: int, count: int, topology, itemsize: int) -> int:
    algorithm = algorithms.get(name)
    params = dict(algorithm.params)
    if "itemsize" in params:
        params["itemsize"] = itemsize
    if "ordered" in params:
        params["ordered"] = False
    steps = algorithm.steps(rank, nranks, count, topology=topology, **params)
    return sum(1 for step in steps if step)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", SCHEDULES)
def test_a_traced_plan_has_one_step_event_per_step_of_its_program(algorithm, tmp_path):
    comm = MPI.COMM_WORLD
    p = comm.size
    topology = mar.Topology.simulated(comm, 2) if algorithms.get(algorithm).uses_topology else None
    # the schedule (hierarchical and cascade would run shm inside the nodes, which has none)
    params = {"intra": "p2p"} if "intra" in algorithms.get(algorithm).params else {}
    counts = (1, 2 * p + 1, 1000)
    runs = 3
    path = _trace_path(comm, tmp_path)
    with mar.trace(path, comm=comm) as recorder:
        for count in counts:
            x = contribution(comm, count, "float64", seed=count)
            out = np.empty_like(x)
            with mar.plan(x, out, comm=comm, algorithm=algorithm, topology=topology,
                          **params) as plan:
                for _ in range(runs):
                    plan.run()
                    assert_matches_native(comm, x, out, MPI.SUM)
    assert recorder.written == (path if comm.rank == 0 else None)

    def check(document):
        problems, tracks = validate(document, p)
        for rank in range(p):
            found = tracks.get(rank, [])
            if len(found) != runs * len(counts):
                problems.append(f"rank {rank}: {len(found)} runs, expected {runs * len(counts)}")
                continue
            for k, (run, steps) in enumerate(found):
                count = counts[k // runs]
                want = _nonempty_steps(algorithm, rank, p, count, topology, 8)
                if run["args"]["algorithm"] != algorithm or run["args"]["count"] != count:
                    problems.append(f"rank {rank}: run {run['args']} is not {algorithm} of {count}")
                if len(steps) != want:
                    problems.append(f"rank {rank}: {algorithm} count {count}: {len(steps)} step "
                                    f"events, the program has {want} steps")
                if [s["args"]["step"] for s, _ in steps] != sorted(s["args"]["step"] for s, _ in steps):
                    problems.append(f"rank {rank}: steps out of order")
        return problems

    _checked(comm, path, check)


@pytest.mark.mpi
def test_one_shot_calls_nonblocking_and_collectives_are_traced(tmp_path):
    comm = MPI.COMM_WORLD
    p = comm.size
    x = contribution(comm, 3 * p + 1, "float64")
    out = np.empty_like(x)
    mar.allreduce(x, out, comm=comm, algorithm="recursive_doubling")  # cached before tracing
    path = _trace_path(comm, tmp_path)
    with mar.trace(path, comm=comm):
        for _ in range(2):  # the cached plan was dropped: these bind a traced one
            mar.allreduce(x, out, comm=comm, algorithm="recursive_doubling")
            assert_matches_native(comm, x, out, MPI.SUM)
        fresh = mar.allreduce(x, comm=comm, algorithm="ring")  # an uncached call
        assert_matches_native(comm, x, fresh, MPI.SUM)
        request = mar.iallreduce(x, comm=comm, algorithm="rabenseifner")
        assert_matches_native(comm, x, request.wait(), MPI.SUM)
        block = mar.reduce_scatter(x, comm=comm, algorithm="ring")
        total = np.empty_like(x)
        comm.Allreduce(x, total)
        lo, hi = mar.partition.block(x.size, p, comm.rank)
        assert np.allclose(block, total[lo:hi])
        timed = mar.allreduce(x, comm=comm, algorithm="ring", timeout=30)  # stepwise, traced too
        assert_matches_native(comm, x, timed, MPI.SUM)
    assert executor.TRACER is None
    mar.allreduce(x, out, comm=comm, algorithm="recursive_doubling")  # untraced again
    assert_matches_native(comm, x, out, MPI.SUM)
    expected = (["recursive_doubling allreduce"] * 2 + ["ring allreduce", "rabenseifner allreduce",
                                                        "reduce_scatter ring", "ring allreduce"]
                if p > 1 else None)

    def check(document):
        problems, tracks = validate(document, p)
        for rank in range(p):
            names = [run["name"] for run, _ in tracks.get(rank, [])]
            if expected is not None and names != expected:
                problems.append(f"rank {rank}: runs {names}, expected {expected}")
        return problems

    _checked(comm, path, check)


def _same_call(a, b) -> bool:
    if isinstance(a, partial) and isinstance(b, partial):
        return a.func is b.func and len(a.args) == len(b.args) and all(
            u is v for u, v in zip(a.args, b.args))
    return a == b


def _is_stamp(call) -> bool:
    return isinstance(call, partial) and getattr(call.func, "__name__", "") == "stamp"


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring_segmented", "knomial", "cascade"])
def test_the_traced_program_is_the_plain_one_plus_clock_readings(algorithm, tmp_path):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 5 * comm.size + 3, "float32")
    out = np.empty_like(x)
    kwargs = ({"segment_bytes": 16} if algorithm == "ring_segmented" else
              {"intra": "p2p"} if algorithm == "cascade" else {})  # the schedule, not shm
    before = mar.plan(x, out, comm=comm, algorithm=algorithm, **kwargs)
    assert not any(_is_stamp(call) for call in before._fast)
    path = _trace_path(comm, tmp_path)
    with mar.trace(path, comm=comm) as recorder:
        during = mar.plan(x, out, comm=comm, algorithm=algorithm, **kwargs)
        before.run()  # bound before: records nothing
        assert_matches_native(comm, x, out, MPI.SUM)
        traced = [call for call in during._fast if not _is_stamp(call)]
        plain = during._flatten()
        assert len(traced) == len(plain)
        assert all(_same_call(a, b) for a, b in zip(traced, plain))
        assert any(_is_stamp(call) for call in during._fast)
    during.run()  # after the trace ended: correct, and nothing recorded
    assert_matches_native(comm, x, out, MPI.SUM)
    assert len(recorder.events) == 0
    before.free()
    during.free()

    def check(document):
        problems, tracks = validate(document, comm.size)
        if any(tracks.get(rank) for rank in range(comm.size)):
            problems.append("runs recorded although none ran traced")
        return problems

    _checked(comm, path, check)


@pytest.mark.mpi
def test_a_rank_keeps_its_latest_readings_and_whole_runs_only(tmp_path, monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv(tracing.EVENTS_ENV, "40")
    x = contribution(comm, 2 * comm.size + 1, "float64")
    out = np.empty_like(x)
    path = _trace_path(comm, tmp_path)
    with mar.trace(path, comm=comm), mar.plan(x, out, comm=comm, algorithm="ring") as plan:
        for _ in range(30):
            plan.run()
    assert_matches_native(comm, x, out, MPI.SUM)
    steps = 2 * (comm.size - 1)
    stamps = 3 + 3 * steps  # run, end, finish, and start, wait, combine or copy per step (or fewer)

    def check(document):
        problems, tracks = validate(document, comm.size)
        for rank in range(comm.size):
            runs = tracks.get(rank, [])
            if not 40 // stamps - 1 <= len(runs) <= 40 // 2:
                problems.append(f"rank {rank}: {len(runs)} runs kept of 40 readings")
            problems += [f"rank {rank}: a partial run" for _, found in runs if len(found) != steps]
        return problems

    _checked(comm, path, check)
    monkeypatch.setenv(tracing.EVENTS_ENV, "many")
    with pytest.raises(ValueError, match="MPIALLREDUCE_TRACE_EVENTS"), mar.trace(path, comm=comm):
        pass


@pytest.mark.mpi
def test_one_trace_at_a_time_on_every_rank(tmp_path):
    comm = MPI.COMM_WORLD
    path = _trace_path(comm, tmp_path)
    with (mar.trace(path, comm=comm),
          pytest.raises(ValueError, match="tracing is already on"), mar.trace(path, comm=comm)):
        pass
    with pytest.raises(TypeError, match="file name"), mar.trace(3, comm=comm):
        pass


def test_a_run_without_events_still_writes_one_track_per_rank():
    document = tracing.chrome_trace([([], []), ([], [])], [0, 0], 0)
    problems, tracks = validate(document, 2)
    assert problems == [] and tracks == {0: [], 1: []}
    json.dumps(document)


@needs_mpirun
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_environment_variable_traces_a_whole_run(ranks, tmp_path):
    path = tmp_path / "env.json"
    script = ("import numpy as np; from mpi4py import MPI; import mpiallreduce as mar; "
              "x = np.arange(100.0) + MPI.COMM_WORLD.rank; out = np.empty_like(x); "
              "[mar.allreduce(x, out, algorithm='ring') for _ in range(4)]; "
              "assert np.allclose(out, MPI.COMM_WORLD.allreduce(x))")
    env = {**launcher_environment(), tracing.ENV: str(path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(MPIRUN), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-c",
                             script], capture_output=True, text=True, timeout=120, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    problems, tracks = validate(json.loads(path.read_text()), ranks)
    assert problems == []
    for rank in range(ranks):
        runs = tracks[rank]
        assert [run["name"] for run, _ in runs] == ["ring allreduce"] * 4
        assert all(len(steps) == 2 * (ranks - 1) for _, steps in runs)
    assert not os.path.exists(str(path) + ".tmp")
