"""One bounded mapping, least recently used out first: the package's caches are written with it.

:class:`LRU` bounds its entries by their number and by their total *weight* (bytes, or an
estimate of them), drops the least recently used first, and tells ``on_drop(key, value)`` of
every entry it drops (so an entry that holds MPI requests frees them). A hit is a dict lookup
and a move to the end of the order (``OrderedDict.move_to_end``, in C); :meth:`peek` finds an
entry without changing the order (a cache whose order is "least recently stored"). Not
thread-safe: a cache shared between threads holds its own lock around these calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

_MISSING = object()


class LRU:
    """A mapping of at most ``max_entries`` entries of at most ``max_weight`` in total (None:
    no bound), least recently used out first, ``on_drop(key, value)`` told of each drop."""

    __slots__ = ("entries", "weights", "weight", "max_entries", "max_weight", "on_drop")

    def __init__(self, max_entries: int | None = None, max_weight: int | None = None,
                 on_drop: Callable[[object, object], None] | None = None):
        self.entries: OrderedDict = OrderedDict()
        self.weights: dict = {}
        self.weight = 0  # the entries' total weight
        self.max_entries, self.max_weight, self.on_drop = max_entries, max_weight, on_drop

    def get(self, key, default=None):
        """The value of ``key`` (now the most recently used), or ``default``."""
        value = self.entries.get(key, _MISSING)
        if value is _MISSING:
            return default
        self.entries.move_to_end(key)
        return value

    def peek(self, key, default=None):
        """The value of ``key`` without touching the order, or ``default``."""
        return self.entries.get(key, default)

    def put(self, key, value, weight: int = 0) -> bool:
        """Keep ``value`` under ``key`` (dropping what it replaces), then drop the least recently
        used entries until both bounds hold. False, and nothing kept, where ``value`` alone is
        past a bound (heavier than ``max_weight``, or ``max_entries`` is 0)."""
        if (self.max_weight is not None and weight > self.max_weight) or self.max_entries == 0:
            return False
        if key in self.entries:
            self._drop(key, self.entries.pop(key))
        self.entries[key] = value
        self.weights[key] = weight
        self.weight += weight
        max_entries, max_weight = self.max_entries, self.max_weight
        while (max_entries is not None and len(self.entries) > max_entries) \
                or (max_weight is not None and self.weight > max_weight):
            self._drop(*self.entries.popitem(last=False))
        return True

    def pop(self, key, default=None):
        """Remove ``key`` and return its value (``on_drop`` is not told: the caller has it)."""
        value = self.entries.pop(key, _MISSING)
        if value is _MISSING:
            return default
        self.weight -= self.weights.pop(key)
        return value

    def clear(self) -> None:
        """Drop every entry, ``on_drop`` told of each (oldest first)."""
        while self.entries:
            self._drop(*self.entries.popitem(last=False))

    def _drop(self, key, value) -> None:
        self.weight -= self.weights.pop(key)
        if self.on_drop is not None:
            self.on_drop(key, value)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def __iter__(self):
        return iter(self.entries)

    def items(self):
        """``(key, value)`` pairs, least recently used first."""
        return self.entries.items()
