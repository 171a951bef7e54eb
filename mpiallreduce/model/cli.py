"""python -m mpiallreduce.model: predict (table, winners, plots); ``calibrate`` runs MPI and
lives in :mod:`mpiallreduce.calibrate` (``model/__main__.py`` hands that command to it)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .. import algorithms
from ..sizes import UsageError, human, parse_sizes
from ..topology import Topology
from .machine import (
    DEFAULT_MACHINE,
    INTER,
    SWITCHES,
    Machine,
    Switch,
    check_cores,
)
from .native import OMPI_FRESH_BYTES, native_algorithm
from .prediction import SHARP, candidates, predict


def _sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except UsageError as error:
        raise ValueError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpiallreduce.model",
        description="Alpha-beta-gamma cost model of the mpiallreduce schedules.")
    sub = parser.add_subparsers(dest="command", required=True)
    pred = sub.add_parser("predict", help="predict every algorithm's time per size (no MPI ranks)")
    pred.add_argument("--ranks", type=_positive_int, required=True, metavar="P")
    pred.add_argument("--ranks-per-node", type=_positive_int, default=None, metavar="K",
                      help="consecutive ranks per node (default: all on one node)")
    pred.add_argument("--nodes-per-site", type=_positive_int, default=None, metavar="N",
                      help="consecutive nodes per site (or rack): a level above the nodes, whose "
                           "messages take the machine file's first level link (\"levels\")")
    pred.add_argument("--sizes", default="8:1G", metavar="MIN:MAX",
                      help="bytes per rank, every power of two in between (K/M/G; default 8:1G)")
    pred.add_argument("--algorithms", default="all", metavar="LIST",
                      help="comma list of algorithms (default: all, native included)")
    pred.add_argument("--dtype", default="float32")
    pred.add_argument("--machine", metavar="FILE.json",
                      help="machine from calibrate (default: the built-in machine)")
    pred.add_argument("--cores-per-node", type=_positive_int, default=None, metavar="C",
                      help="cores of a node (default: the machine file's \"cores\", unchecked "
                           "if absent); more ranks per node than cores is refused")
    pred.add_argument("--switch", choices=sorted(SWITCHES), default=None,
                      help="add in-network reduction (modelled only, parameters printed and "
                           "cited) and the algorithm 'sharp' that uses it")
    pred.add_argument("--in-place", action="store_true",
                      help="predict sendbuf = MPI.IN_PLACE (the executor's scratch copies, "
                           "Open MPI's copies in place)")
    pred.add_argument("--intra", choices=("auto", "shm", "p2p"), default="auto",
                      help="hierarchical and cascade's intra-node phase: auto (as the library "
                           "runs them: shared memory where a node holds two ranks or more), "
                           "shm, or p2p (the point-to-point schedule)")
    pred.add_argument("--non-commutative", action="store_true",
                      help="predict for a non-commutative op (algorithms that reorder are left out)")
    pred.add_argument("--plot", metavar="FILE.png",
                      help="draw time against size, and against ranks at --plot-size")
    pred.add_argument("--plot-size", default=None, metavar="SIZE",
                      help="size for the time-against-ranks panel (default: the largest)")
    sub.add_parser("calibrate", add_help=False,
                   help="measure this machine under mpirun -n 2 (mpiallreduce.calibrate: -o "
                        "FILE.json [--inter-alpha S] [--inter-beta S_PER_B])")
    return parser


def _algorithms(text: str, commutative: bool, machine: Machine | None = None) -> list[str]:
    known = candidates(commutative)
    if commutative and machine is not None and machine.switch is not None:
        known.append(SHARP)
    if text.strip() == "all":
        return known
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name == SHARP and SHARP not in known:
            raise ValueError("sharp is the modelled in-network reduction: give it a switch "
                             "(--switch sharp-llt or sharp-sat) and a commutative op")
        if name not in known:
            raise ValueError(f"unknown or refusing algorithm {name!r} in --algorithms; choose "
                             f"from {', '.join(known)}")
    return names


def predict_table(nranks: int, ranks_per_node: int | None, sizes: Sequence[int],
                  names: Sequence[str], machine: Machine, dtype="float32",
                  commutative: bool = True, in_place: bool = False,
                  intra: str = "auto", nodes_per_site: int | None = None) -> list[dict]:
    """Return one row per (size, algorithm): time, busbw, winner flag (the fastest of the
    size, native included), messages, bytes between nodes (every link class above the
    node's); ``intra`` for the algorithms that take it (hierarchical, cascade);
    ``nodes_per_site``: a level of consecutive nodes above them."""
    topology = Topology.simulated(nranks, ranks_per_node or nranks, nodes_per_site)
    itemsize = np.dtype(dtype).itemsize
    rows = []
    for size in sizes:
        if size < itemsize:
            continue
        found = []
        for name in names:
            accepted = getattr(algorithms.REGISTRY.get(name), "params", {})
            params = ({"ordered": True} if not commutative and (name == "native"
                                                                or "ordered" in accepted) else {})
            if "intra" in accepted:
                params["intra"] = intra
            try:
                found.append(predict(name, nranks, size, topology, machine, dtype,
                                     in_place=in_place, **params))
            except ValueError as error:
                rows.append({"size": size, "algorithm": name, "skipped": str(error)})
        # the winner is the fastest row, native included, so the star agrees with vs_native;
        # on a tie native wins (nothing is gained by leaving MPI's own Allreduce)
        best = (min(found, key=lambda p: (p.time, p.name != "native")).name if found
                else None)
        native = next((p.time for p in found if p.name == "native"), None)
        for result in found:
            rows.append({"size": size, "algorithm": result.name, "time_us": result.time * 1e6,
                         "busbw_gbs": result.busbw / 1e9, "steps": result.steps,
                         "vs_native": native / result.time if native and result.time else None,
                         "inter_bytes_per_rank": sum(result.link_bytes[INTER:]) / nranks,
                         "winner": result.name == best, "partition": result.partition})
    return rows


def _plot(path: str, rows: list[dict], nranks: int, ranks_per_node: int | None,
          names: Sequence[str], plot_size: int, machine: Machine, dtype) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_size, ax_ranks) = plt.subplots(1, 2, figsize=(13, 5))
    for index, name in enumerate(names):
        mine = [r for r in rows if r["algorithm"] == name and "time_us" in r]
        ax_size.plot([r["size"] for r in mine], [r["time_us"] for r in mine], marker=".",
                     color=f"C{index % 10}", label=name)
    step = ranks_per_node or 1
    counts = sorted({step * (1 << k) for k in range(max(1, nranks // step).bit_length())
                     if step * (1 << k) <= nranks} | {nranks})
    for index, name in enumerate(names):
        times = []
        for count in counts:
            topology = Topology.simulated(count, ranks_per_node or count)
            try:
                times.append(predict(name, count, plot_size, topology, machine, dtype).time * 1e6)
            except ValueError:
                times.append(float("nan"))
        ax_ranks.plot(counts, times, marker=".", color=f"C{index % 10}", label=name)
    ax_size.set_xlabel("bytes per rank")
    ax_ranks.set_xlabel(f"ranks ({ranks_per_node or 'all'} per node), {human(plot_size)} per rank")
    for ax in (ax_size, ax_ranks):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("predicted time (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"mpiallreduce.model: {nranks} ranks, {ranks_per_node or nranks} per node, "
                 f"{dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_predict(opts, out) -> int:
    machine = Machine.load(opts.machine) if opts.machine else DEFAULT_MACHINE
    if opts.cores_per_node is not None:
        machine = replace(machine, cores=opts.cores_per_node)
    if opts.ranks_per_node is not None and opts.ranks_per_node > opts.ranks:
        raise ValueError(f"--ranks-per-node {opts.ranks_per_node} exceeds --ranks {opts.ranks}")
    check_cores(opts.ranks_per_node or opts.ranks, machine)
    try:
        dtype = np.dtype(opts.dtype)
    except TypeError:
        raise ValueError(f"--dtype {opts.dtype!r} is not a NumPy dtype") from None
    sizes = _sizes(opts.sizes)
    if opts.switch:
        machine = replace(machine, switch=SWITCHES[opts.switch])
    names = _algorithms(opts.algorithms, not opts.non_commutative, machine)
    start = time.perf_counter()
    if opts.nodes_per_site is not None and not machine.levels:
        raise ValueError("--nodes-per-site needs a machine file with \"levels\" (the link "
                         "between sites): without one every message between nodes takes inter")
    rows = predict_table(opts.ranks, opts.ranks_per_node, sizes, names, machine, dtype,
                         not opts.non_commutative, opts.in_place, opts.intra,
                         opts.nodes_per_site)
    source = machine.info.get("host") or machine.info.get("source", "")
    print(f"# mpiallreduce.model: {opts.ranks} ranks, {opts.ranks_per_node or opts.ranks} per "
          f"node, {dtype.name}; machine: {opts.machine or 'built-in'} ({source})", file=out)
    print(f"# intra alpha {machine.intra.alpha * 1e6:.2f} us, beta {machine.intra.beta:.3g} s/B; "
          f"inter alpha {machine.inter.alpha * 1e6:.2f} us, beta {machine.inter.beta:.3g} s/B; "
          f"gamma {machine.gamma_for(dtype):.3g} s/B; step {machine.step * 1e6:.2f} us; "
          f"request {machine.request * 1e6:.2f} us; combine {machine.combine * 1e6:.2f} us; "
          f"call {machine.call * 1e6:.2f} us"
          + ("; measured link curves" if machine.intra.curve or machine.inter.curve else ""),
          file=out)
    for name, link in machine.levels:
        print(f"# level {name}: alpha {link.alpha * 1e6:.2f} us, beta {link.beta:.3g} s/B"
              + (f" ({opts.nodes_per_site} nodes per {name})" if opts.nodes_per_site else
                 " (unused: no --nodes-per-site)") + f"; source: "
              f"{machine.info.get('levels_source', 'the machine file')}", file=out)
    print("# busbw = size/time*2(p-1)/p (GB/s); vs_native = native/time; * marks the fastest "
          "of the size, native included", file=out)
    print(f"# native: Open MPI 5.0 coll/tuned's fixed decision table in C ("
          f"{_native_ranges(opts.ranks, sizes, dtype)}), plus its per-call copy of the message "
          f"and mpi4py's call ({machine.native_call * 1e6:.2f} us), no interpreter terms"
          + (f"; from {OMPI_FRESH_BYTES >> 20} MiB its fresh temporary's first writes "
             f"({machine.fault * 1e9:.3f} ns/B)" if machine.fault else ""),
          file=out)
    print(f"# hierarchical, cascade: intra-node phase {opts.intra}"
          + (" (shared memory where a node holds two ranks or more, as the library runs them)"
             if opts.intra == "auto" else "")
          + f"; shm per call small {machine.shm_small * 1e6:.2f} us"
          + (f" (+{machine.shm_call * 1e6:.2f} us where it calls NumPy's reduce)"
             if machine.shm_call is not None else "")
          + f", large {machine.shm_large * 1e6:.2f} us, peer reads {machine.shm_peer:.3g} s/B, "
            f"node bandwidth {machine.node_bandwidth / 1e9:.1f} GB/s", file=out)
    if machine.switch is not None:
        _print_switch(machine.switch, opts.ranks, opts.ranks_per_node or opts.ranks, out)
    print(f"#{'size(B)':>11} {'algorithm':<20} {'time(us)':>14} {'busbw(GB/s)':>12} "
          f"{'vs_native':>9} {'steps':>6} {'inter(B)/rank':>14} best", file=out)
    for row in rows:
        if "skipped" in row:
            print(f"# {row['size']} {row['algorithm']}: skipped ({row['skipped']})", file=out)
            continue
        print(f"{row['size']:>12} {row['algorithm']:<20} {row['time_us']:>14.2f} "
              f"{row['busbw_gbs']:>12.4f} {row['vs_native'] or 0:>9.2f} {row['steps']:>6} "
              f"{row['inter_bytes_per_rank']:>14.0f} "
              f"{'*' if row['winner'] else ''}", file=out)
    winners: list[tuple[str, int, int]] = []
    for row in rows:
        if row.get("winner"):
            if winners and winners[-1][0] == row["algorithm"]:
                winners[-1] = (row["algorithm"], winners[-1][1], row["size"])
            else:
                winners.append((row["algorithm"], row["size"], row["size"]))
    print("# winners: " + "; ".join(f"{_span(lo, hi)} {name}" for name, lo, hi in winners),
          file=out)
    if SHARP in names:
        print(_sharp_summary(rows), file=out)
    print(f"# predicted in {time.perf_counter() - start:.1f} s", file=out)
    if opts.plot:
        plot_size = _sizes(opts.plot_size)[0] if opts.plot_size else sizes[-1]
        _plot(opts.plot, rows, opts.ranks, opts.ranks_per_node, names, plot_size, machine, dtype)
    return 0


def _span(lo: int, hi: int) -> str:
    """A range of sizes: ``8..2K``, or ``32K`` alone."""
    return human(lo) if lo == hi else f"{human(lo)}..{human(hi)}"


def _ratios(low: float, high: float) -> str:
    """Ratios as ``0.25-0.99x``, or ``1.2x`` where both round alike."""
    return f"{low:.2g}x" if f"{low:.2g}" == f"{high:.2g}" else f"{low:.2g}-{high:.2g}x"


def _native_ranges(nranks: int, sizes: Sequence[int], dtype) -> str:
    """What native runs over ``sizes``, as ranges: ``8..2K recursive_doubling; 4K.. ring``."""
    runs: list[list] = []
    for size in sizes:
        name = native_algorithm(nranks, size, np.dtype(dtype).itemsize)
        if runs and runs[-1][0] == name:
            runs[-1][2] = size
        else:
            runs.append([name, size, size])
    return "; ".join(f"{_span(lo, hi)} {name}" for name, lo, hi in runs)


def _print_switch(switch: Switch, nranks: int, per_node: int, out) -> None:
    nnodes = -(-nranks // per_node)
    print(f"# switch {switch.name} (MODELLED ONLY: no machine here has a switch that reduces): "
          f"alpha {switch.alpha * 1e6:.2f} us per operation, {switch.hop * 1e6:.4f} us per "
          f"level and direction, beta {switch.beta:.3g} s/B, {switch.limit} B per operation "
          f"(+{switch.chunk * 1e6:.4f} us per extra one), radix {switch.radix}: "
          f"{switch.levels(nnodes)} levels over {nnodes} nodes", file=out)
    print(f"# switch source: {switch.source}", file=out)
    print("# sharp: binomial reduce to a leader per node, one in-network allreduce among the "
          "leaders (split into operations of the size limit), binomial broadcast in the node",
          file=out)


def _sharp_summary(rows: list[dict]) -> str:
    """One line: the size ranges where sharp beats both cascade and hierarchical, with ratios."""
    by_size: dict[int, dict[str, float]] = {}
    for row in rows:
        if "time_us" in row:
            by_size.setdefault(row["size"], {})[row["algorithm"]] = row["time_us"]
    runs: list[list] = []  # [wins, first size, last size, lowest ratio, highest ratio]
    for size, times in sorted(by_size.items()):
        rivals = [times[name] for name in ("cascade", "hierarchical") if name in times]
        if SHARP not in times or not rivals:
            continue
        ratio = times[SHARP] / min(rivals)
        wins = ratio < 1
        if runs and runs[-1][0] == wins:
            run = runs[-1]
            run[2], run[3], run[4] = size, min(run[3], ratio), max(run[4], ratio)
        else:
            runs.append([wins, size, size, ratio, ratio])
    parts = [f"{'wins' if wins else 'loses'} {_span(lo, hi)} ({_ratios(low, high)})"
             for wins, lo, hi, low, high in runs]
    return ("# sharp against the faster of cascade and hierarchical (time ratio): "
            + ("; ".join(parts) if parts else "not compared (cascade/hierarchical not run)"))


def main(argv=None, out=None) -> int:
    """Run the command line; return the exit status (0, or 2 for bad input)."""
    out = sys.stdout if out is None else out
    opts = build_parser().parse_args(argv)
    try:
        if opts.command == "predict":
            return _run_predict(opts, out)
        raise ValueError("calibrate runs MPI: mpirun -n 2 python -m mpi4py -m "
                         "mpiallreduce.model calibrate -o FILE.json (or mpiallreduce.calibrate)")
    except (ValueError, TypeError, OSError) as error:
        print(f"python -m mpiallreduce.model {opts.command}: error: {error}", file=sys.stderr)
        return 2
