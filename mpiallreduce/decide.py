"""One decision over timings: does a challenger beat the incumbent beyond the noise?

The bench's advice (:func:`mpiallreduce.bench.recommendations`), tune's table
(:mod:`mpiallreduce.tune`) and ``auto``'s learning (:mod:`mpiallreduce.learn`) all answer "which
algorithm?" from the same kind of data, the times of interleaved rounds, and all answer it
here, with :func:`decide`:

- **Candidates.** Every measured name except, on one node, the algorithms built for several
  nodes (:data:`MULTI_NODE`: ``hierarchical``, ``cascade`` and their bench variants): on one
  node they run an intra-node phase that another candidate runs without their extra steps, so
  a lead they show there is noise or a stand-in's. A caller that named one explicitly keeps it,
  and it wins only by beating every one-node candidate beyond the noise too. The incumbent is
  always a candidate.
- **Statistic.** Each candidate's median over rounds. Rounds interleave the candidates, so a
  burst of load meets all of them alike; the median ignores the rounds it hit.
- **Noise.** A candidate's spread is the interquartile range of its rounds over their median
  (:func:`spread`): how far the same code moves when timed again under this machine's load.
  The interquartile range rather than the difference between two half-medians (odd and even
  rounds): it uses every round, so it cannot come out near zero by the luck of one split, and
  it ignores the outermost rounds, so one burst of load does not inflate it. It needs
  :data:`MIN_ROUNDS` rounds.
- **A win.** A challenger replaces the incumbent only if its lead, the incumbent's median over
  its own minus one, exceeds the larger of the two spreads: a lead smaller than how far either
  code moves between rounds is not a lead. Among challengers that win, the fastest median is
  picked. Nothing else replaces the incumbent: a tie, a lead within the noise, fewer rounds
  than :data:`MIN_ROUNDS`, or an incumbent whose own spread exceeds :data:`MAX_NOISE` (the
  machine is too busy to decide anything) all keep it, and the verdict says which.

The verdict is a pure function of the samples: ranks that hold the same samples (agreed with
one collective first, as learning does) reach the same verdict without another message.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: algorithms made for several nodes (their bench variants too, ``hierarchical-shm`` and the
#: like): no candidate on one node unless named explicitly.
MULTI_NODE = ("hierarchical", "cascade")
#: the fewest rounds whose spread is measured: the interquartile range of two rounds is half
#: their one difference, which says nothing about a third.
MIN_ROUNDS = 3
#: the incumbent's spread above which no lead is believed: its middle rounds then differ by
#: more than half its median, and a machine that busy cannot rank anything.
MAX_NOISE = 0.5

#: the verdict's reasons: a challenger won; the incumbent is the fastest measured (or tied);
#: it is the only candidate; a challenger led within the noise; the incumbent's own spread is
#: over :data:`MAX_NOISE`; too few rounds to measure a spread.
WIN, FASTEST, ONLY, WITHIN_NOISE, TOO_NOISY, TOO_FEW = (
    "win", "fastest", "only", "within noise", "too noisy", "too few rounds")
#: learning's own: a case whose calls are too short to repay timing candidates keeps the
#: incumbent unmeasured (:func:`mpiallreduce.select.learning_pays`)
TOO_SHORT = "too short to learn"


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` concluded.

    ``pick`` runs from now on: a challenger that won, else the incumbent. ``margin``: the
    relative lead over the incumbent (its median / the other's, minus one) of the pick if it
    won, else of the fastest challenger (NaN without one). ``noise``: the spread that lead was
    held against (NaN where none was measured). ``decided``: the measurement settles it (a win,
    the incumbent measured fastest or alone); False where the incumbent is kept because the
    measurement cannot tell (``reason`` says why).
    """

    pick: str
    incumbent: str
    margin: float
    noise: float
    decided: bool
    reason: str
    challenger: str | None = None
    rounds: int = 0

    @property
    def text(self) -> str:
        """The verdict in one phrase, as every caller prints it."""
        keep = f"keeping {self.incumbent}"
        if self.reason == WIN:
            return (f"{self.pick} beats {self.incumbent} by {percent(self.margin)} "
                    f"(noise {percent(self.noise)})")
        if self.reason == FASTEST:
            return f"{keep}: nothing measured faster (noise {percent(self.noise)})"
        if self.reason == ONLY:
            return f"{keep}: no other candidate"
        if self.reason == TOO_SHORT:
            return f"{keep}: its calls are too short to repay learning"
        if self.reason == WITHIN_NOISE:
            return (f"within noise: {keep} ({self.challenger} leads by {percent(self.margin)}, "
                    f"noise {percent(self.noise)})")
        if self.reason == TOO_NOISY:
            return (f"within noise: {keep} (its rounds spread {percent(self.noise)}, over the "
                    f"{percent(MAX_NOISE)} bound: too busy to decide)")
        return (f"within noise: {keep} ({self.rounds} round(s): no spread measured, "
                f"{MIN_ROUNDS} needed)")


def percent(value: float) -> str:
    """``0.234`` -> ``23%``, ``0.034`` -> ``3.4%``; NaN -> ``?``."""
    if math.isnan(value):
        return "?"
    return f"{100 * value:.0f}%" if abs(value) >= 0.1 else f"{100 * value:.1f}%"


def multi_node(name: str) -> bool:
    """Is ``name`` (``hierarchical``, ``cascade-p2p``, ``hierarchical/call``) made for several
    nodes?"""
    return name.split("/")[0].split("-")[0] in MULTI_NODE


def eligible(names: Iterable[str], *, one_node: bool, keep: Iterable[str] = ()) -> list[str]:
    """Return ``names`` (in order) that are candidates: all of them across nodes; on one node,
    all but the :data:`MULTI_NODE` algorithms not in ``keep`` (the incumbent, and those a
    caller named explicitly)."""
    kept = set(keep)
    return [name for name in names if not (one_node and multi_node(name) and name not in kept)]


def spread(samples: Sequence[float]) -> float:
    """Return the interquartile range of ``samples`` over their median (NaN below
    :data:`MIN_ROUNDS` samples); quartiles interpolated between the sorted samples."""
    if len(samples) < MIN_ROUNDS:
        return math.nan
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    middle = statistics.median(samples)
    return (high - low) / middle if middle > 0 else math.inf


def _bound(first: float, second: float) -> float:
    """The larger of two spreads; NaN if either was not measured."""
    return math.nan if math.isnan(first) or math.isnan(second) else max(first, second)


def _lead(base: float, other: float) -> float:
    """How much faster ``other`` is than ``base`` (medians): base / other - 1."""
    return base / other - 1 if other > 0 else math.inf


def decide(samples: Mapping[str, Sequence[float]], incumbent: str, *, one_node: bool,
           explicit: Iterable[str] = ()) -> Verdict:
    """Decide whether a challenger replaces ``incumbent`` (the module docstring gives the rule).

    Args:
        samples: name -> its time in each interleaved round (any unit, the same for all);
            values that are not finite (a candidate that never ran) are left out.
        incumbent: what runs unless beaten (native, or the current pick); must be in
            ``samples`` with at least one finite value.
        one_node: every rank on one node: the :data:`MULTI_NODE` algorithms are no candidates
            unless in ``explicit``.
        explicit: names the caller measured on purpose (a bench's ``--algorithms`` list).

    Returns:
        the :class:`Verdict`; ties between winners go to the earlier name in ``samples``.
    """
    times = {name: [t for t in values if math.isfinite(t)] for name, values in samples.items()}
    times = {name: values for name, values in times.items() if values}
    if incumbent not in times:
        raise ValueError(f"decide: the incumbent {incumbent!r} has no finite sample; measured: "
                         f"{', '.join(samples) or 'nothing'}")
    explicit = tuple(explicit)
    names = [name for name in eligible(times, one_node=one_node, keep=(incumbent, *explicit))
             if name != incumbent]
    median = {name: statistics.median(times[name]) for name in (incumbent, *names)}
    noise = {name: spread(times[name]) for name in median}
    rounds = len(times[incumbent])
    if not names:
        return Verdict(incumbent, incumbent, math.nan, noise[incumbent], True, ONLY,
                       rounds=rounds)
    fastest = min(names, key=lambda name: median[name])
    lead = _lead(median[incumbent], median[fastest])
    if rounds < MIN_ROUNDS:
        return Verdict(incumbent, incumbent, lead, math.nan, False, TOO_FEW, fastest, rounds)
    if noise[incumbent] > MAX_NOISE:
        return Verdict(incumbent, incumbent, lead, noise[incumbent], False, TOO_NOISY,
                       fastest, rounds)

    def beats(name: str, base: str) -> bool:
        # a challenger with too few rounds of its own has no spread: it cannot win
        bound = _bound(noise[base], noise[name])
        return not math.isnan(bound) and _lead(median[base], median[name]) > bound

    winners = [name for name in names if beats(name, incumbent)]
    if one_node:
        # an explicitly named multi-node algorithm must also beat the best one-node candidate
        local = min((name for name in (incumbent, *names) if not multi_node(name)),
                    key=lambda name: median[name], default=incumbent)
        winners = [name for name in winners if not multi_node(name) or beats(name, local)]
    if winners:
        pick = min(winners, key=lambda name: median[name])
        return Verdict(pick, incumbent, _lead(median[incumbent], median[pick]),
                       _bound(noise[incumbent], noise[pick]), True, WIN, pick, rounds)
    if lead > 0:
        return Verdict(incumbent, incumbent, lead, _bound(noise[incumbent], noise[fastest]),
                       False, WITHIN_NOISE, fastest, rounds)
    return Verdict(incumbent, incumbent, lead, noise[incumbent], True, FASTEST, fastest, rounds)
