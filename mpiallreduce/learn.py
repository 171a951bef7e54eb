"""``auto`` learns on the machine at hand: time the leading candidates, agree, keep the fastest.

Unless ``MPIALLREDUCE_LEARN=off`` (:func:`.select.learn_settings`), a repeated ``auto``
allreduce (a cached call, or a plan's runs) is learned per *case* of its communicator:
(power-of-two size bucket, in place or not, op commutative, whether MPI saturates the op on the
dtype, dtype, topology passed). The case's first call runs the rules' choice, outside learning
(a call made once pays nothing for it). At its second, the candidates are named: none but the
rules' choice where the calls are too short to repay learning
(:func:`.select.learning_pays`: the case then keeps the rules' choice, unmeasured); else the
rules' choice first, then :func:`.select.learn_candidates`' native, ``shm`` on one node and the
model's leading schedules, as many as :func:`budget` fits in :data:`.select.LEARN_CALLS` calls.
The case's :class:`Record` then hands its calls to the candidates in turn, two calls in a row
each: an untimed one, which brings the candidate's buffers, windows and connections back into
the caches after the other candidates' calls (the first also touches its pages), then a timed
one. So each candidate is timed warm, as a repeated call runs it; rounds interleave, so a
burst of load hits every candidate alike. (Timed straight after another candidate's call,
``shm`` in place at 256 KiB-2 MiB lost to native and the ring, which it beats when repeated: a
cold call does not price a repeated one.) A first round over every candidate screens them: one
``Allreduce(MAX)`` makes its times the slowest rank's and the rules' choice and the fastest
others (:data:`.select.LEARN_FINALISTS` in all) run the remaining rounds. A one-shot call's
candidate is timed with the argument check it will pay once bound (one more check, except for
``shm``, whose run checks the arguments itself). After the last round, one ``Allreduce(MAX)``
on the private communicator makes every finalist's time in every round the slowest rank's, and
:func:`mpiallreduce.decide.decide` judges those rounds with the rules' choice as the incumbent:
a candidate replaces it only if its median beats the rules' choice by more than the spread of
either one's rounds. The same bits on every rank, so the same verdict, by construction. Where
the measurement cannot tell (a lead within the noise, fewer than
:data:`mpiallreduce.decide.MIN_ROUNDS` runs, a machine too busy), the rules' choice stays and
the case's record says "within noise" (:func:`learned`). On one node ``hierarchical`` and
``cascade`` are never candidates.

Every rank makes the same calls on a communicator in the same order (MPI's rule), so each
case's count of calls, and with it the candidate a call runs and the calls that screen and
decide, is the same on every rank, whatever each rank's call cache holds. Calls with a deadline
(``timeout=``) are never timed: they run the learned choice, or the rules' while learning.
Once decided (and unless re-learning is on), every rank replaces the case's learning entries in
its call cache with entries of the winner's plan, built while learning (or drops them where it
was not built there), so the hot path is the winner's own. A plan (``mar.plan``) learns in its
own runs and then runs the winner's ``run`` itself. ``MPIALLREDUCE_RELEARN_EVERY=N`` times the
case again after N further calls (the learning plan stays in the path then, at the cost of a
counter per call).

Kept across jobs: each decision is written down per machine fingerprint (:mod:`.picks`), and
a communicator's first learning case reads the picks of earlier jobs (collective: rank 0
reads, one broadcast), so a case decided before runs its pick with no learning call.

Cost: at most :data:`.select.LEARN_CALLS` calls of a case run the candidates (each call one run
of one of them, plus a timer), plus two small ``Allreduce`` calls; :func:`learned` reports the
calls and seconds each case took. :func:`save` writes what was learned as a measured table
(:mod:`.select`'s format).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics

import numpy as np
from mpi4py import MPI

from . import decide, select
from ._agree import Signature, agree
from ._checks import ALGORITHMS
from ._state import state as comm_state
from .executor import _PlanBase

#: what :func:`resolve` returns while a case is being learned: build a :class:`Learner`.
LEARNING = "learn"
#: the calls that learn (blocking allreduce calls and plans; non-blocking ones use the rules).
LEARNS = ("allreduce", "plan")
#: untimed calls of a candidate right before each of its timed ones (its caches warmed).
WARM_UPS = 1

class Record:
    """One case's learning: its candidates, this rank's timings, the agreed choice."""

    def __init__(self, key: tuple, candidates, ruled: str, runs: int,
                 relearn: int, one_node: bool = False, memory=None, nranks: int = 0):
        """``candidates``: the names, or a function that returns them, asked at the case's
        first learning call (its second: a case called once never pays for ranking them). ``memory``: the
        communicator's :class:`.picks.Memory` where decisions are kept, else None."""
        self.key = key
        self._propose = candidates if callable(candidates) else None
        self.candidates = [ruled] if callable(candidates) else list(candidates)
        self.memory, self.nranks = memory, nranks
        self.remembered = False  # decided by an earlier job (picks.Memory), nothing timed
        self.seen = False  # the case's first call ran (the rules' choice, outside learning)
        # the rules' choice: the incumbent of the decision, and what runs with a deadline
        # until the case is decided
        self.ruled = ruled
        self.runs, self.relearn = runs, relearn
        self.one_node = one_node
        self.winner: str | None = None
        self.verdict: decide.Verdict | None = None  # the last decision's
        self.agreed: dict[str, float] = {}  # median seconds per run over rounds, slowest rank
        self.rounds = 0  # decisions made
        self.learning_calls = 0  # calls that ran a candidate, every round
        self.cost = 0.0  # seconds this rank spent in them
        self.since = 0  # calls since the decision (re-learning)
        self._restart()

    def _restart(self) -> None:
        self.winner = None
        self.calls = 0
        self._screened = False
        self.screened: dict[str, float] = {}  # the first round's agreed times, every candidate
        self.samples: dict[str, list[float]] = {name: [] for name in self.candidates}

    @property
    def screening(self) -> bool:
        """Whether the calls now run the first round, after which only the finalists go on."""
        return not self._screened and self.runs > 1 \
            and len(self.candidates) > select.LEARN_FINALISTS

    @property
    def total(self) -> int:
        """Calls of this stage: a warm-up and a timed call per candidate, one round while
        screening, the remaining rounds after it, or all ``runs`` without one."""
        rounds = 1 if self.screening else self.runs - 1 if self._screened else self.runs
        return len(self.candidates) * rounds * (WARM_UPS + 1)

    def screen(self, comm: MPI.Intracomm) -> list[str]:
        """After the first round: keep the rules' choice and the fastest others, as many as
        :data:`.select.LEARN_FINALISTS` in all, on every rank alike (the round's times made the
        slowest rank's first: collective). Returns the candidates dropped."""
        names = self.candidates
        agreed = slowest(comm, [self.samples[name][0] for name in names])
        self.screened = dict(zip(names, agreed.tolist()))
        others = sorted((time_, index) for index, (name, time_) in enumerate(zip(names, agreed))
                        if name != self.ruled)
        kept = {self.ruled, *(names[index]
                              for _, index in others[:select.LEARN_FINALISTS - 1])}
        self.candidates = [name for name in names if name in kept]
        self.samples = {name: self.samples[name] for name in self.candidates}
        self.calls = 0
        self._screened = True
        return [name for name in names if name not in kept]

    def due(self) -> tuple[str, bool]:
        """The candidate this call runs, and whether it is timed (the last of its calls in a
        row: the ones before warm it up). The candidates are named at the first learning call
        (the case's second), inside a warm-up: the ranks finish naming them before anything
        is timed."""
        if self._propose is not None:
            self.expand()
        block, within = divmod(self.calls, WARM_UPS + 1)
        return self.candidates[block % len(self.candidates)], within == WARM_UPS

    def expand(self) -> None:
        """Name the candidates (the first learning call); a case whose calls are too short
        to repay learning (:func:`.select.learning_pays`, asked by ``_propose``) gets none
        but the rules' choice, and is settled at once: it keeps it, unmeasured."""
        names = self._propose()
        self._propose = None
        self.candidates = [self.ruled] if names is None else list(names)
        self.samples = {name: self.samples.get(name, []) for name in self.candidates}
        if names is None:
            self.settle_short()

    def settle_short(self) -> None:
        """Keep the rules' choice, unmeasured: the case's calls are too short to learn."""
        self.candidates, self._propose = [self.ruled], None
        self.verdict = decide.Verdict(self.ruled, self.ruled, float("nan"), float("nan"),
                                      False, decide.TOO_SHORT)
        self.winner = self.ruled

    def ran(self, name: str, seconds: float, timed: bool) -> None:
        self.calls += 1
        self.learning_calls += 1
        self.cost += seconds
        if timed:
            self.samples[name].append(seconds)

    def exclude(self, name: str) -> None:
        """Drop a candidate that refused the case (the same on every rank: the arguments say)."""
        if name != self.ruled and name in self.candidates:
            self.candidates.remove(name)
            self._restart()  # the round again, without it

    def decide(self, comm: MPI.Intracomm) -> str:
        """Agree on the rounds, then decide (collective: every rank calls it at the same call).

        Every rank's time of each candidate in each round becomes the slowest rank's (one
        ``Allreduce(MAX)``), so every rank judges the same bits with
        :func:`mpiallreduce.decide.decide` and reaches the same verdict."""
        names = self.candidates
        rounds = min(len(self.samples[name]) for name in names)
        agreed = slowest(comm, [[self.samples[name][index] for name in names]
                                for index in range(rounds)])
        times = {name: agreed[:, column].tolist() for column, name in enumerate(names)}
        self.verdict = decide.decide(times, self.ruled, one_node=self.one_node)
        self.winner = self.verdict.pick
        self.agreed = {name: statistics.median(values) for name, values in times.items()}
        self.rounds += 1
        self.since = 0
        if self.memory is not None:
            self.memory.put(self.nranks, self.key, self.verdict, self.agreed)
        return self.winner

    def recall(self, entry: dict) -> None:
        """Take an earlier job's decision (:meth:`.picks.Memory.get`): decided, nothing timed."""
        from .picks import verdict_of

        self.verdict = verdict_of(entry)
        self.winner = self.verdict.pick
        self.agreed = {name: t / 1e6 for name, t in entry.get("agreed_us", {}).items()}
        self.candidates = list(self.agreed) or [self.ruled]
        self._propose = None
        self.remembered = True

    def counted(self) -> None:
        """A call ran the winner with re-learning on: time the case again when it is due."""
        self.since += 1
        if self.since >= self.relearn:
            self._restart()

    def report(self) -> dict:
        bucket, in_place, commutative, deviates, dtype, _ = self.key
        verdict = self.verdict
        return {"bytes": bucket, "in_place": in_place, "commutative": commutative,
                "dtype": np.dtype(dtype).name, "candidates": list(self.candidates),
                "ruled": self.ruled, "winner": self.winner,
                "decided": None if verdict is None else verdict.decided,
                "verdict": None if verdict is None else verdict.text,
                "agreed_us": {name: round(1e6 * t, 3) for name, t in self.agreed.items()},
                "screened_us": {name: round(1e6 * t, 3) for name, t in self.screened.items()},
                "learning_calls": self.learning_calls, "learning_seconds": self.cost,
                "rounds": self.rounds, "remembered": self.remembered}


def slowest(comm: MPI.Intracomm, seconds) -> np.ndarray:
    """Every element of ``seconds`` (this rank's times) as the slowest rank's: one
    ``Allreduce(MAX)`` (exact: every rank gets the same bits). Collective."""
    times = np.array(seconds, dtype=np.float64)
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return times


def case(call) -> tuple:
    """The case of a call: (size bucket, in place, commutative, MPI deviates, dtype, topology)."""
    nbytes = call.recv.nbytes
    return (1 << (max(nbytes, 1).bit_length() - 1), call.send is None,
            call.reducer.commutative,
            select.native_deviates_for(call.reducer.name, call.recv.dtype.str),
            call.recv.dtype.str, call.topology)


def records(state) -> dict:
    """The learning records of a communicator's state, by case (``CommState.learned``)."""
    return state.learned


def resolve(state, call, nranks: int, ruled: str, what: str, shared: bool, topology,
            deadline: float | None = None) -> str:
    """What ``auto`` runs for ``call`` given the rules' choice ``ruled``: ``ruled`` where
    nothing learns, the case's learned (or remembered) choice, or :data:`LEARNING` (bind a
    :class:`Learner`). ``topology()``: the call's topology, else the communicator's (asked once
    per case; collective the first time on a communicator, as ``auto``'s first call is
    everywhere). The first case of a communicator reads the kept picks (:func:`.picks.load`,
    collective: every rank reaches it at the same call; not with a ``deadline``, which a
    broadcast could not keep: such a case is learned without the kept picks)."""
    settings = select.learn_settings()
    if not settings.on or what not in LEARNS or shared or nranks < 2 \
            or call.recv.size == 0 or call.reducer is None or call.collective != "allreduce":
        return ruled
    cases = records(state)
    key = case(call)
    record = cases.get(key)
    if record is None:
        single = topology().nnodes == 1
        memory = None
        if call.topology is None:  # a case of the communicator's own layout: kept across jobs
            memory = state.memory
            if memory is None and deadline is None:
                from . import picks

                memory = state.memory = picks.load(state.private, topology().node_sizes)
        # (the candidates from the call's facts, not the call: a case called once keeps no
        # caller's array alive)
        facts = (nranks, call.recv.nbytes, call.reducer, call.send is None, single, ruled,
                 call.recv.dtype.str, call.topology)
        record = cases[key] = Record(
            key, lambda: _candidates(facts, settings.runs), ruled,
            settings.runs, settings.relearn, one_node=single, memory=memory, nranks=nranks)
        entry = None if memory is None else memory.get(nranks, key, ruled)
        if entry is not None:
            record.recall(entry)
        elif key[0] < select.LEARN_FLOOR_BYTES:
            # too short by its size alone: the rules' plan from the first call, no learning
            # plan in its path and nothing asked of the model
            record.settle_short()
    if record.winner is not None and not record.relearn:
        return record.winner
    return LEARNING


def _candidates(facts: tuple, runs: int) -> tuple[str, ...] | None:
    """What a case times: :func:`.select.learn_candidates` of ``facts`` (its arguments),
    without (on one node) algorithms made for several nodes, as many as :func:`budget` fits;
    None where its calls are too short to repay learning (:func:`.select.learning_pays`)."""
    nranks, nbytes, _, in_place, single, ruled, dtype, topology = facts
    if not select.learning_pays(nranks, nbytes, ruled, dtype, in_place, topology):
        return None
    names = select.learn_candidates(*facts)
    names = tuple(decide.eligible(names, one_node=single, keep=(ruled,)))
    return names[:budget(runs)[0]]


def budget(runs: int) -> tuple[int, int]:
    """(candidates, calls) of one learning at ``runs`` rounds within :data:`.select.LEARN_CALLS`
    calls: where a first round over more candidates than :data:`.select.LEARN_FINALISTS` still
    leaves the finalists their other rounds, that many are screened (up to
    :data:`.select.LEARN_CANDIDATES`); else as many as get every round (two at least: the
    rules' choice and one challenger). Screening widens the net where the model ranks several
    schedules alike: the one that wins on this machine is often not among its top three."""
    pair, finalists = WARM_UPS + 1, select.LEARN_FINALISTS
    if runs > 1:
        screened = min((select.LEARN_CALLS - finalists * (runs - 1) * pair) // pair,
                       select.LEARN_CANDIDATES)
        if screened > finalists:
            return screened, screened * pair + finalists * (runs - 1) * pair
    fits = max(2, select.LEARN_CALLS // (runs * pair))
    return fits, fits * runs * pair


def calls_to_decide() -> int:
    """The most calls a case of ``auto`` spends learning with the present settings (0 with
    learning off): a benchmark warms ``auto`` up this long so that it times the pick."""
    settings = select.learn_settings()
    return budget(settings.runs)[1] if settings.on else 0


def record_of(state, call) -> Record:
    return records(state)[case(call)]


class Learner:
    """A plan that learns its case (:class:`Record`): each run is one candidate's run, timed;
    once the case is decided, the winner's. Behind the plan interface (``run``, ``start``,
    ``wait``, ``free``, ``nbytes``); ``bind(algorithm=name)`` binds a candidate for the same
    buffers (on first use: every rank reaches it at the same call of the case)."""

    traced = False

    def __init__(self, state, call, bind, explicit: bool = True, entry=None):
        """``entry(plan, objects)``: the call cache's entry of this call with ``plan`` bound
        (:func:`forget` hands the winner's plan over through it)."""
        self._state = state
        self._entry = entry
        self.record = record_of(state, call)
        self._bind = bind
        # a one-shot call pays the argument check before its run, except where the run is
        # shm's (which checks them itself): its candidates are timed with one check each
        self._check = None if explicit else Signature(call.signature(None))
        self.comm = state.private
        self.sendbuf, self.recvbuf, self.reducer = call.send, call.recv, call.reducer
        # a plan's default timeout (mar.plan(timeout=...)): its runs then never learn
        self.timeout = getattr(bind, "keywords", {}).get("timeout")
        self._plans: dict = {}
        self._freed = False
        self._done = self._request = None  # (the starter's, as for every plan without steps)

    @property
    def algorithm(self) -> str:
        return self.record.winner or "auto"

    @property
    def nbytes(self) -> int:
        return sum(plan.nbytes for plan in self._plans.values())

    def plan_of(self, name: str):
        plan = self._plans.get(name)
        if plan is None:
            plan = self._plans[name] = self._bind(algorithm=name)
        return plan

    def run(self, timeout: float | None = None) -> np.ndarray:
        """Run the case's candidate due now (timed), or its winner; with ``timeout``, the
        winner or the rules' choice, untimed."""
        if self._freed:
            raise ValueError("this plan has been freed")
        record = self.record
        if timeout is not None or self.timeout is not None:
            return self.plan_of(record.winner or record.ruled).run(timeout)
        if record.winner is not None:
            if not record.relearn:
                return self._adopt()
            record.counted()
            return self.plan_of(record.winner).run()
        if not record.seen:  # a case's first call: the rules' choice, as a call made once
            record.seen = True
            return self.plan_of(record.ruled).run()
        if record._propose is not None:
            record.expand()
            if record.winner is not None:  # too short to learn: the rules' choice from now on
                result = self.plan_of(record.winner).run()
                if not record.relearn:
                    forget(self._state, record)
                return result
        name, timed = record.due()
        try:
            plan = self.plan_of(name)
        except ValueError:
            record.exclude(name)
            return self.plan_of(record.ruled).run()
        check = self._check
        start = MPI.Wtime()
        if check is not None and name != "shm":
            agree(self._state.checker, "allreduce", check, None, ALGORITHMS, state=self._state)
        result = plan.run()
        record.ran(name, MPI.Wtime() - start, timed)
        if record.calls >= record.total and record.screening:
            for dropped in record.screen(self._state.private):
                plan = self._plans.pop(dropped, None)
                if plan is not None:
                    plan.free()
        elif record.calls >= record.total:
            record.decide(self._state.private)
            if not record.relearn:
                forget(self._state, record)
        return result

    def _adopt(self) -> np.ndarray:
        """The case is decided: keep the winner only, and run it directly from now on."""
        winner = self.plan_of(self.record.winner)
        for name, plan in list(self._plans.items()):
            if plan is not winner:
                plan.free()
                del self._plans[name]
        self.run, self.start, self.wait = winner.run, winner.start, winner.wait
        return winner.run()

    # every plan's start and wait (a learning run runs whole at the start, in call order)
    start, wait = _PlanBase.start, _PlanBase.wait

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            for plan in self._plans.values():
                plan.free()
            self._plans.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        record = self.record
        noise = "" if record.verdict is None or record.verdict.decided else " within noise"
        doing = (f"learned {record.winner}{noise}" if record.winner
                 else f"learning {', '.join(record.candidates)}")
        return f"<mpiallreduce.Plan auto ({doing}) count={self.recvbuf.size}>"


def forget(state, record: Record) -> None:
    """Replace this rank's cached calls that learn ``record``'s case with entries of the winner
    (its plan, built while learning, handed over: building it again would cost a case of small
    messages more than its learning did), or drop them where the winner was never built there;
    and drop the shapes of calls of its size and mode, so their next call binds the winner.
    Each rank does so at the same call."""
    calls = state.calls
    for key, entry in list(calls.entries.items()):
        plan = getattr(entry, "plan", None)
        if isinstance(plan, Learner) and plan.record is record:
            winner = plan._plans.pop(record.winner, None) if plan._entry else None
            if winner is None or not calls.put(key, plan._entry(winner, entry.objects)):
                if winner is not None:
                    winner.free()
                calls.discard(key)
    bucket, in_place, _, _, dtype, _ = record.key
    for key, shape in list(calls.shapes.entries.items()):
        # shape_key: (comm, op, algorithm, topology, id(dtype), count, in place, params); the
        # shape holds the dtype (Shape.objects: comm, op, topology, dtype)
        kind = shape.objects[3]
        if key[2] == "auto" and key[6] == in_place and kind.str == dtype \
                and 1 << (max(kind.itemsize * key[5], 1).bit_length() - 1) == bucket:
            calls.discard_shape(key)


def learned(comm) -> list[dict]:
    """What ``auto`` learned on ``comm`` so far (this rank's view; the choices are every
    rank's): one dict per case with its candidates, winner, the verdict (``decided``: False
    where the rules' choice was kept because the measurement could not tell; ``verdict``: the
    decision in words, "within noise: keeping ..." then), agreed median times (us) and cost."""
    return [record.report() for record in records(comm_state(comm)).values()]


def save(comm, path: str | None = None) -> str:
    """Write what ``auto`` learned on ``comm`` as the measured table of its size
    (:func:`.select.write_table`; ``path``: default :func:`.select.table_path`). Collective;
    rank 0 writes. Each learned case gives its size bucket's choice, per op class and mode;
    between learned sizes the smaller one's choice holds, below the smallest the rules'.
    Returns the path."""
    path = path or select.table_path() or select.default_path()
    classes: dict[str, list] = {}
    measured: dict[str, dict] = {}
    verdicts: dict[str, dict] = {}
    for record in sorted(records(comm_state(comm)).values(), key=lambda r: r.key[:3]):
        if record.winner is None or record.key[5] is not None or record.key[3]:
            continue  # not decided; a topology passed; 8/16-bit sums (their own rule)
        bucket, in_place, commutative = record.key[:3]
        name = ("commutative" if commutative else "noncommutative") \
            + ("_in_place" if in_place else "")
        ranges = classes.setdefault(name, [])
        if ranges and ranges[-1]["min_bytes"] == bucket:
            continue  # another dtype of the same size: the first learned stays
        if ranges:
            ranges[-1]["max_bytes"] = bucket
        elif bucket > 0:
            ranges.append({"min_bytes": 0, "max_bytes": bucket, "algorithm": record.ruled})
        ranges.append({"min_bytes": bucket, "max_bytes": None, "algorithm": record.winner})
        measured.setdefault(name, {})[str(bucket)] = {
            k: round(1e6 * t, 3) for k, t in record.agreed.items()}
        verdicts.setdefault(name, {})[str(bucket)] = record.verdict.text
    for name, ranges in classes.items():  # equal neighbours merge
        merged = []
        for item in ranges:
            if merged and merged[-1]["algorithm"] == item["algorithm"]:
                merged[-1]["max_bytes"] = item["max_bytes"]
            else:
                merged.append(item)
        classes[name] = merged
    library = MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00")
    size = comm.Get_size()
    record = {
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {library}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"learned by auto in a run of {size} rank(s) (mpiallreduce.learn.save)",
        "measured": {"unit": "median us per call over the learning's interleaved rounds, "
                             "slowest rank per round, per size bucket", **measured},
        "verdicts": verdicts,
    }
    table = {"nranks": size, "provenance": f"learned-n{size}", "classes": classes}
    if comm.Get_rank() == 0 and classes:
        select.write_table(path, table, record)
    comm.Barrier()
    return path
