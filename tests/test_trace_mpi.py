"""Timeline traces (mar.trace, MPIALLREDUCE_TRACE): valid Chrome Trace JSON, one track per rank,
one run event per run with one step event per step of the rank's program, phases nested inside;
shm runs (their phases, a span per chunk of the large regime), node-phased runs (the cross-node
plan's run nested in their ``across`` phase) and native calls (one span each) too, whatever the
entry point (one-shot calls, plans, timed calls, mar.Comm); a trace with no runs warns once on
rank 0, saying why; untraced plans unchanged. Results against comm.Allreduce while tracing."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings
from functools import partial

import numpy as np
import pytest
from conftest import (
    MPIRUN,
    assert_matches_native,
    assert_on_every_rank,
    contribution,
    launcher_environment,
    needs_mpirun,
)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import _hooks, algorithms, shm, tracing

SCHEDULES = list(algorithms.REGISTRY)  # shm and native have no steps to trace
REQUIRED = ("name", "ph", "ts", "dur", "pid", "tid")
#: phases of a schedule's step, then those of shm and node-phased runs
PHASES = ("load", "copy", "start", "wait", "combine", "finish",
          "arrive", "reduce", "copy out", "gather", "across", "publish")
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
        steps = [e for e in mine if e["name"].startswith(("step ", "chunk "))]
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
            needed = ("start", "wait") if step["name"].startswith("step ") else ("arrive", "wait")
            if any(kind not in kinds for kind in needed):
                problems.append(f"rank {rank}: {step['name']} without {' and '.join(needed)} "
                                f"({kinds})")
    return problems, tracks


def _inside(inner: dict, outer: dict) -> bool:
    return (inner is not outer and outer["ts"] <= inner["ts"]
            and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-6)


def outer_runs(track: list) -> list:
    """The runs of a track (``validate``'s) that no other run holds (a node-phased run holds
    its cross-node plan's run)."""
    return [(run, steps) for run, steps in track
            if not any(_inside(run, other) for other, _ in track)]


def phases_of(document: dict, rank: int, span: dict) -> list[str]:
    """The names of the phases inside ``span`` on ``rank``'s track, in time order, not those of a
    run nested in it."""
    mine = [e for e in document["traceEvents"] if e.get("ph") == "X" and e["tid"] == rank]
    nested = [e for e in mine if "algorithm" in e.get("args", {}) and _inside(e, span)]
    return [e["name"] for e in sorted(mine, key=lambda e: e["ts"])
            if e["name"] in PHASES and _inside(e, span)
            and not any(_inside(e, run) for run in nested)]


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
    assert _hooks.tracer is None
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
    return getattr(call, "__qualname__", "") == "Recorder.stamper.<locals>.stamp"


@pytest.mark.mpi
@pytest.mark.filterwarnings("ignore:mpiallreduce trace")  # (no run recorded: rank 0 says so)
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
@pytest.mark.filterwarnings("ignore:mpiallreduce trace")  # (no run recorded: rank 0 says so)
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


# -- shm, node-phased and native runs ------------------------------------------------------------

#: phases of an shm run of the small regime, in order (two ranks or more)
SMALL_PHASES = ["arrive", "wait", "reduce"]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1 KiB (at most 256 per call) instead of 512 KiB, set alike on every rank before
    any plan binds: a large-regime message of a few hundred KiB crosses many chunks."""
    monkeypatch.setattr(shm, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(shm, "MAX_CHUNKS", 256)


def _traced(comm, tmp_path, calls):
    """Run ``calls()`` inside a trace (no warning may come: runs are recorded); return the
    document on rank 0 (None elsewhere)."""
    path = _trace_path(comm, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mar.trace(path, comm=comm):
            calls()
    trace_warnings = [str(w.message) for w in caught if "trace" in str(w.message)]
    assert_on_every_rank(comm, f"rank {comm.rank}: {trace_warnings}" if trace_warnings else None)
    if comm.rank != 0:
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _check_on_rank_0(comm, document, check) -> None:
    problems = None
    if comm.rank == 0:
        problems, tracks = validate(document, comm.size)
        problems += check(tracks)
    problems = comm.bcast(problems, root=0)
    assert problems == [], "\n".join(problems[:10])


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["auto", "shm"])
def test_one_node_calls_plans_and_timed_calls_are_traced(algorithm, tmp_path):
    """``auto`` runs ``shm`` on one node at these sizes (where it picks a schedule, that one is
    expected): one-shot calls (the bound closure of the call cache), a timed call, a plan."""
    comm = MPI.COMM_WORLD
    p = comm.size
    counts = (1, 3, 1000)  # one float64 (added as Python floats), small vectors
    runs = 3
    names = []
    for count in counts:
        x = contribution(comm, count, "float64", seed=count)
        with mar.plan(x, np.empty_like(x), comm=comm, algorithm=algorithm) as probe:
            names += [probe.algorithm] * (runs + 3)

    def calls():
        for count in counts:
            x = contribution(comm, count, "float64", seed=count)
            out = np.empty_like(x)
            for _ in range(runs):
                mar.allreduce(x, out, comm=comm, algorithm=algorithm)
                assert_matches_native(comm, x, out, MPI.SUM)
            timed = mar.allreduce(x, comm=comm, algorithm=algorithm, timeout=30)
            assert_matches_native(comm, x, timed, MPI.SUM)
            with mar.plan(x, out, comm=comm, algorithm=algorithm) as plan:
                for _ in range(2):
                    plan.run()
                    assert_matches_native(comm, x, out, MPI.SUM)

    document = _traced(comm, tmp_path, calls)
    if algorithm == "shm":
        assert set(names) == {"shm"}

    def check(tracks):
        problems = []
        for rank in range(p):
            found = outer_runs(tracks[rank])
            got = [run["args"]["algorithm"] for run, _ in found]
            if got != names:
                problems.append(f"rank {rank}: runs of {got}, expected {names}")
                continue
            for run, _ in found:
                if run["args"]["algorithm"] == "shm" and p > 1 \
                        and phases_of(document, rank, run) != SMALL_PHASES:
                    problems.append(f"rank {rank}: shm run of {run['args']['count']} has "
                                    f"phases {phases_of(document, rank, run)}, expected "
                                    f"{SMALL_PHASES}")
        return problems

    _check_on_rank_0(comm, document, check)


@pytest.mark.mpi
@pytest.mark.parametrize("placement", ["out_of_place", "in_place", "shared"])
def test_the_large_regime_traces_every_chunk(small_chunks, placement, tmp_path):
    """Private results move a chunk at a time: one span per chunk (its index in ``args``) with
    its phases; a shared result is reduced in place (arrive, wait, reduce, copy out, wait)."""
    comm = MPI.COMM_WORLD
    p = comm.size
    shared = placement == "shared"
    count = shm.small_bytes(p, shared) // 8 + 1000
    per = shm.chunk_bytes(8 * count) // 8
    chunks = -(-count // per)
    runs = 2
    x = contribution(comm, count, "float64")
    buf = mar.shared_empty(count, comm=comm) if shared else np.empty(count)

    def calls():
        for _ in range(runs):
            buf[...] = x
            if placement == "out_of_place":
                out = mar.allreduce(x, buf, comm=comm, algorithm="shm")
            else:
                out = mar.allreduce(MPI.IN_PLACE, buf, comm=comm, algorithm="shm")
            assert_matches_native(comm, x, out, MPI.SUM)

    try:
        document = _traced(comm, tmp_path, calls)
    finally:
        if shared:
            buf.free()  # (the trace's end dropped the cached call that held it)

    def check(tracks):
        problems = []
        for rank in range(p):
            found = outer_runs(tracks[rank])
            if [run["name"] for run, _ in found] != ["shm allreduce"] * runs:
                problems.append(f"rank {rank}: runs {[run['name'] for run, _ in found]}")
                continue
            if p == 1:
                continue
            for run, steps in found:
                kinds = phases_of(document, rank, run)
                if shared:
                    if steps or kinds[:3] != ["arrive", "wait", "reduce"] or kinds[-1] != "wait":
                        problems.append(f"rank {rank}: shared-result run with phases {kinds}")
                    continue
                indices = [step["args"].get("chunk") for step, _ in steps]
                if indices != list(range(chunks)) or any(
                        step["name"] != f"chunk {c}" for c, (step, _) in enumerate(steps)):
                    problems.append(f"rank {rank}: chunk spans {indices[:5]}..., expected "
                                    f"0..{chunks - 1}")
                for step, phases in steps:
                    names = [f["name"] for f in phases]
                    if names[:1] != ["arrive"] or "reduce" not in names or "copy out" not in names:
                        problems.append(f"rank {rank}: {step['name']} has phases {names}")
                        break
                    if any(f["args"].get("chunk") != step["args"]["chunk"] for f in phases):
                        problems.append(f"rank {rank}: {step['name']} holds another chunk's phase")
                        break
        return problems

    _check_on_rank_0(comm, document, check)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["hierarchical", "cascade"])
def test_node_phased_runs_are_traced_with_their_cross_node_plan_inside(algorithm, tmp_path):
    """Simulated nodes of 2 with shared memory inside (intra="shm"): each run holds its
    phases; where there are several nodes, the ranks that work across them hold the cross-node
    plan's run in their ``across`` phase."""
    comm = MPI.COMM_WORLD
    p = comm.size
    topology = mar.Topology.simulated(comm, 2)
    counts = (1, 1000)
    runs = 2

    def calls():
        for count in counts:
            x = contribution(comm, count, "float64", seed=count)
            out = np.empty_like(x)
            for _ in range(runs):
                mar.allreduce(x, out, comm=comm, algorithm=algorithm, topology=topology,
                              intra="shm")
                assert_matches_native(comm, x, out, MPI.SUM)
            with mar.plan(x, out, comm=comm, algorithm=algorithm, topology=topology,
                          intra="shm") as plan:
                plan.run()
                assert_matches_native(comm, x, out, MPI.SUM)

    document = _traced(comm, tmp_path, calls)

    def check(tracks):
        problems = []
        across = reduced = 0
        for rank in range(p):
            found = outer_runs(tracks[rank])
            names = [run["name"] for run, _ in found]
            if names != [f"{algorithm} allreduce"] * (len(counts) * (runs + 1)):
                problems.append(f"rank {rank}: runs {names}")
                continue
            if p == 1:  # one rank: the schedule (no node to share)
                continue
            for run, _ in found:
                kinds = phases_of(document, rank, run)
                # (a rank past the node's owners, or of an empty block, reduces nothing)
                if kinds[:2] != ["arrive", "wait"] or not {"copy out", "publish"} & set(kinds):
                    problems.append(f"rank {rank}: node-phased run with phases {kinds}")
                    break
                reduced += "reduce" in kinds
                nested = [other for other, _ in tracks[rank] if _inside(other, run)]
                if "across" in kinds:
                    across += 1
                    if len(nested) != 1 or nested[0]["args"]["algorithm"] != algorithm:
                        problems.append(f"rank {rank}: across holds {nested}")
                elif nested:
                    problems.append(f"rank {rank}: a nested run outside an across phase")
        if topology.nnodes > 1 and not across:
            problems.append("no rank traced a cross-node phase")
        if p > 1 and reduced < len(counts) * (runs + 1):
            problems.append(f"{reduced} runs reduced on some rank, expected every run")
        return problems

    _check_on_rank_0(comm, document, check)


@pytest.mark.mpi
def test_native_calls_are_one_span_each(tmp_path):
    """One-shot calls (MPI's Allreduce bound in the call cache), fresh arrays, AVG, a timed
    call and a plan's runs: one ``native allreduce`` span each, with nothing inside."""
    comm = MPI.COMM_WORLD
    x = contribution(comm, 7, "float64")
    total = 0

    def calls():
        nonlocal total
        out = np.empty_like(x)
        for _ in range(3):
            mar.allreduce(x, out, comm=comm, algorithm="native")
            assert_matches_native(comm, x, out, MPI.SUM)
        for _ in range(2):
            assert_matches_native(comm, x, mar.allreduce(x, comm=comm, algorithm="native"),
                                  MPI.SUM)
        mean = mar.allreduce(x, op=mar.AVG, comm=comm, algorithm="native")
        assert_matches_native(comm, x, mean, MPI.SUM, average=True)
        timed = mar.allreduce(x, comm=comm, algorithm="native", timeout=30)
        assert_matches_native(comm, x, timed, MPI.SUM)
        with mar.plan(x, out, comm=comm, algorithm="native") as plan:
            plan.run()
            plan.run()
        total = 3 + 2 + 1 + 1 + 2

    document = _traced(comm, tmp_path, calls)

    def check(tracks):
        problems = []
        for rank in range(comm.size):
            found = outer_runs(tracks[rank])
            if [run["name"] for run, _ in found] != ["native allreduce"] * total:
                problems.append(f"rank {rank}: runs {[run['name'] for run, _ in found]}, "
                                f"expected {total} native")
            if any(steps or phases_of(document, rank, run) for run, steps in found):
                problems.append(f"rank {rank}: a native span holds events")
        return problems

    _check_on_rank_0(comm, document, check)


@pytest.mark.mpi
def test_drop_in_allreduce_calls_are_traced(tmp_path):
    """mar.Comm's Allreduce with its default algorithm: repeated arrays, fresh arrays per call,
    in place: one run per call on every rank."""
    comm = MPI.COMM_WORLD
    drop_in = mar.Comm(comm)
    x = contribution(comm, 1, "float64")
    calls_made = 0

    def calls():
        nonlocal calls_made
        out = np.empty_like(x)
        for _ in range(20):
            drop_in.Allreduce(x, out)
        assert_matches_native(comm, x, out, MPI.SUM)
        for _ in range(5):
            fresh = np.empty_like(x)
            drop_in.Allreduce(x.copy(), fresh)
            assert_matches_native(comm, x, fresh, MPI.SUM)
        buf = x.copy()
        drop_in.Allreduce(MPI.IN_PLACE, buf)
        assert_matches_native(comm, x, buf, MPI.SUM)
        calls_made = 26

    document = _traced(comm, tmp_path, calls)

    def check(tracks):
        problems = []
        for rank in range(comm.size):
            found = outer_runs(tracks[rank])
            if len(found) != calls_made:
                problems.append(f"rank {rank}: {len(found)} runs of {calls_made} Allreduce calls")
        return problems

    _check_on_rank_0(comm, document, check)


@pytest.mark.mpi
def test_a_trace_without_runs_warns_once_on_rank_0_saying_why(tmp_path):
    comm = MPI.COMM_WORLD
    x = contribution(comm, 5, "float64")
    out = np.empty_like(x)
    path = _trace_path(comm, tmp_path)
    reasons = {}
    with mar.plan(x, out, comm=comm, algorithm="shm") as before:
        for case in ("nothing", "bound before"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with mar.trace(path, comm=comm):
                    if case == "bound before":
                        before.run()  # bound before the trace: not traced
            reasons[case] = [str(w.message) for w in caught if "trace" in str(w.message)]
    assert_matches_native(comm, x, out, MPI.SUM)
    problems = []
    for case, found in reasons.items():
        if comm.rank != 0:
            if found:
                problems.append(f"rank {comm.rank} warned: {found}")
            continue
        if len(found) != 1:
            problems.append(f"{case}: rank 0 warned {len(found)} times: {found}")
        elif "no runs" not in found[0] or "bound before" not in found[0] \
                or "no allreduce ran" not in found[0]:
            problems.append(f"{case}: the warning does not say why: {found[0]}")
    assert_on_every_rank(comm, "; ".join(problems) or None)


@needs_mpirun
def test_the_environment_variable_traces_drop_in_calls_on_one_node(tmp_path):
    """The issue's case: MPIALLREDUCE_TRACE over mar.Comm's Allreduce with the default
    algorithm (shm on one node of 2 ranks) records every call: the first, of a case not seen
    before, as MPI's collective, the others as shm's."""
    path = tmp_path / "drop_in.json"
    calls = 50
    script = ("import numpy as np; from mpi4py import MPI; import mpiallreduce as mar; "
              "comm = mar.Comm(MPI.COMM_WORLD); x = np.array([1.0 + comm.rank]); "
              "out = np.empty_like(x); "
              f"[comm.Allreduce(x, out) for _ in range({calls})]; "
              "assert out[0] == 3.0")
    env = {**launcher_environment(), tracing.ENV: str(path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py", "-c",
                             script], capture_output=True, text=True, timeout=120, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(path.read_text())
    problems, tracks = validate(document, 2)
    assert problems == []
    for rank in range(2):
        runs = outer_runs(tracks[rank])
        assert [run["name"] for run, _ in runs] == ["native allreduce"] + ["shm allreduce"] * (
            calls - 1)
        assert all(phases_of(document, rank, run) == SMALL_PHASES for run, _ in runs[1:])


# -- a solver's loop: fresh arrays per call ------------------------------------------------------

#: iterations of the loop tests
LOOP_CALLS = 30


def _solver_loop(comm, allreduce, calls: int) -> str | None:
    """A Jacobi-like loop: an 8-byte allreduce of a fresh array per iteration and a 1 KiB
    exchange with the neighbours; the first wrong sum, or None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    halo = np.full(1024, rank, dtype=np.uint8)
    ghost = np.empty_like(halo)
    for step in range(calls):
        residual = np.array([float(step + rank)])
        total = np.empty(1)
        allreduce(residual, total)
        comm.Sendrecv(halo, (rank + 1) % size, 0, ghost, (rank - 1) % size, 0)
        want = step * size + size * (size - 1) / 2
        if total[0] != want:
            return f"rank {rank}, call {step}: {total[0]}, expected {want}"
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("way", ["mar.Comm", "mar.allreduce"])
@pytest.mark.parametrize("algorithm", ["auto", "native", "recursive_doubling"])
def test_a_loop_of_fresh_arrays_records_one_run_per_call_written_at_the_end(way, algorithm,
                                                                          tmp_path):
    """Each call with a fresh array runs what an earlier call like it bound (its shape), traced
    as untraced: one run per call, named and sized as the call, from a few plans rather than one
    per call; held in memory while the trace is on (no file yet), all in the file after.
    mar.Comm runs the first call of a case not seen before as MPI's collective."""
    comm = MPI.COMM_WORLD
    p = comm.size
    with mar.plan(np.zeros(1), np.empty(1), comm=comm, algorithm=algorithm) as probe:
        name = f"{probe.algorithm} allreduce"
    drop_in = mar.Comm(comm, algorithm=algorithm)
    allreduce = (drop_in.Allreduce if way == "mar.Comm"
                 else partial(mar.allreduce, comm=comm, algorithm=algorithm))
    path = _trace_path(comm, tmp_path)
    with mar.trace(path, comm=comm) as recorder:
        wrong = _solver_loop(comm, allreduce, LOOP_CALLS)
        held = len(recorder.events)
        early = os.path.exists(path)
    problems = [wrong] if wrong else []
    if held < 2 * LOOP_CALLS:
        problems.append(f"rank {comm.rank}: {held} clock readings held for {LOOP_CALLS} calls")
    if early:
        problems.append(f"rank {comm.rank}: the trace was written before it ended")
    assert_on_every_rank(comm, "; ".join(problems) or None)

    def check(document):
        problems, tracks = validate(document, p)
        for rank in range(p):
            runs = outer_runs(tracks.get(rank, []))
            if len(runs) != LOOP_CALLS:
                problems.append(f"rank {rank}: {len(runs)} runs of {LOOP_CALLS} calls")
            for index, (run, _) in enumerate(runs):
                got = (run["name"], run["args"]["count"], run["args"]["bytes"],
                       run["args"]["dtype"], run["args"]["op"], run["args"]["ranks"])
                # mar.Comm's auto runs the first call of a case new to the communicator (an
                # earlier test may have called it) as MPI's collective
                names = {name}
                if index == 0 and way == "mar.Comm" and algorithm == "auto":
                    names.add("native allreduce")
                if got[0] not in names or got[1:] != (1, 8, "float64", "SUM", p):
                    problems.append(f"rank {rank}: run {got}, expected {' or '.join(names)} of "
                                    f"1 float64 (8 bytes) SUM on {p} ranks")
                    break
            plans = {run["args"]["plan"] for run, _ in runs}
            if len(plans) > 3:
                problems.append(f"rank {rank}: {LOOP_CALLS} calls ran {len(plans)} plans: the "
                                f"calls bound again instead of running their shape's")
        return problems

    _checked(comm, path, check)


@needs_mpirun
@pytest.mark.parametrize("algorithm", ["auto", "native"])
def test_the_environment_variable_writes_a_fresh_array_loop_at_exit(algorithm, tmp_path):
    """MPIALLREDUCE_TRACE over the loop: no file while the script runs, every call in it once
    the processes exit."""
    path = tmp_path / "loop.json"
    script = ("import os; import numpy as np; from mpi4py import MPI; "
              "import mpiallreduce as mar; comm = MPI.COMM_WORLD; "
              f"drop_in = mar.Comm(comm, algorithm={algorithm!r}); "
              "[drop_in.Allreduce(np.array([1.0 + comm.rank]), np.empty(1)) "
              f"for _ in range({LOOP_CALLS})]; comm.Barrier(); "
              f"assert not os.path.exists({str(path)!r}), 'written before exit'")
    env = {**launcher_environment(), tracing.ENV: str(path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([str(MPIRUN), "-n", "2", sys.executable, "-m", "mpi4py", "-c",
                             script], capture_output=True, text=True, timeout=120, env=env,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    problems, tracks = validate(json.loads(path.read_text()), 2)
    assert problems == []
    for rank in range(2):
        runs = outer_runs(tracks[rank])
        assert len(runs) == LOOP_CALLS
        assert {run["args"]["bytes"] for run, _ in runs} == {8}
