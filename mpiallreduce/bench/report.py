"""The bench's report: header, table rows, closing summary and recommendation, JSON/CSV, plot.

Everything here formats what the measurement gave (:class:`~mpiallreduce.bench.measure.Row`);
only :func:`metadata` communicates (the node layout, from ``Topology.from_comm``).
"""

from __future__ import annotations

import csv
import datetime
import json
import platform
from dataclasses import asdict

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

from ..decide import FASTEST, MAX_NOISE, TOO_NOISY, WIN, WITHIN_NOISE, Verdict, decide, eligible, percent
from ..sizes import human
from ..topology import RANKS_PER_NODE_ENV, Topology
from .measure import Row
from .options import (
    GLOO,
    ITERATION_RULE,
    MPI_CALL,
    MPI_INIT,
    RECOMMEND_ROUNDS,
    Options,
)


def _layout(comm, ranks_per_node: int | None) -> tuple[str, int]:
    """Return (ranks-per-node description, number of nodes) for the header (collective)."""
    if ranks_per_node is not None:
        sizes = Topology.simulated(comm.size, ranks_per_node).node_sizes
        uneven = "" if sizes[-1] == ranks_per_node else f", last node {sizes[-1]}"
        return (f"{ranks_per_node} (simulated: {RANKS_PER_NODE_ENV}={ranks_per_node}, "
                f"{len(sizes)} node(s){uneven})"), len(sizes)
    sizes = Topology.from_comm(comm).node_sizes  # the real layout: ranks per shared-memory node
    return f"{'/'.join(map(str, sorted(set(sizes))))} (real: {len(sizes)} node(s))", len(sizes)


def metadata(comm, opts: Options) -> dict:
    """Return the run's metadata (the same on every rank except the host name)."""
    layout, nodes = _layout(comm, opts.ranks_per_node)
    return {
        "tool": "mpiallreduce.bench",
        "version": mar.__version__,
        # "Open MPI v5.0.11, package: ..." / "MPICH Version:      5.0.2": the first part, one space
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
                                .split()),
        "mpi_library_full": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": comm.size,
        "ranks_per_node": layout,
        "nodes": nodes,
        "dtype": opts.dtype.name,
        "op": opts.op,
        "in_place": opts.in_place,
        "validate": opts.validate,
        "algorithms": opts.algorithms,
        "sizes": opts.sizes,
        "iterations": (f"fixed {opts.iterations}" if opts.iterations is not None else
                       ITERATION_RULE),
        "warmup": (f"fixed {opts.warmup}" if opts.warmup is not None else
                   "iterations/10, at least 1"),
        "timer": "MPI.Wtime",
        "repeat": opts.repeat,
        "api": opts.apis,
        "trace": opts.trace,
        "against": opts.against,
    }


def header_lines(meta: dict, width: int) -> list[str]:
    """Return the ``#`` header and the column titles."""
    against = meta.get("against", "native")
    return [
        f"# {meta['tool']} {meta['version']}: allreduce latency and bandwidth (OSU-style)",
        f"# MPI: {meta['mpi_library']} (MPI {meta['mpi_standard']}); mpi4py {meta['mpi4py']}, "
        f"numpy {meta['numpy']}, Python {meta['python']}; host {meta['host']}, {meta['date']}",
        f"# ranks: {meta['ranks']}, ranks per node: {meta['ranks_per_node']}",
        f"# dtype: {meta['dtype']}, op: {meta['op']}, in place: {'yes' if meta['in_place'] else 'no'}"
        f", validation: {'on (bit for bit vs comm.Allreduce)' if meta['validate'] else 'off'}",
        f"# iterations: {meta['iterations']}; warm-up: {meta['warmup']} (untimed); rounds: "
        f"{meta.get('repeat', 1)} (algorithms interleaved; rows show the median round)",
        "# time: barrier, then the mean over iterations on each rank; avg/min/max over ranks (us)",
        "# algbw = size/avg, busbw = algbw*2(p-1)/p (GB/s, 1e9 B/s); "
        f"vs_{against} = {against} avg/avg (>1: faster than {against})",
        "#",
        f"# {'size(B)':>10} {'algorithm':<{width}} {'avg(us)':>11} {'min(us)':>11} {'max(us)':>11} "
        f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'vs_' + against:>9} check",
    ]


def format_row(row: Row, width: int, spread: bool = False) -> str:
    """Return ``row`` as a table line; ``spread``: with the rounds' spread (--repeat)."""
    line = (f"  {row.size:>10} {row.algorithm:<{width}} {row.avg_us:>11.2f} {row.min_us:>11.2f} "
            f"{row.max_us:>11.2f} {row.algbw_gbs:>11.4f} {row.busbw_gbs:>11.4f} "
            f"{row.vs_native:>9.2f} {row.check}")
    if spread:
        line += (f"  spread {row.avg_lo_us:.2f}-{row.avg_hi_us:.2f} us, "
                 f"vs_native {row.vs_native_lo:.2f}-{row.vs_native_hi:.2f}")
    return line


def _beats(row: Row, base: Row | None) -> bool:
    """Faster than the reference ``base``: by :func:`mpiallreduce.decide.decide`'s rule (beyond
    the spread of either one's rounds) from :data:`RECOMMEND_ROUNDS` rounds; with fewer, in
    every round (two), or by at least the 1% the table's two decimals can show (one)."""
    if row.repeats >= RECOMMEND_ROUNDS and base is not None:
        samples = {base.algorithm: list(base.rounds_us), row.algorithm: list(row.rounds_us)}
        return decide(samples, base.algorithm, one_node=False).pick == row.algorithm
    if row.repeats > 1:
        return row.vs_native_lo > 1
    return round(row.vs_native, 2) > 1


def _span(sizes: list[int]) -> str:
    """Return a run of sizes as "8" or "8-1K"."""
    return human(sizes[0]) if len(sizes) == 1 else f"{human(sizes[0])}-{human(sizes[-1])}"


def _runs(items: list[tuple[object, int]]) -> list[tuple[object, list[int]]]:
    """Merge consecutive (key, size) items with one key into (key, sizes)."""
    merged: list[tuple[object, list[int]]] = []
    for key, size in items:
        if merged and merged[-1][0] == key:
            merged[-1][1].append(size)
        else:
            merged.append((key, [size]))
    return merged


def _ranges(values: list[float]) -> str:
    """``[0.02, 0.05]`` -> ``2.0-5.0%``; one value (or all equal) -> ``2.0%``."""
    low, high = percent(min(values)), percent(max(values))
    return low if low == high else f"{low.rstrip('%')}-{high}"


def _advice(base_name: str, ran: str, verdicts: list[tuple[Verdict, int]]) -> str:
    """One ``# recommend`` line for consecutive sizes with the same kind of verdict."""
    first, sizes = verdicts[0][0], [size for _, size in verdicts]
    span = _span(sizes)
    what = f"{base_name} (ran {ran})" if ran != base_name else base_name
    if first.reason == WIN:
        return (f"# recommend {span}: {first.pick}, not {what}: faster beyond the noise, medians "
                f"of {first.rounds} interleaved rounds (lead / noise: "
                + ", ".join(f"{human(size)} {percent(v.margin)}/{percent(v.noise)}"
                            for v, size in verdicts) + ")")
    margins = [v.margin for v, _ in verdicts]
    noises = [v.noise for v, _ in verdicts]
    if first.reason == WITHIN_NOISE:
        leaders = ", ".join(dict.fromkeys(v.challenger for v, _ in verdicts))
        return (f"# recommend {span}: {base_name}: within noise: keeping {base_name} ({leaders} "
                f"led by {_ranges(margins)}, within the rounds' spread of {_ranges(noises)})")
    if first.reason == TOO_NOISY:
        return (f"# recommend {span}: {base_name}: within noise: keeping {base_name} (its rounds "
                f"spread {_ranges(noises)}, over the {percent(MAX_NOISE)} bound: the machine is "
                f"too busy to decide; rerun when it is idle)")
    if first.reason == FASTEST:
        return (f"# recommend {span}: {base_name}: nothing measured faster (its rounds spread "
                f"{_ranges(noises)})")
    return f"# recommend {span}: {base_name}: {first.text}"


def recommendations(rows: list[Row], *, one_node: bool = False,
                    named: tuple[str, ...] = ()) -> list[str]:
    """Return the advice: one line on what ``auto`` picked per size and its median time against
    the best measured, then ``# recommend`` lines from :func:`mpiallreduce.decide.decide` per
    size: another algorithm only where its median beat auto's by more than the spread of
    either one's rounds, else auto, saying "within noise" where the measurement cannot tell
    (native is the baseline in a run without auto). ``one_node``: every rank on one node
    (real or simulated layout), where hierarchical and cascade are weighed only if ``named``
    (``--algorithms`` named them one by one). Plan rows only: the call modes are timed against
    comm.Allreduce instead."""
    plans = [r for r in rows
             if r.algorithm not in (MPI_CALL, MPI_INIT, GLOO) and "/" not in r.algorithm]
    by_size: dict[int, dict[str, Row]] = {}
    for row in plans:
        by_size.setdefault(row.size, {})[row.algorithm] = row
    base_name = "auto" if any("auto" in mine for mine in by_size.values()) else "native"
    sizes = sorted(size for size, mine in by_size.items() if base_name in mine)
    rounds = max((by_size[size][base_name].repeats for size in sizes), default=0)
    lines = []
    if base_name == "auto":
        picks = []  # ((what auto ran, auto's time / the best's), size)
        for size in sizes:
            auto = by_size[size]["auto"]
            # the best of the candidates (on one node, not the multi-node algorithms unnamed)
            best = min(r.avg_us for name, r in by_size[size].items()
                       if eligible([name], one_node=one_node, keep=named))
            picks.append(((auto.runs or "auto", auto.avg_us / best), size))
        ratio = {size: value for (_, value), size in picks}
        parts = []
        for ran, group in _runs([(ran, size) for (ran, _), size in picks]):
            same = _runs([(f"{ratio[size]:.2f}", size) for size in group])
            parts.append(f"{ran} " + ", ".join(f"{_span(run)} {text}x" for text, run in same))
        lines.append("# auto picked (its median time / the best measured median): "
                     + "; ".join(parts))
    else:
        lines.append("# auto not measured (add it to --algorithms): the advice below takes "
                     "native as the baseline")
    if rounds < RECOMMEND_ROUNDS:
        return lines + [f"# recommend {base_name}: within noise: keeping {base_name} ({rounds} "
                        f"round(s) measure no spread: rerun with --repeat {RECOMMEND_ROUNDS} for "
                        f"a recommendation)"]
    left_out = sorted({name for size in sizes for name in by_size[size]
                       if not eligible([name], one_node=one_node, keep=named)})
    if left_out:
        lines.append(f"# left out of the advice on one node: {', '.join(left_out)} (made for "
                     f"several nodes; name them in --algorithms to weigh them)")
    verdicts = []  # ((kind, pick, what the baseline ran if it lost), (verdict, size))
    for size in sizes:
        base = by_size[size][base_name]
        ran = base.runs or base_name
        # the algorithm auto ran is the same code as auto: no challenger of it
        samples = {name: list(row.rounds_us) for name, row in by_size[size].items()
                   if name == base_name or name != ran}
        verdict = decide(samples, base_name, one_node=one_node, explicit=named)
        verdicts.append(((verdict.reason, verdict.pick, ran if verdict.reason == WIN else ""),
                         (verdict, size)))
    for (_, _, ran), group in _runs(verdicts):
        lines.append(_advice(base_name, ran or base_name, group))
    undecided = [size for _, (verdict, size) in verdicts if not verdict.decided]
    if undecided:
        lines.append(f"# within noise at {len(undecided)} of {len(sizes)} size(s): these rounds "
                     f"cannot tell the algorithms apart there; more --repeat or an idle machine "
                     f"can")
    return lines


def summary_lines(rows: list[Row], algorithms: list[str], against: str = "native", *,
                  one_node: bool = False, named: tuple[str, ...] = ()) -> list[str]:
    """Return one closing line per algorithm (mean busbw, the sizes where it beat the reference
    column, ``against``, beyond the spread, or its cost against comm.Allreduce for the call
    modes), then the advice (:func:`recommendations`; ``one_node``, ``named``: its
    arguments)."""
    repeats = max((r.repeats for r in rows), default=1)
    beyond = (f"beyond the spread of either one's {repeats} rounds" if repeats >= RECOMMEND_ROUNDS
              else f"in all {repeats} rounds" if repeats > 1
              else "by at least 1%; one round, no spread measured")
    reference = {r.size: r for r in rows if r.algorithm == against}
    lines = ["#", f"# summary: mean busbw over sizes; sizes where avg latency beat {against} "
                  f"({beyond})"]
    for name in algorithms:
        mine = [r for r in rows if r.algorithm == name]
        if not mine:
            continue
        mean = sum(r.busbw_gbs for r in mine) / len(mine)
        line = f"# {name}: mean busbw {mean:.4f} GB/s over {len(mine)} size(s)"
        if "/" in name or name in (MPI_CALL, MPI_INIT):
            base = {r.size: r.avg_us for r in rows if r.algorithm == MPI_CALL}
            ratios = [f"{human(r.size)} {r.avg_us / base[r.size]:.2f}x" for r in mine
                      if r.size in base and name != MPI_CALL]
            if ratios:
                line += f"; time / comm.Allreduce: {', '.join(ratios)}"
        elif name != against:
            wins = [f"{human(r.size)} ({r.vs_native:.2f}x)" for r in mine
                    if _beats(r, reference.get(r.size))]
            line += (f"; faster than {against} at {len(wins)} size(s): {', '.join(wins)}" if wins
                     else f"; never faster than {against}")
        lines.append(line)
    return lines + ["#"] + recommendations(rows, one_node=one_node, named=named)


def write_json(path: str, meta: dict, rows: list[Row], notes: list[str]) -> None:
    """Write metadata, notes and rows as one JSON document (--json)."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "notes": notes, "rows": [asdict(r) for r in rows]}, f, indent=1)
        f.write("\n")


def write_csv(path: str, meta: dict, rows: list[Row], notes: list[str]) -> None:
    """Write rows as CSV after ``#`` lines of metadata and notes (--csv)."""
    with open(path, "w", newline="") as f:
        for key, value in meta.items():
            f.write(f"# {key}: {value}\n")
        for note in notes:
            f.write(f"# note: {note}\n")
        writer = csv.DictWriter(f, fieldnames=list(Row.__dataclass_fields__))
        writer.writeheader()
        for row in rows:
            record = asdict(row)
            record["rounds_us"] = " ".join(f"{t:.6g}" for t in row.rounds_us)
            writer.writerow(record)


def plot(runs: list[tuple[str, list[dict]]], path: str, title: str) -> None:
    """Draw latency and busbw against size (log-2 x axis), one line per algorithm and run.

    ``runs`` holds (label suffix, rows as dicts); the sweep script passes one run per rank count.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    colors: dict[str, str] = {}  # one colour per algorithm, one line style per run
    styles = ("-", "--", ":", "-.")
    for index, (suffix, rows) in enumerate(runs):
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            color = colors.setdefault(name, f"C{len(colors) % 10}")
            mine = [r for r in rows if r["algorithm"] == name]
            sizes = [r["size"] for r in mine]
            style = {"color": color, "linestyle": styles[index % len(styles)], "marker": ".",
                     "label": f"{name}{suffix}"}
            ax_lat.plot(sizes, [r["avg_us"] for r in mine], **style)
            ax_bw.plot(sizes, [r["busbw_gbs"] for r in mine], **style)
    for ax, ylabel in ((ax_lat, "avg latency (µs)"), (ax_bw, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size per rank (B)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    ax_lat.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

