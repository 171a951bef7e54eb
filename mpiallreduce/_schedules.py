"""The schedule cache: each rank's steps of an algorithm, built once per (algorithm, rank, p,
count, topology, parameters) and kept, least recently used out first, within a byte bound."""

from __future__ import annotations

import threading

from . import algorithms
from ._lru import LRU

#: most bytes the schedule cache holds (estimated at :data:`_MESSAGE_BYTES` per message).
SCHEDULE_CACHE_BYTES = 32 << 20
_MESSAGE_BYTES = 120


class _ScheduleCache:
    """Per-rank step lists by (algorithm, rank, p, count, topology, parameters), least recently
    used out first (:class:`._lru.LRU`), bounded by an estimate of their bytes so that
    4096-rank schedules cannot pile up; one lock, as plans are bound from several threads."""

    def __init__(self, max_bytes: int = SCHEDULE_CACHE_BYTES):
        self.lru = LRU(max_weight=max_bytes)
        self.lock = threading.Lock()

    def get(self, key, build):
        with self.lock:
            found = self.lru.get(key)
        if found is not None:
            return found
        steps = build()  # (outside the lock: another thread may build the same; one is kept)
        size = _MESSAGE_BYTES * (1 + sum(len(s.sends) + len(s.recvs) for s in steps))
        with self.lock:
            if self.lru.peek(key) is None:
                self.lru.put(key, steps, size)  # (refused past the bound: returned, not kept)
        return steps

    def clear(self) -> None:
        with self.lock:
            self.lru.clear()


SCHEDULES = _ScheduleCache()


def steps(name: str, rank: int, nranks: int, count: int, topology, params: tuple = (),
          collective: str = "allreduce"):
    """Rank ``rank``'s steps of algorithm ``name`` (cached)."""
    def build():
        algorithm = algorithms.get(name, collective)
        return algorithm.steps(rank, nranks, count, topology=topology,
                               **{**algorithm.params, **dict(params)})
    return SCHEDULES.get((name, rank, nranks, count, topology, params, collective), build)


def builder_params(name: str, call, collective: str = "allreduce") -> tuple:
    """The builder parameters of a call (a ``_checks.Call``): the user's, plus the dtype's
    itemsize and whether rank order must be kept, where the builder takes them."""
    params = dict(call.params)
    accepted = algorithms.get(name, collective).params
    if "itemsize" in accepted:
        params["itemsize"] = call.recv.itemsize
    if "ordered" in accepted:
        # an algorithm that keeps rank order only in some cases is told whether it must;
        # it raises ValueError (identically on every rank, before any message) when it cannot
        params["ordered"] = call.reducer is not None and not call.reducer.commutative
    return tuple(sorted(params.items()))
