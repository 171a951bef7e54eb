"""python -m mpiallreduce.bench: the command (parse, agree on errors, sweep, report, exit status).

:func:`run` sweeps every size and round with the cases of :mod:`.options`, measured by
:mod:`.measure`, and prints rank 0's rows as each size finishes (:mod:`.report`); :func:`main`
wraps it in the command's contract: one error message and the same exit status on every rank.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from dataclasses import asdict

from mpi4py import MPI

import mpiallreduce as mar

from ..sizes import UsageError, human
from ..topology import RANKS_PER_NODE_ENV
from .measure import Case, Row, rank_stats, topology_for
from .options import EXIT_FAIL, EXIT_OK, EXIT_USAGE, HelpShown, Options, check_outputs, parse_args
from .report import (
    format_row,
    header_lines,
    metadata,
    plot,
    summary_lines,
    write_csv,
    write_json,
)


def run(comm, opts: Options, out=None, recorder=None) -> tuple[list[Row], list[str], bool]:
    """Measure every size and algorithm; print rows on rank 0 as each size finishes.

    ``recorder`` (--trace: a :class:`mpiallreduce.tracing.Recorder`) records the timed runs.

    Returns (rows, notes, all validations passed); rows and notes are complete on rank 0 only.
    """
    out = sys.stdout if out is None else out
    root = comm.rank == 0
    show = root and not opts.quiet
    topology = topology_for(comm, opts.ranks_per_node)
    rows: list[Row] = []
    notes = list(opts.notes)
    refused: set[tuple[str, str]] = set()  # (algorithm, reason), noted once each
    all_ok = True
    busfactor = 2 * (comm.size - 1) / comm.size
    # untimed: every case once at the first size, so that no row pays for first calls (the
    # communicator's set-up, imports, caches: even native's first 8-byte call is slower)
    warm = Case(comm, opts, opts.sizes[0])
    warm.iterations = warm.warmup = 1
    with contextlib.nullcontext() if recorder is None else recorder.paused():
        for algorithm, api, _ in opts.cases:
            warm.measure(algorithm, topology, api)
    for size in opts.sizes:
        case = Case(comm, opts, size, recorder)
        # rounds[label] = [(avg, min, max, ok), ...]: every case once per round, interleaved
        rounds: dict[str, list[tuple[float, float, float, bool]]] = {}
        lines = []
        for _ in range(opts.repeat):
            for algorithm, api, label in opts.cases:
                result = case.measure(algorithm, topology, api)
                if isinstance(result, str):
                    if (label, result) not in refused:
                        refused.add((label, result))
                        notes.append(f"{label} skipped: {result}")
                        if show:
                            lines.append(f"# {label} skipped: {result}")
                    continue
                seconds, ok = result
                all_ok &= ok
                stats = rank_stats(comm, seconds)
                if stats is not None:
                    rounds.setdefault(label, []).append((*stats, ok))
        # the reference column (native, or gloo with --against gloo)
        native = [avg for avg, *_ in rounds.get(opts.against, [])]
        for label, measured in rounds.items():
            middle = sorted(measured)[(len(measured) - 1) // 2]  # the median round (lower one)
            avg, low, high = middle[:3]
            ok = all(round_ok for *_, round_ok in measured)
            ratios = [n / m for n, (m, *_) in zip(native, measured)] if native else []
            algbw = size / avg / 1e3  # B/µs -> GB/s
            row = Row(size, case.count, label, case.iterations, case.warmup, avg, low, high,
                      algbw, algbw * busfactor,
                      statistics.median(native) / avg if native else float("nan"),
                      ("ok" if ok else "FAIL") if opts.validate else "-", len(measured),
                      min(m[0] for m in measured), max(m[0] for m in measured),
                      min(ratios, default=float("nan")), max(ratios, default=float("nan")),
                      case.picked.get(label, ""), tuple(m[0] for m in measured))
            rows.append(row)
            if show or (root and not ok):
                lines.append(format_row(row, opts.width, opts.repeat > 1))
        if lines and root:
            print("\n".join(lines), file=out, flush=True)
    return rows, notes, all_ok


def main(argv=None, comm=None, out=None) -> int:
    """Run the benchmark; return the exit status (the same on every rank)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    out = sys.stdout if out is None else out
    root = comm.rank == 0
    error = None
    try:
        opts = parse_args(argv, printing=root)
        if root:  # rank 0 alone writes files
            check_outputs(opts)
    except HelpShown:
        return EXIT_OK
    except UsageError as exc:
        error = str(exc)
    # argv is the same everywhere, so ranks agree on it; the output check is rank 0's alone.
    # Sharing the verdicts makes every rank stop together, before any other collective.
    errors = comm.allgather(error)
    if any(errors):
        if root:
            first = next(e for e in errors if e)
            print(f"python -m mpiallreduce.bench: error: {first}\n"
                  f"(python -m mpiallreduce.bench -h lists the options and their defaults)",
                  file=sys.stderr, flush=True)
        return EXIT_USAGE
    if opts.ranks_per_node is not None:
        os.environ[RANKS_PER_NODE_ENV] = str(opts.ranks_per_node)
    meta = metadata(comm, opts)
    if root and not opts.quiet:
        lines = header_lines(meta, opts.width) + [f"# note: {note}" for note in opts.notes]
        print("\n".join(lines), file=out, flush=True)
    with mar.trace(opts.trace, comm) if opts.trace else contextlib.nullcontext() as recorder:
        rows, notes, all_ok = run(comm, opts, out, recorder)
    if root:
        if not opts.quiet:
            print("\n".join(summary_lines(rows, [label for _, _, label in opts.cases],
                                          opts.against, one_node=meta["nodes"] == 1,
                                          named=opts.named)),
                  file=out, flush=True)
        failed = [r for r in rows if r.check == "FAIL"]
        if failed:
            print(f"# validation FAILED: {', '.join(f'{r.algorithm} at {human(r.size)}' for r in failed)}",
                  file=out, flush=True)
        if opts.json:
            write_json(opts.json, meta, rows, notes)
        if opts.csv:
            write_csv(opts.csv, meta, rows, notes)
        if opts.plot:
            plot([("", [asdict(r) for r in rows])], opts.plot,
                 f"allreduce, {comm.size} ranks, {opts.dtype.name} {opts.op}")
        if opts.trace and not opts.quiet:
            print(f"# trace of the timed runs: {opts.trace} (Perfetto, chrome://tracing)",
                  file=out, flush=True)
    comm.Barrier()  # files are complete before any rank returns
    return EXIT_OK if all_ok else EXIT_FAIL

