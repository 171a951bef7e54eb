"""Machines from measurements: the α-β line fit, and the calibrated terms as what a measured
run costs beyond the model's prediction of it. Pure arithmetic over numbers that
:mod:`mpiallreduce.calibrate` (a client that runs MPI) measured; no MPI here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..topology import Topology
from .machine import DEFAULT_MACHINE, NETWORK_100G, Link, Machine
from .prediction import predict


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> Link:
    """Least-squares fit of one-way times ``t = α + size·β``; α and β clamped at 0.

    Raises ValueError for fewer than two distinct sizes or mismatched lengths.
    """
    sizes = np.asarray(sizes, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    if sizes.shape != seconds.shape or sizes.ndim != 1:
        raise ValueError(f"sizes and times must be two lists of one length, got {sizes.shape} "
                         f"and {seconds.shape}")
    if len(np.unique(sizes)) < 2:
        raise ValueError("fitting α and β needs at least two distinct message sizes")
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
        raise ValueError("times must be finite and >= 0")
    # weight by 1/t: relative errors, so the small sizes fix α and the large ones β
    weights = 1.0 / np.maximum(seconds, 1e-12)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    return Link(float(max(alpha, 0.0)), float(max(beta, 0.0)))


#: largest message whose cost ``native_link`` takes from calibrate's blocking exchange. Up to
#: here it steps where the ping-pong does not (eager paths); past it both are rendezvous and
#: bandwidth, and the exchange's few rounds of large messages scatter (a larger size can come
#: out faster than a smaller one in the same job), so native's large messages keep the
#: ping-pong's curve.
NATIVE_LINK_BYTES = 64 << 10


#: the schedule and result sizes (bytes of float64) whose runs in place against out of place
#: give ``Machine.reuse_curve``: recursive doubling sends its input out of place and its result
#: in place, which it then writes (at 2 ranks: none of its result, all of it). From 1 MiB up
#: the lines leave the caches before they are written again, and the difference fades.
REUSE_ALGORITHM, REUSE_SIZES = "recursive_doubling", (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def reuse_curve(rows: Sequence[dict], machine: Machine, nranks: int, topology=None
                ) -> tuple[tuple[int, float], ...] | None:
    """``Machine.reuse_curve`` from :data:`REUSE_ALGORITHM`'s measured rows (``size``,
    ``in_place``, ``avg_us``): at each size, what the run in place costs beyond the run out of
    place, less the model's own difference between them, per byte the two reuse apart (0 where
    it came out negative); None without both modes of a size."""
    from .programs import reused_bytes

    runs = {(int(row["size"]), bool(row["in_place"])): row["avg_us"] * 1e-6 for row in rows}
    plain = replace(machine, reuse_curve=None)
    points = []
    for size in sorted({size for size, _ in runs}):
        if (size, True) not in runs or (size, False) not in runs:
            continue
        count = size // 8
        apart = (reused_bytes(REUSE_ALGORITHM, nranks, count, 8, (), True)
                 - reused_bytes(REUSE_ALGORITHM, nranks, count, 8, (), False))
        if apart <= 0:
            continue  # (more ranks than 2: both modes send what they write)
        modelled = [predict(REUSE_ALGORITHM, nranks, size, topology, plain, "float64",
                            in_place=mode).time for mode in (False, True)]
        excess = (runs[size, True] - runs[size, False]) - (modelled[1] - modelled[0])
        points.append((size, max(0.0, excess / apart)))
    return tuple(points) or None


#: the size at which calibrate also times shm's small regime for ``Machine.shm_peer_curve``
SHM_PEER_BYTES = 4 << 10


#: the size at which calibrate times shm's small regime where it calls NumPy (``shm_call``)
NUMPY_RUN_BYTES, NUMPY_RUN_DTYPE = 2048, "int32"


def machine_from(measured: dict, inter: Link | None = None) -> Machine:
    """Return the machine that ``measured`` (what :func:`mpiallreduce.calibrate.measure`
    returns, or the ``measurements`` kept in a calibrated machine file's info) describes.

    - the link: the ping-pong's one-way times by size as its ``curve``, α and β least squares
      over them up to 4 MiB; it is the inter-node link when ranks 0 and 1 were on different
      nodes, else the intra-node one, the other class from ``inter`` (default
      :data:`NETWORK_100G`) or the built-in machine;
    - ``step``, ``request``, ``combine``, ``call`` from the three shapes of one-element plan
      runs, less the ping-pong's message (clamped at 0);
    - ``native_link``: the blocking ``Sendrecv`` exchange by size less its median excess over
      the ping-pong up to 64 B, up to :data:`NATIVE_LINK_BYTES` (one node only);
    - ``native_call``: ``comm.Allreduce`` of one float64 less the model's time for it;
    - where ``measured`` has ``library_runs`` (the library's own plans and MPI's ``Allreduce``
      at a few small sizes), ``step``, ``request``, ``combine``, ``call`` and ``native_call``
      refitted to those (:func:`fit_terms`): the call path as it runs;
    - ``shm_small``, ``shm_peer``, ``shm_large`` and ``phased_small``/``phased_large``: the
      measured runs less the model's copies and combines there (one node only).
    """
    sizes, times = measured["pingpong_sizes"], measured["pingpong_s"]
    fitted = [(b, t) for b, t in zip(sizes, times) if b <= 4 << 20] or list(zip(sizes, times))
    line = fit_alpha_beta([b for b, _ in fitted], [t for _, t in fitted])
    link = Link(line.alpha, line.beta, tuple(zip(map(int, sizes), times)))
    gamma = tuple((name, value) for name, value in measured["gamma"])
    shapes = measured["plan_run_s"]
    message = float(link.cost(8))
    gamma64 = dict(gamma)["float64"]
    request = shapes["exchange"] - shapes["chain"]
    raw_step = shapes["chain"] - request - message
    combine = shapes["reducing"] - shapes["exchange"] - 8 * gamma64
    per_step, request, combine = max(0.0, raw_step), max(0.0, request), max(0.0, combine)
    per_call = max(0.0, shapes["reducing 1 step"] - shapes["reducing"])
    split = Topology.from_levels(measured["node"])
    across = split.node[0] != split.node[1]
    intra = DEFAULT_MACHINE.intra if across else link
    inter = link if across else (NETWORK_100G if inter is None else inter)
    shm = {int(k): v for k, v in measured.get("shm_run_s", {}).items()}
    # the small regime's run where it calls NumPy (int32 at 2 KiB, a type the compiled reduce
    # does not take; a calibration file without this key leaves shm_call None)
    numpy_run = measured.get("shm_numpy_run_s", {}).get(str(NUMPY_RUN_BYTES))
    phased = {int(k): v for k, v in measured.get("hierarchical_shm_run_s", {}).items()}
    node_curve = measured.get("node_curve")
    info = {**measured.get("info", {}),
            "measured_link": "inter" if across else "intra",
            "inter_source": "measured" if across else "given by hand (--inter-alpha/--inter-beta)"
                            if inter is not NETWORK_100G else "NETWORK_100G (100 Gb/s example)",
            "pingpong": {"sizes": list(map(int, sizes)), "one_way_s": list(times),
                         "kind": "persistent requests (Start/Wait), best of rounds"},
            "plan_run_s": {"chain per step": shapes["chain"],
                           "exchange per step": shapes["exchange"],
                           "reducing exchange per step": shapes["reducing"],
                           "reducing exchange, 1 step": shapes["reducing 1 step"],
                           "step before clamping at 0": raw_step},
            "shm_run_s": {str(k): v for k, v in shm.items()},
            "hierarchical_shm_run_s": {str(k): v for k, v in phased.items()},
            "allreduce_1_float64_s": measured["allreduce_s"],
            "measurements": {k: v for k, v in measured.items() if k != "info"}}
    machine = Machine(intra, inter, gamma, per_step, per_call, measured["copy"], info=info,
                      request=request, combine=combine,
                      gamma_curve=tuple(map(tuple, measured["gamma_curve"])),
                      copy_curve=tuple(map(tuple, measured["copy_curve"])),
                      node_bandwidth=measured.get("node_bandwidth", 0.0),
                      fault=measured.get("fault", 0.0),
                      node_curve=None if node_curve is None else tuple(map(tuple, node_curve)))
    exchanges = measured.get("sendrecv_s")
    if exchanges and not across:
        # MPI's own blocking exchange, its shape by size, less mpi4py's own call: the median
        # of its excess over the ping-pong up to 64 B (one size alone can be an outlier: the
        # first exchanges of a job run slow); up to NATIVE_LINK_BYTES, past them the
        # ping-pong's (the same protocol)
        offset = float(np.median([s - t for b, s, t in zip(sizes, exchanges, times)
                                  if b <= 64] or [exchanges[0] - times[0]]))
        if measured.get("pingpong_buffers") == 2:
            # a ping-pong with a send and a receive buffer (a calibration file that records
            # pingpong_buffers): past NATIVE_LINK_BYTES both ranks' copies share the memory at
            # once, as every exchange step's do, which a ping-pong's one copy at a time does
            # not (at 2 ranks the exchange took well over the one-way time at 4-64 MiB, and
            # the schedules' large runs followed the exchange); below, the persistent
            # requests' one-way time stays the schedules' (the blocking exchange steps where
            # they do not)
            shifted = [max(0.0, s - offset) for s in exchanges]
            curve = [e if b > NATIVE_LINK_BYTES else t
                     for b, e, t in zip(sizes, shifted, times)]
            line = fit_alpha_beta([b for b, _ in fitted], curve[:len(fitted)])
            machine = replace(machine, intra=Link(line.alpha, line.beta,
                                                  tuple(zip(map(int, sizes), curve))))
        else:
            shifted = [max(0.0, s - offset) if b <= NATIVE_LINK_BYTES else t
                       for b, s, t in zip(sizes, exchanges, times)]
        line = fit_alpha_beta([b for b, _ in fitted], shifted[:len(fitted)])
        machine = replace(machine, native_link=Link(line.alpha, line.beta,
                                                    tuple(zip(map(int, sizes), shifted))))
    nranks = len(split.node)
    modelled = predict("native", nranks, 8, split, machine, "float64").time
    machine = replace(machine, native_call=max(0.0, measured["allreduce_s"] - modelled))
    library = measured.get("library_runs")
    if library:  # before the shm and phased terms: those are what the runs leave over them
        machine = fit_terms(machine, library, nranks, split,
                            in_place=[bool(row["in_place"]) for row in library])
    reuse = measured.get("reuse_runs")
    if reuse and split.nnodes == 1:
        machine = replace(machine, reuse_curve=reuse_curve(reuse, machine, nranks, split))
    limit = measured.get("shm_small_limit")
    if shm and all(v is not None for v in shm.values()) and split.nnodes == 1:
        # the small regime's fixed cost at 8 B, its per-byte read of the peers' slots from
        # half its limit, then the large regime's fixed cost at twice the limit with that rate
        half, large_size = limit // 2, 2 * limit
        small = max(0.0, shm[8] - predict("shm", nranks, 8, split, machine).time)
        machine = replace(machine, shm_small=small)

        def with_call(machine: Machine) -> Machine:
            if numpy_run is None:  # a calibration from before shm_call: none
                return machine
            machine = replace(machine, shm_call=0.0)
            call = numpy_run - predict("shm", nranks, NUMPY_RUN_BYTES, split, machine,
                                       NUMPY_RUN_DTYPE).time
            return replace(machine, shm_call=max(0.0, call))

        # the call, the peers' rate with it, then the call again with that rate
        machine = with_call(machine)
        rest = shm[half] - predict("shm", nranks, half, split, machine).time
        machine = with_call(replace(machine, shm_peer=max(0.0, rest / ((nranks - 1) * half))))
        few = shm.get(SHM_PEER_BYTES)
        if few is not None and half > SHM_PEER_BYTES:
            # a few KiB of the peers' lines: their own rate (where the calibration measured it)
            flat = replace(machine, shm_peer=0.0)
            rest = few - predict("shm", nranks, SHM_PEER_BYTES, split, flat).time
            machine = with_call(replace(machine, shm_peer_curve=(
                (SHM_PEER_BYTES, max(0.0, rest / ((nranks - 1) * SHM_PEER_BYTES))),
                (half, machine.shm_peer))))
        large = shm[large_size] - predict("shm", nranks, large_size, split, machine).time
        machine = replace(machine, shm_large=max(0.0, large))
    if phased and all(v is not None for v in phased.values()) and split.nnodes == 1:
        # hierarchical over shared memory on this one node (no cross phase), as shm's regimes
        fields = {}
        for size, name in ((8, "phased_small"), (2 * limit, "phased_large")):
            modelled = predict("hierarchical", nranks, size, split,
                               replace(machine, **{name: 0.0}), intra="shm").time
            fields[name] = max(0.0, phased[size] - modelled)
        machine = replace(machine, **fields)
    return replace(machine, cores=measured["cores"])


#: the terms :func:`fit_terms` fits, each from the rows of the algorithms it is part of and the
#: sizes where it dominates: the interpreter's (every point-to-point schedule, up to 4 KiB),
#: native's per call, shm's small regime and the node-phased small regime.
FITTED = {"interpreter": ("step", "request", "combine", "call"), "native": ("native_call",),
          "shm": ("shm_small",), "phased": ("phased_small",)}
#: largest bytes per rank of the rows a fit reads (the terms are per call, per step, per
#: message: they decide small messages).
FIT_BYTES = 4 << 10


def fit_terms(machine: Machine, rows: Sequence[dict], nranks: int, topology=None,
              in_place: Sequence[bool] | None = None) -> Machine:
    """Return ``machine`` with its per-call and per-step terms fitted to measured rows.

    ``rows``: measured calls (``algorithm``, ``size`` in bytes per rank, ``avg_us``), as the
    bench writes them, all at ``nranks`` ranks on ``topology`` (default one node); ``in_place``
    per row (default out of place). Each term's predicted effect is linear where it is
    fitted (the schedules' steps and messages do not change with it), so its coefficient per
    row is a finite difference of :func:`predict`, and the terms are non-negative least
    squares over the relative errors (every row weighs alike, whatever its time). Pure: no
    MPI; fit on one run's rows and judge on another's (``scripts/predict_vs_measured.py
    --fit``).
    """
    from .prediction import SHM

    modes = list(in_place) if in_place is not None else [False] * len(rows)
    groups = {"interpreter": [], "native": [], "shm": [], "phased": []}
    for row, mode in zip(rows, modes):
        name, size = row.get("runs") or row["algorithm"], int(row["size"])
        if name == "auto" or size > FIT_BYTES or not row.get("avg_us"):
            continue
        group = ("native" if name == "native" else "shm" if name == SHM else
                 "phased" if name in ("hierarchical", "cascade") else "interpreter")
        groups[group].append((name, size, mode, row["avg_us"] * 1e-6))
    for group, samples in groups.items():
        if not samples:
            continue
        terms = FITTED[group]
        zero = replace(machine, **dict.fromkeys(terms, 0.0))
        design, target = [], []
        for name, size, mode, seconds in samples:
            base = predict(name, nranks, size, topology, zero, in_place=mode).time
            unit = 1e-6
            coefficients = [(predict(name, nranks, size, topology,
                                     replace(zero, **{term: unit}), in_place=mode).time - base)
                            / unit for term in terms]
            design.append([c / seconds for c in coefficients])
            target.append((seconds - base) / seconds)
        values = _nonnegative_least_squares(np.array(design), np.array(target))
        machine = replace(machine, **{term: float(v) for term, v in zip(terms, values)})
    return machine


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """min |design x - target| with x >= 0 (active set: drop the most negative, refit)."""
    active = list(range(design.shape[1]))
    values = np.zeros(design.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
        if (solution >= 0).all():
            values[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return values
