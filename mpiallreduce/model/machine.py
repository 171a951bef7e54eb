"""The model machine: link classes, in-network switches, cores, and the built-in numbers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import numpy as np

INTRA, INTER = 0, 1
LINK_NAMES = ("intra", "inter")
#: most link classes a machine describes: the node, the network, and up to two levels above
#: it (a rack, a site), each with its own link.
MAX_CLASSES = 4


def _points(value, what: str, positive_x: bool = True) -> tuple[tuple[int, float], ...] | None:
    """Check and sort a measured curve ``((bytes, value), ...)``; None stays None."""
    if value is None:
        return None
    try:
        points = tuple(sorted((int(x), float(y)) for x, y in value))
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a list of [bytes, value] pairs, got {value!r}") from None
    if not points or any(x < (1 if positive_x else 0) or not y >= 0 for x, y in points) \
            or len({x for x, _ in points}) != len(points):
        raise ValueError(f"{what} needs distinct sizes >= 1 and values >= 0, got {value!r}")
    return points


def _interpolate(points, nbytes, log: bool):
    """``points`` at ``nbytes`` (scalar or array): linear between points (in log2 of the size
    when ``log``), the end values outside them; for totals (``log`` False) above the last point
    the last segment's slope continues (a message twice the largest measured costs twice)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    b = np.asarray(nbytes, dtype=float)
    if log:
        return np.interp(np.log2(np.maximum(b, 1.0)), np.log2(x), y)
    out = np.interp(b, x, y)
    if len(x) >= 2:
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        out = np.where(b > x[-1], y[-1] + (b - x[-1]) * slope, out)
    return out


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per message, ``beta`` seconds per byte.

    ``curve``: measured one-way seconds per message size, ``((bytes, seconds), ...)`` from
    ``calibrate``'s ping-pong; when given, a message of b bytes costs the curve at b (linear
    between the measured sizes, the last slope beyond them) instead of ``alpha + b*beta``: it
    keeps MPI's protocol switch (eager to rendezvous) and the caches, which one line cannot.
    """

    alpha: float
    beta: float
    curve: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self):
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"link {name} must be a number >= 0 (seconds), got {value!r}")
        object.__setattr__(self, "curve", _points(self.curve, "link curve"))

    def cost(self, nbytes):
        """Seconds of one message of ``nbytes`` (a number or an array of them)."""
        if self.curve is None:
            return self.alpha + np.asarray(nbytes, dtype=float) * self.beta
        return _interpolate(self.curve, nbytes, log=False)

    def to_dict(self) -> dict:
        data = {"alpha": self.alpha, "beta": self.beta}
        if self.curve is not None:
            data["curve"] = [list(point) for point in self.curve]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Link:
        return cls(float(data["alpha"]), float(data["beta"]), data.get("curve"))


@dataclass(frozen=True)
class Switch:
    """In-network reduction (SHARP-like): switches reduce the data as it passes. Modelled only.

    One aggregation operation of b bytes among N node leaders costs
    ``alpha + 2·levels(N)·hop + (chunks - 1)·chunk + b·beta``: the host's post/inject/eject
    (``alpha``), one reduction per switch level up the tree and the result back down (``hop``
    per level and direction, ``levels = ⌈log_radix N⌉``), and the stream through the tree
    (``beta``). A message above ``limit`` bytes is split into ``⌈b/limit⌉`` operations that
    are pipelined: each extra one adds ``chunk`` (the switch's per-operation turnaround), so
    the time grows linearly in b above the limit.

    Args:
        radix: nodes (or child switches) under one switch of the aggregation tree.
        name, source: a label, and where the numbers come from (printed by ``predict``).
    """

    alpha: float
    hop: float
    beta: float
    chunk: float
    limit: int
    radix: int
    name: str = "switch"
    source: str = ""

    def __post_init__(self):
        for name in ("alpha", "hop", "beta", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"switch {name} must be a number >= 0 (seconds), got {value!r}")
        for name, least in (("limit", 1), ("radix", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"switch {name} must be an integer >= {least}, got {value!r}")

    def levels(self, nnodes: int) -> int:
        """Switch levels of the aggregation tree over ``nnodes`` leaves (at least 1)."""
        levels, reach = 1, self.radix
        while reach < nnodes:
            levels, reach = levels + 1, reach * self.radix
        return levels

    def chunks(self, nbytes: int) -> int:
        """Aggregation operations for ``nbytes``: ⌈nbytes / limit⌉, at least 1."""
        return max(1, -(-int(nbytes) // self.limit))

    def time(self, nnodes: int, nbytes: int) -> float:
        """Seconds of one in-network allreduce of ``nbytes`` among ``nnodes`` leaders."""
        if nnodes <= 1:
            return 0.0
        return (self.alpha + 2 * self.levels(nnodes) * self.hop
                + (self.chunks(nbytes) - 1) * self.chunk + nbytes * self.beta)


#: SHARP's low-latency aggregation (LLT) on Switch-IB 2 (EDR, 100 Gb/s), fitted to Graham et
#: al., "Scalable Hierarchical Aggregation Protocol (SHArP): A Hardware Architecture for
#: Efficient Data Reduction", COMHPC@SC 2016: MPI_Allreduce on 128 hosts took 2.83 µs at 8 B
#: and 14.48 µs at 4096 B with SHArP (6.01 and 46.93 µs without). The payload per operation
#: is 256 B on Switch-IB 2 (NVIDIA SHARP v2.6.1 docs, SHARP_COLL_JOB_QUOTA_PAYLOAD_PER_OST:
#: "256B on Switch-IB 2, 2048B on Quantum"; larger requests are pipelined). Assumed: the host
#: part α is the 100 Gb/s network's 2 µs, a radix of 18 (36-port switches, half the ports down:
#: 2 levels at 128 hosts), β the network's; then 8 B gives 2 + 4·hop = 2.83 µs and 4096 B
#: (16 operations) 2.83 + 15·chunk + 4096β = 14.48 µs.
SHARP_LLT = Switch(alpha=2.0e-6, hop=0.2075e-6, beta=8.0e-11, chunk=0.7548e-6, limit=256,
                   radix=18, name="sharp-llt",
                   source="fitted to Graham et al., COMHPC@SC 2016 (SHArP, Switch-IB 2, EDR: "
                          "8 B 2.83 us, 4 KiB 14.48 us at 128 hosts); 256 B per operation "
                          "(NVIDIA SHARP docs); host alpha, radix 18 and beta assumed")

#: SHARP's streaming aggregation (SAT) on Quantum (HDR): Graham et al., "SHARP Streaming-
#: Aggregation Hardware Design and Evaluation", ISC 2020, measured MPI_Allreduce bandwidth at
#: about 95% of the network's; the NVIDIA SHARP docs (v2.6.1) give 1073741792 B (1 GiB less
#: 32 B) as the largest SAT message. β is the model's 100 Gb/s network at 95%; α, hop and
#: chunk are assumed equal to the LLT fit (no latency figure found), radix 20 (40-port Quantum).
SHARP_SAT = Switch(alpha=2.0e-6, hop=0.2075e-6, beta=8.0e-11 / 0.95, chunk=0.7548e-6,
                   limit=1073741792, radix=20, name="sharp-sat",
                   source="Graham et al., ISC 2020 (SHARP streaming aggregation, HDR: ~95% of "
                          "network bandwidth); 1 GiB - 32 B per operation (NVIDIA SHARP docs); "
                          "alpha, hop, chunk assumed as sharp-llt's, radix 20 assumed")

SWITCHES = {switch.name: switch for switch in (SHARP_LLT, SHARP_SAT)}


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Machine:
    """Model parameters: two link classes, γ per dtype, and the interpreter's terms.

    Args:
        intra: link between ranks of one node (shared memory).
        inter: link between nodes (the network).
        gamma: ``((dtype name, seconds per reduced byte), ...)``; dtypes not listed use float32's.
        step: seconds of Python per non-empty step of a schedule (the executor's loop).
        call: seconds of Python per ``Plan.run()`` call, beyond its steps.
        copy: seconds per byte to allocate a fresh buffer and copy into it: what Open MPI's
            recursive doubling, ring and Rabenseifner pay per call on the whole message
            (:data:`OMPI_COPIES`), and the schedules do not.
        native_call: seconds per call of MPI's own ``Allreduce`` from Python beyond its
            messages: mpi4py's call and the collective's entry, which a point-to-point
            ping-pong does not include.
        request: seconds of Python per request a rank starts and waits in a step (each
            non-empty send and receive): a step of one message costs ``step + request``, an
            exchange ``step + 2 request``.
        combine: seconds of Python per combine call (each reducing receive), beyond its bytes'
            ``gamma``.
        gamma_curve: measured seconds per reduced byte of the float32 SUM combine by combine
            size, ``((bytes, s/B), ...)``, or None (``gamma`` at every size); other dtypes
            scale it by their ``gamma`` over float32's. Caches: a combine that fits in L2 is
            several times faster per byte than 64 MiB's.
        copy_curve: measured seconds per byte of ``copy`` by size (allocate and copy), or None.
        shm_small, shm_large: seconds per call of the shared-memory transport (``"shm"``)
            beyond its copies and combines, in its small and large regimes (per chunk in the
            large one: Python, the counters, waiting for the peers).
        phased_small, phased_large: seconds per call of hierarchical and cascade with the
            shared-memory intra-node phase (:mod:`mpiallreduce.shm_nodes`) beyond their copies,
            combines and cross phase, in shm's small and large regimes, or None (``shm_small``
            and ``shm_large``): they publish twice per call and run more Python than ``shm``.
        fault: seconds per byte of the first writes into memory malloc has just mapped (page
            faults, the kernel zeroing the pages) beyond plain writes: Open MPI's native
            allreduce pays it where its whole-message temporary is mapped afresh each call
            (``native.OMPI_FRESH_BYTES``); 0: not modelled.
        native_link: the link MPI's own collectives see within a node, or None (``intra``):
            ``calibrate``'s blocking ``Sendrecv`` exchange by size less its median excess over
            the ping-pong up to 64 B (mpi4py's per-call cost is ``native_call``'s). MPI's C
            code sends with blocking calls whose cost steps where the persistent requests of
            the schedules' ping-pong do not (Open MPI 5 at 2 ranks: one step up from 384 B and
            a larger one at 4 KiB).
        shm_call: seconds per call of shm's small regime beyond ``shm_small`` where its load
            and reduce call NumPy (element types other than ``COMPILED_REDUCE_DTYPES``, which
            the compiled call path reduces in C), or None: a ``combine`` per combine.
        shm_peer: seconds per byte a rank of the shm transport reads from slots its peers have
            just written (the lines come from the peer's cache), beyond the combine's γ (the
            small regime's: the large regime's chunks are priced without it).
        shm_peer_curve: ``shm_peer`` by the bytes each rank reads from a slot,
            ``((bytes, s/B), ...)``, or None (``shm_peer`` at every size): a few KiB of a
            peer's lines come one latency at a time, where 64 KiB stream, so a byte costs more
            at a few KiB than at 64 KiB.
        node_bandwidth: bytes per second a node's memory moves for all its ranks at once
            (reads plus writes), or 0 (no limit): the shm transport's copies and combines run
            on every rank of the node together and cannot go faster than this.
        node_curve: measured ``node_bandwidth`` by the bytes each rank copies,
            ``((bytes, B/s), ...)``, or None (``node_bandwidth`` at every size): the node's
            caches carry small copies of all its ranks at once far faster than its memory.
        reuse_curve: seconds per byte, by the result's size ``((bytes, s/B), ...)``, that a
            rank pays for the bytes of its result it both sends from and writes in one run
            (:func:`.programs.reused_bytes`), on one node, or None (not modelled). Open MPI's
            single-copy transport reads the sender's own memory, so such a line moves between
            the two cores every run: the peer reads it out of the writer's cache, and the next
            write must take it back. ``calibrate`` times the ping-pong with a send and a receive
            buffer (with one buffer for both, the ping-pong's one-way time would carry these
            line transfers itself, far above the two buffers' at 16-256 KiB, and recursive
            doubling out of place, which sends its untouched input, would be predicted too
            slow) and fits this curve to recursive doubling's runs in place against out of
            place (``fit.REUSE_SIZES``).
        switch: in-network reduction (:class:`Switch`), or ``None``: only the modelled
            algorithm ``"sharp"`` uses it.
        cores: cores per node, or ``None`` (not checked). A prediction that puts more ranks
            on a node than it has cores is refused (:class:`Oversubscribed`): ranks then wait
            for a time slice, which no term of the model describes.
        info: where the numbers come from (MPI library, host, date); not compared.
        levels: ``((name, Link), ...)``: links above the network, finer first (a rack, then a
            site): a message between ranks in different units of a topology's level k
            (``Topology.levels[k]``, k >= 1) takes ``levels[k - 1]``'s link (the coarsest level
            at which they differ decides). Empty: every message between nodes takes
            ``inter``, whatever levels the topology has.
    """

    intra: Link
    inter: Link
    gamma: tuple[tuple[str, float], ...]
    step: float = 0.0
    call: float = 0.0
    copy: float = 0.0
    native_call: float = 0.0
    cores: int | None = None
    switch: Switch | None = None
    request: float = 0.0
    combine: float = 0.0
    gamma_curve: tuple[tuple[int, float], ...] | None = None
    copy_curve: tuple[tuple[int, float], ...] | None = None
    shm_small: float = 0.0
    shm_large: float = 0.0
    shm_peer: float = 0.0
    node_bandwidth: float = 0.0
    node_curve: tuple[tuple[int, float], ...] | None = None
    phased_small: float | None = None
    phased_large: float | None = None
    shm_call: float | None = None
    fault: float = 0.0
    native_link: Link | None = None
    reuse_curve: tuple[tuple[int, float], ...] | None = None
    shm_peer_curve: tuple[tuple[int, float], ...] | None = None
    info: dict = field(default_factory=dict, compare=False, hash=False)
    levels: tuple[tuple[str, Link], ...] = ()

    def __post_init__(self):
        levels = self.levels
        if not isinstance(levels, tuple) or len(levels) > MAX_CLASSES - 2 or any(
                not isinstance(level, tuple) or len(level) != 2 or not isinstance(level[0], str)
                or not isinstance(level[1], Link) for level in levels):
            raise ValueError(f"machine levels must be at most {MAX_CLASSES - 2} (name, Link) "
                             f"pairs above the network, got {levels!r}")
        if self.cores is not None and (isinstance(self.cores, bool)
                                       or not isinstance(self.cores, int) or self.cores < 1):
            raise ValueError(f"machine cores must be a positive integer (per node) or None, "
                             f"got {self.cores!r}")
        for name in ("gamma_curve", "copy_curve", "node_curve", "reuse_curve",
                     "shm_peer_curve"):
            object.__setattr__(self, name, _points(getattr(self, name), f"machine {name}"))

    def gamma_at(self, dtype, nbytes):
        """Seconds per reduced byte of ``dtype`` for combines of ``nbytes`` (number or array)."""
        gamma = self.gamma_for(dtype)
        if self.gamma_curve is None:
            return gamma + 0.0 * np.asarray(nbytes, dtype=float)
        base = dict(self.gamma).get("float32", gamma) or gamma
        scale = gamma / base if base else 1.0
        return _interpolate(self.gamma_curve, nbytes, log=True) * scale

    def node_bandwidth_at(self, nbytes) -> float:
        """Bytes per second of the node's memory when each rank moves ``nbytes`` (0: no limit)."""
        if self.node_curve is None:
            return self.node_bandwidth
        return float(_interpolate(self.node_curve, nbytes, log=True))

    def shm_peer_at(self, nbytes) -> float:
        """Seconds per byte read from a peer's freshly written slot, in reads of ``nbytes``."""
        if self.shm_peer_curve is None:
            return self.shm_peer
        return float(_interpolate(self.shm_peer_curve, nbytes, log=True))

    def reuse_at(self, nbytes) -> float:
        """Seconds per reused byte (:attr:`reuse_curve`) in a run of an ``nbytes`` result: the
        nearest measured size's outside them (0: not modelled)."""
        if self.reuse_curve is None:
            return 0.0
        return float(_interpolate(self.reuse_curve, nbytes, log=True))

    def copy_at(self, nbytes):
        """Seconds per byte of an allocate-and-copy of ``nbytes`` (number or array)."""
        if self.copy_curve is None:
            return self.copy + 0.0 * np.asarray(nbytes, dtype=float)
        return _interpolate(self.copy_curve, nbytes, log=True)

    @property
    def links(self) -> tuple[Link, ...]:
        """Every link class: intra-node, the network, then each level's (finer first)."""
        return (self.intra, self.inter, *(link for _, link in self.levels))

    def link(self, kind: int) -> Link:
        return self.links[kind]

    def gamma_for(self, dtype) -> float:
        """Seconds per reduced byte for ``dtype`` (float32's value for dtypes not calibrated)."""
        table = dict(self.gamma)
        return table.get(np.dtype(dtype).name, table.get("float32", 0.0))

    def native(self) -> Machine:
        """The same machine without interpreter terms: what MPI's own C code pays, its
        messages within a node at ``native_link`` where calibrated (and no ``reuse_curve``:
        native's stand-in reuses as Open MPI's algorithms do, priced by the caller)."""
        return replace(self, step=0.0, call=0.0, request=0.0, combine=0.0, reuse_curve=None,
                       intra=self.intra if self.native_link is None else self.native_link)

    def to_dict(self) -> dict:
        def curve(points):
            return None if points is None else [list(point) for point in points]
        return {"intra": self.intra.to_dict(), "inter": self.inter.to_dict(),
                "gamma": dict(self.gamma), "step": self.step, "call": self.call,
                "request": self.request, "combine": self.combine,
                "gamma_curve": curve(self.gamma_curve), "copy": self.copy,
                "copy_curve": curve(self.copy_curve), "native_call": self.native_call,
                "shm_small": self.shm_small, "shm_large": self.shm_large,
                "shm_peer": self.shm_peer,
                "node_bandwidth": self.node_bandwidth, "node_curve": curve(self.node_curve),
                "phased_small": self.phased_small, "phased_large": self.phased_large,
                "shm_call": self.shm_call, "fault": self.fault,
                "native_link": None if self.native_link is None else self.native_link.to_dict(),
                "reuse_curve": curve(self.reuse_curve),
                "shm_peer_curve": curve(self.shm_peer_curve), "cores": self.cores,
                "switch": None if self.switch is None else asdict(self.switch), "info": self.info,
                "levels": [{"name": name, **link.to_dict()} for name, link in self.levels]}

    @classmethod
    def from_dict(cls, data: dict) -> Machine:
        """Build a Machine from :meth:`to_dict`'s layout; ValueError names what is missing."""
        if not isinstance(data, dict):
            raise ValueError(f"a machine description is a JSON object, got {type(data).__name__}")
        try:
            intra = Link.from_dict(data["intra"])
            inter = Link.from_dict(data["inter"])
            gamma = tuple(sorted((str(k), float(v)) for k, v in data["gamma"].items()))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"machine description lacks {error}: it needs intra.alpha, "
                             f"intra.beta, inter.alpha, inter.beta and gamma "
                             f"{{dtype: s/B}}") from None
        cores, switch = data.get("cores"), data.get("switch")
        if switch is not None:
            try:
                switch = Switch(**switch)
            except TypeError as error:
                raise ValueError(f"machine switch: {error} (it needs alpha, hop, beta, chunk, "
                                 f"limit, radix)") from None
        levels = data.get("levels", [])
        if not isinstance(levels, list):
            raise ValueError(f"machine levels must be a list of {{name, alpha, beta}}, finer "
                             f"first, got {levels!r}")
        parsed = []
        for index, level in enumerate(levels):
            if not isinstance(level, dict) or not isinstance(level.get("name"), str):
                raise ValueError(f"machine level {index}: expected {{\"name\": ..., \"alpha\": "
                                 f"s, \"beta\": s/B}}, got {level!r}")
            try:
                parsed.append((level["name"], Link.from_dict(level)))
            except (KeyError, TypeError) as error:
                raise ValueError(f"machine level {level['name']!r} lacks {error}") from None
        return cls(intra, inter, gamma, step=float(data.get("step", 0.0)), levels=tuple(parsed),
                   call=float(data.get("call", 0.0)), copy=float(data.get("copy", 0.0)),
                   native_call=float(data.get("native_call", 0.0)),
                   cores=None if cores is None else int(cores), switch=switch,
                   request=float(data.get("request", 0.0)),
                   combine=float(data.get("combine", 0.0)),
                   gamma_curve=data.get("gamma_curve"), copy_curve=data.get("copy_curve"),
                   shm_small=float(data.get("shm_small", 0.0)),
                   shm_large=float(data.get("shm_large", 0.0)),
                   shm_peer=float(data.get("shm_peer", 0.0)),
                   node_bandwidth=float(data.get("node_bandwidth", 0.0)),
                   node_curve=data.get("node_curve"),
                   phased_small=_optional_float(data.get("phased_small")),
                   phased_large=_optional_float(data.get("phased_large")),
                   shm_call=_optional_float(data.get("shm_call")),
                   fault=float(data.get("fault", 0.0)),
                   native_link=None if data.get("native_link") is None
                   else Link.from_dict(data["native_link"]),
                   reuse_curve=data.get("reuse_curve"),
                   shm_peer_curve=data.get("shm_peer_curve"),
                   info=dict(data.get("info", {})))

    @classmethod
    def load(cls, path: str) -> Machine:
        """Read a machine file written by ``calibrate`` (or by hand)."""
        with open(path, encoding="utf-8") as handle:
            try:
                data = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not JSON ({error})") from None
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")


#: a 100 Gb/s network (InfiniBand HDR100/EDR, 100 GbE RoCE): β = 8 bits / 100e9 b/s = 8e-11 s/B,
#: α ≈ 2 µs, the one-way small-message latency ``osu_latency`` reports between two such nodes.
NETWORK_100G = Link(alpha=2.0e-6, beta=8.0e-11)

#: built-in machine: intra-node numbers from ``mpirun -n 2 python -m mpi4py -m
#: mpiallreduce.model calibrate`` on the 2-core VM of docs/performance.md (docs/results/machine-vm.json),
#: a 100 Gb/s network between nodes.
DEFAULT_MACHINE = Machine(
    intra=Link(alpha=1.50e-6, beta=1.43e-10),
    inter=NETWORK_100G,
    gamma=(("float32", 7.8e-11), ("float64", 7.6e-11), ("int32", 7.8e-11), ("int64", 8.0e-11)),
    # docs/results/machine-vm.json's 2.86 us per step, which lumps the combine in, split as
    # calibrate measures the two apart: 0.9 us per combine call (the combine of
    # docs/results/machine-idle.json), the rest per step (a step with one reducing
    # receive costs the same either way; the shared-memory phases' combine calls, which have
    # no step, cost their Python too)
    step=1.96e-6,
    combine=0.9e-6,
    call=0.0,
    copy=2.71e-10,
    # native measured less native modelled at 2 ranks, the median over 8 B..1 KiB of the quiet
    # VM's run in docs/results/predict_vs_measured-vm.txt
    native_call=0.94e-6,
    # the shared-memory transport (shm, and the intra-node phase of hierarchical and cascade):
    # its per-call terms and peer reads as fitted to the quiet 2-core VM's bench
    # (docs/results/machine-fitted-quiet.json, docs/model.md), the node's bandwidth as that VM's
    # idle calibration measured it (docs/results/machine-idle.json: every rank copying
    # 64 MiB at once)
    # (shm_small: the fitted file's 1.6 us plus the 0.9 us combine call above, which the
    # model charges shm only where its reduce calls NumPy, not where the compiled call path
    # reduces in C: the 8-byte prediction stays the fitted one)
    shm_small=2.5e-6,
    shm_large=3.2e-6,
    shm_peer=2.0e-10,
    node_bandwidth=4.3e10,
    # first writes into a fresh libc malloc of 64 MiB beyond plain writes, as calibrate
    # measured it on the 2-core VM in two jobs (docs/results/machine-fault-a.json and
    # machine-fault-b.json)
    fault=5.5e-10,
    info={"source": "built-in: intra-node, gamma, step and copy calibrated on the quiet 2-core "
                    "VM (Open MPI 5.0.11; docs/results/machine-vm.json); shm terms from that "
                    "VM's fitted and idle runs (docs/results/machine-fitted-quiet.json, "
                    "machine-idle.json); inter-node a 100 Gb/s network"},
)


class Oversubscribed(ValueError):
    """A prediction for more ranks on a node than the node has cores (not modelled)."""


def check_cores(ranks_per_node: int, machine: Machine) -> None:
    """Raise :class:`Oversubscribed` when ``ranks_per_node`` exceeds ``machine.cores``.

    Ranks beyond the cores run in turns: a rank waiting for a message spins through its time
    slice while the sender is not scheduled, so a step costs scheduler quanta, not α + bβ.
    On a 2-core VM, runs at 4 and 8 ranks took several times the model's prediction, by a
    factor that followed the machine's other load, so no single core-sharing factor
    calibrated there would be credible: the model refuses rather than answer with a time that
    can be off by an order of magnitude.
    """
    if machine.cores is not None and ranks_per_node > machine.cores:
        raise Oversubscribed(
            f"{ranks_per_node} ranks on a node of {machine.cores} cores: ranks would share "
            f"cores, and the model has no core-sharing term (oversubscribed runs measured up to "
            f"an order of magnitude over its predictions); predict at most {machine.cores} "
            f"ranks per node, or describe a node with more cores (--cores-per-node, or "
            f"\"cores\" in the machine file)")
