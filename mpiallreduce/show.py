"""``python -m mpiallreduce.show``: a schedule as a space-time diagram or a table (no MPI needed).

    python -m mpiallreduce.show ring --ranks 8 -o ring.svg
    python -m mpiallreduce.show cascade --ranks 8 --ranks-per-node 4 --count 16 -o cascade.png
    python -m mpiallreduce.show knomial --ranks 9 --param k=3 --text --contributions

Draws the schedule the package would run: the same builders (``algorithms``) with the same
parameters, one row per rank (grouped by node), one column per step, one arrow per message from
its sender at the start of the step to its receiver at the end, labelled with its element range;
reduces and copies are told apart by colour and line style. The caption holds every rank's
messages and bytes sent and the Thakur-Rabenseifner-Gropp cost terms of the schedule (the
critical path of :mod:`mpiallreduce.model` on a uniform network with unit α, β or γ).
``--text`` prints the same as a table; ``--contributions`` adds, after every step, the ranks
whose contributions each range of each rank holds (the verifier's symbolic execution).
Drawing needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

from . import algorithms, verify
from .schedule import LOCAL_FIRST, REDUCE, Schedule
from .topology import RANKS_PER_NODE_ENV, Topology

#: arrow colour and line style of each receive action (and the legend's words).
STYLES = {REDUCE: ("tab:red", "-", "reduce"), "copy": ("tab:blue", "--", "copy")}


@dataclass(frozen=True)
class Message:
    """One message of a schedule: a send matched with its receive."""

    step: int
    sender: int
    receiver: int
    send_range: tuple[int, int]
    recv_range: tuple[int, int]
    action: str
    order: str

    @property
    def size(self) -> int:
        return self.send_range[1] - self.send_range[0]

    @property
    def label(self) -> str:
        """The element range, ``[lo, hi)``, or ``[lo, hi)→[lo', hi')`` when it moves."""
        lo, hi = self.send_range
        if self.recv_range == self.send_range:
            return f"[{lo}, {hi})"
        return f"[{lo}, {hi})→[{self.recv_range[0]}, {self.recv_range[1]})"


def build(name: str, nranks: int, count: int, ranks_per_node: int | None = None,
          params: dict | None = None, dtype="float32", collective: str = "allreduce"
          ) -> tuple[Schedule, Topology]:
    """Build the whole schedule the package would run, and the topology its rows are grouped by.

    ``ranks_per_node`` groups consecutive ranks into nodes (default:
    ``MPIALLREDUCE_RANKS_PER_NODE``, else one node, as a run on one machine finds); algorithms
    that read a topology get it, the others are drawn on it. ``params`` are the builder's
    (``k=4``, ``inner="ring"``, ``segment_bytes=...``); the dtype's itemsize is added where the
    builder takes one, as a plan adds it.
    """
    from .model.programs import _builder_params

    algorithm = algorithms.get(name, collective)
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get(RANKS_PER_NODE_ENV) or nranks)
    topology = Topology.simulated(nranks, ranks_per_node)
    merged = dict(params or {})
    if collective == "allreduce":
        merged = _builder_params(name, np.dtype(dtype).itemsize, merged)
    elif "itemsize" in algorithm.params:
        merged.setdefault("itemsize", np.dtype(dtype).itemsize)
    schedule = algorithms.build(name, nranks, count,
                                topology=topology if algorithm.uses_topology else None,
                                collective=collective, **merged)
    return schedule, topology


def messages(schedule: Schedule) -> list[Message]:
    """Every non-empty message of ``schedule`` (the executor sends no empty ones), in step order.

    Sends and receives are paired as the verifier pairs them (:func:`verify.matched`).
    """
    found = []
    for index in range(schedule.nsteps):
        steps = [steps[index] if index < len(steps) else None for steps in schedule.ranks]
        sent, got = verify.matched(steps)
        for (sender, receiver), sends in sorted(sent.items()):
            for send, recv in zip(sends, got.get((sender, receiver), ())):
                if send.size:
                    found.append(Message(index, sender, receiver, (send.start, send.stop),
                                         (recv.start, recv.stop), recv.action, recv.order))
    return found


def totals(schedule: Schedule, itemsize: int) -> list[tuple[int, int, int, int]]:
    """Per rank: ``(messages sent, bytes sent, messages received, bytes received)``."""
    counts = [[0, 0, 0, 0] for _ in range(schedule.nranks)]
    for message in messages(schedule):
        counts[message.sender][0] += 1
        counts[message.sender][1] += message.size * itemsize
        counts[message.receiver][2] += 1
        counts[message.receiver][3] += message.size * itemsize
    return [tuple(c) for c in counts]


def cost_terms(schedule: Schedule, topology: Topology, dtype="float32") -> tuple[float, float, float]:
    """The schedule's ``(a, b, c)`` in ``T = a·α + b·nβ + c·nγ`` (Thakur, Rabenseifner & Gropp).

    Each is the critical path of :func:`mpiallreduce.model.predict` (every rank simulated) on a
    uniform network with that one parameter 1 and the others 0, so ``a`` counts message
    latencies (messages of one rank in one step share its port), ``b`` and ``c`` the bytes sent
    and reduced on the critical path, over ``n`` bytes per rank. Allreduce schedules only.
    """
    from .model import Link, Machine, predict

    itemsize = np.dtype(dtype).itemsize
    nbytes = schedule.count * itemsize
    params = {k: v for k, v in schedule.params.items()
              if k in algorithms.get(schedule.name).params}

    def unit(alpha=0.0, beta=0.0, gamma=0.0) -> float:
        link = Link(alpha, beta)
        machine = Machine(link, link, ((np.dtype(dtype).name, gamma), ("float32", gamma)))
        return predict(schedule.name, schedule.nranks, nbytes, topology, machine, dtype,
                       symmetric=False, **params).time

    per_n = nbytes or 1
    return unit(alpha=1.0), unit(beta=1.0) / per_n, unit(gamma=1.0) / per_n


def _number(value: float) -> str:
    return f"{value:.4g}"


def caption(schedule: Schedule, topology: Topology, dtype="float32",
            collective: str = "allreduce") -> list[str]:
    """The lines under a diagram (and after a table): totals and cost terms."""
    itemsize = np.dtype(dtype).itemsize
    sent = totals(schedule, itemsize)
    nmessages = sum(s[0] for s in sent)
    lines = [f"{nmessages} messages, {sum(s[1] for s in sent)} B in all; "
             f"busiest rank sends {max((s[0] for s in sent), default=0)} messages, "
             f"{max((s[1] for s in sent), default=0)} B"]
    if collective == "allreduce":
        a, b, c = cost_terms(schedule, topology, dtype)
        lines.append(f"T = {_number(a)}·α + {_number(b)}·nβ + {_number(c)}·nγ, "
                     f"n = {schedule.count * itemsize} B per rank (critical path, "
                     f"Thakur-Rabenseifner-Gropp terms)")
    return lines


def title(schedule: Schedule, topology: Topology, dtype="float32",
          collective: str = "allreduce") -> str:
    nodes = "+".join(map(str, topology.node_sizes))
    params = ", ".join(f"{k}={v}" for k, v in sorted(schedule.params.items())
                       if v is not None and v is not False and k != "itemsize")
    return (f"{schedule.name} {collective}: {schedule.nranks} ranks ({topology.nnodes} node(s) of "
            f"{nodes}), {schedule.count} × {np.dtype(dtype).name}"
            + (f", {params}" if params else ""))


def _contents(contents) -> str:
    return "-" if contents is None else repr(tuple(contents))


def _merged(segments) -> list:
    """Adjacent segments with equal contents as one (the verifier splits ranges as it goes)."""
    out: list = []
    for lo, hi, contents in segments:
        if out and out[-1][1] == lo and out[-1][2] == contents:
            out[-1] = (out[-1][0], hi, contents)
        else:
            out.append((lo, hi, contents))
    return out


def table(schedule: Schedule, topology: Topology, dtype="float32", collective: str = "allreduce",
          contributions: bool = False) -> str:
    """The schedule as text: one line per message, per-rank totals, the caption.

    With ``contributions``, after every step each rank's ranges and the ranks whose
    contributions they hold, as the verifier's symbolic execution finds them (``-``: no data).
    """
    itemsize = np.dtype(dtype).itemsize
    found = messages(schedule)
    lines = [f"# {title(schedule, topology, dtype, collective)}",
             f"# {'step':>4} {'from':>5} {'to':>5}  {'range':<24} {'elements':>8}  action"]
    after: dict[int, list] = {}
    if contributions:
        initial, expected = verify.collective_states(collective, schedule.nranks,
                                                     schedule.params.get("root", 0))
        verify.verify(schedule, initial, expected,
                      on_step=lambda index, segments: after.__setitem__(index, segments))
    for index in range(schedule.nsteps):
        for m in (m for m in found if m.step == index):
            order = ""
            if m.action == REDUCE:
                order = " (local ∘ received)" if m.order == LOCAL_FIRST else " (received ∘ local)"
            lines.append(f"  {m.step:>4} {m.sender:>5} {m.receiver:>5}  {m.label:<24} "
                         f"{m.size:>8}  {m.action}{order}")
        if contributions:
            lines.append(f"  after step {index}:")
            for rank, segments in enumerate(after[index]):
                held = "  ".join(f"[{lo}, {hi}) {_contents(c)}" for lo, hi, c in _merged(segments))
                lines.append(f"    rank {rank}: {held}")
    lines.append(f"# {'rank':>4} {'node':>5} {'sent':>6} {'bytes':>10} {'received':>8} {'bytes':>10}")
    for rank, (ms, bs, mr, br) in enumerate(totals(schedule, itemsize)):
        lines.append(f"  {rank:>4} {topology.node[rank]:>5} {ms:>6} {bs:>10} {mr:>8} {br:>10}")
    lines += [f"# {line}" for line in caption(schedule, topology, dtype, collective)]
    return "\n".join(lines) + "\n"


def _rows(topology: Topology) -> tuple[dict[int, float], list[tuple[int, float, float]]]:
    """y of every rank (rank 0 on top, a gap between nodes) and each node's (index, top, bottom)."""
    y, spans, row = {}, [], 0.0
    for node, members in enumerate(topology.members):
        top = row
        for rank in members:
            y[rank] = -row
            row += 1
        spans.append((node, -top, -(row - 1)))
        row += 0.6
    return y, spans


def draw(schedule: Schedule, topology: Topology, path: str | None = None, dtype="float32",
         collective: str = "allreduce"):
    """Draw the space-time diagram; save it to ``path`` (.svg, .png, .pdf) when given.

    Returns the matplotlib Figure. Every message is one arrow (a ``FancyArrowPatch`` with gid
    ``"message-<i>"``, an id in SVG files), so the arrows drawn are the schedule's messages.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a schedule needs matplotlib: pip install 'mpiallreduce[plot]' "
                          "(or print it with --text)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch

    itemsize = np.dtype(dtype).itemsize
    found = messages(schedule)
    nsteps = schedule.nsteps
    y, spans = _rows(topology)
    height = max(y.values()) - min(y.values()) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 1.25 * nsteps + 2.2), 1.6 + 0.45 * height + 0.8))
    for node, top, bottom in spans:
        if topology.nnodes > 1:
            ax.axhspan(bottom - 0.4, top + 0.4, color="0.93" if node % 2 == 0 else "0.97", zorder=0)
            ax.text(-0.9, (top + bottom) / 2, f"node {node}", rotation=90, ha="center",
                    va="center", fontsize=8, color="0.4")
    for k in range(nsteps + 1):
        ax.axvline(k, color="0.85", linewidth=0.6, zorder=1)
    for k in range(nsteps):
        ax.text(k + 0.5, max(y.values()) + 0.7, f"step {k}", ha="center", va="bottom", fontsize=8)
    for row in y.values():
        ax.plot([0, max(nsteps, 1)], [row, row], color="0.6", linewidth=0.8, zorder=1)
    # several messages between one pair in one step (segments) are spread out along x
    seen: dict[tuple[int, int, int], int] = {}
    for m in found:
        key = (m.step, m.sender, m.receiver)
        shift = 0.06 * seen.get(key, 0)
        seen[key] = seen.get(key, 0) + 1
        color, style, _ = STYLES.get(m.action, STYLES["copy"])
        start, end = (m.step + 0.12 + shift, y[m.sender]), (m.step + 0.88 - shift, y[m.receiver])
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=9, color=color,
                                     linestyle=style, linewidth=1.2, zorder=3, shrinkA=2, shrinkB=2,
                                     gid=f"message-{len(ax.patches)}"))
        # a third of the way along, so the labels of crossing arrows do not cover each other
        at = (start[0] + (end[0] - start[0]) * 0.35, start[1] + (end[1] - start[1]) * 0.35)
        ax.text(*at, m.label, fontsize=6, ha="center", va="center", zorder=4,
                bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none",
                      "alpha": 0.8})
    right = max(nsteps, 1) + 0.15
    sent = totals(schedule, itemsize)
    for rank, row in y.items():
        ax.text(-0.15, row, f"rank {rank}", ha="right", va="center", fontsize=8)
        ax.text(right, row, f"{sent[rank][0]} msg, {sent[rank][1]} B", ha="left", va="center",
                fontsize=7, color="0.3")
    ax.text(right, max(y.values()) + 0.7, "sent", ha="left", va="bottom", fontsize=8, color="0.3")
    ax.set_xlim(-1.2, right + 1.6)
    ax.set_ylim(min(y.values()) - 0.8, max(y.values()) + 1.3)
    ax.axis("off")
    handles = [Line2D([], [], color=color, linestyle=style, label=word)
               for color, style, word in STYLES.values()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 0.0), ncol=2, fontsize=8,
              frameon=False)
    ax.set_title(title(schedule, topology, dtype, collective), fontsize=10)
    lines = caption(schedule, topology, dtype, collective)
    fig.text(0.5, 0.01, "\n".join(lines), ha="center", va="bottom", fontsize=8)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.9, bottom=0.08 + 0.5 / (height + 3))
    if path is not None:
        _save(fig, path)
    return fig


def _save(fig, path: str) -> None:
    import matplotlib

    # reproducible SVG files (no date, fixed ids), so committed diagrams change only with schedules
    matplotlib.rcParams["svg.hashsalt"] = "mpiallreduce"
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: small files, searchable
    metadata = {"Date": None} if path.endswith((".svg", ".pdf")) else None
    fig.savefig(path, metadata=metadata)


def _params(pairs: list[str]) -> dict:
    """``["k=4", "inner=ring"]`` -> ``{"k": 4, "inner": "ring"}`` (ints where they parse)."""
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param takes NAME=VALUE, got {pair!r}")
        try:
            params[key] = int(value)
        except ValueError:
            params[key] = {"none": None, "true": True, "false": False}.get(value.lower(), value)
    return params


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpiallreduce.show",
                                     description="Draw a schedule as a space-time diagram.")
    parser.add_argument("algorithm", help="a registered algorithm (see --collective)")
    parser.add_argument("--ranks", type=int, required=True, metavar="P")
    parser.add_argument("--count", type=int, default=None, metavar="N",
                        help="elements per rank (default: 2P, every block non-empty)")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                        help=f"consecutive ranks per node (default: ${RANKS_PER_NODE_ENV}, "
                             f"else one node)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a builder parameter, e.g. k=4 or inner=ring (repeatable)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--collective", default="allreduce", choices=list(algorithms.COLLECTIVES))
    parser.add_argument("-o", "--output", metavar="FILE.svg|.png|.pdf")
    parser.add_argument("--text", action="store_true", help="print the schedule as a table")
    parser.add_argument("--contributions", action="store_true",
                        help="with --text: the ranks each range holds after every step")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    if args.count is not None and args.count < 0:
        parser.error(f"--count must be >= 0, got {args.count}")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    if args.contributions and not args.text:
        parser.error("--contributions goes with --text")
    if not args.text and not args.output:
        parser.error("give -o FILE.svg|.png|.pdf, --text, or both")
    if args.output and not args.output.endswith((".svg", ".png", ".pdf")):
        parser.error(f"-o {args.output}: the file name must end in .svg, .png or .pdf")
    count = 2 * args.ranks if args.count is None else args.count
    try:
        np.dtype(args.dtype)
        schedule, topology = build(args.algorithm, args.ranks, count, args.ranks_per_node,
                                   _params(args.param), args.dtype, args.collective)
        if args.text:
            sys.stdout.write(table(schedule, topology, args.dtype, args.collective,
                                   args.contributions))
        if args.output:
            draw(schedule, topology, args.output, args.dtype, args.collective)
    except (ValueError, TypeError, ImportError) as error:
        print(f"python -m mpiallreduce.show: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
