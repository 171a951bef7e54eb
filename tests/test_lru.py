"""The one bounded mapping (mpiallreduce._lru.LRU): bounds, order, drops."""

from __future__ import annotations

import pytest

from mpiallreduce._lru import LRU


def test_the_least_recently_used_entry_goes_first():
    dropped = []
    cache = LRU(max_entries=2, on_drop=lambda key, value: dropped.append((key, value)))
    assert cache.put("a", 1) and cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert dropped == [("b", 2)]
    assert list(cache) == ["a", "c"] and len(cache) == 2
    assert cache.get("b") is None and cache.get("b", 0) == 0


def test_peek_keeps_the_order():
    cache = LRU(max_entries=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.peek("a") == 1
    cache.put("c", 3)
    assert "a" not in cache and list(cache) == ["b", "c"]


def test_the_weight_bounds_the_entries_and_a_too_heavy_one_is_refused():
    dropped = []
    cache = LRU(max_weight=10, on_drop=lambda key, value: dropped.append(key))
    assert cache.put("a", "A", 4) and cache.put("b", "B", 4)
    assert cache.weight == 8
    assert cache.put("c", "C", 5)  # 13 > 10: "a" goes
    assert dropped == ["a"] and cache.weight == 9
    assert not cache.put("d", "D", 11)  # alone past the bound: nothing kept, nothing dropped
    assert dropped == ["a"] and "d" not in cache
    assert not LRU(max_entries=0).put("x", 1)


def test_replacing_dropping_popping_and_clearing():
    dropped = []
    cache = LRU(on_drop=lambda key, value: dropped.append((key, value)))
    cache.put("a", 1, 3)
    cache.put("a", 2, 5)  # replaces: the old value is dropped, the weight is the new one
    assert dropped == [("a", 1)] and cache.weight == 5 and cache.get("a") == 2
    cache.put("b", 3, 1)
    assert cache.pop("b") == 3 and cache.weight == 5 and cache.pop("b", "gone") == "gone"
    assert dropped == [("a", 1)]  # pop hands the value back instead
    cache.clear()
    assert dropped == [("a", 1), ("a", 2)] and cache.weight == 0 and not cache


@pytest.mark.parametrize("bound", [1, 3, 7])
def test_the_bounds_hold_after_every_put(bound):
    cache = LRU(max_entries=bound, max_weight=2 * bound)
    for index in range(50):
        cache.put(index % 11, index, index % 3)
        assert len(cache) <= bound and cache.weight <= 2 * bound
        assert cache.weight == sum(cache.weights.values())


class _Entry:
    """What CallCache keeps: ``nbytes`` and ``free()`` (here: counted)."""

    def __init__(self, nbytes, freed):
        self.nbytes, self.freed = nbytes, freed

    def free(self):
        self.freed.append(self)


def test_the_call_cache_keeps_its_indices_true_over_the_lru(monkeypatch):
    from mpiallreduce import _state

    monkeypatch.setattr(_state, "CALLS", {})
    monkeypatch.setattr(_state, "LAST", {})
    last = _state.LAST
    freed = []
    cache = _state.CallCache(entries=2, nbytes=100)
    # keys as the call path makes them: key[2] is the recvbuf's id
    first, second, third = (_Entry(10, freed) for _ in range(3))
    assert cache.put(("c", "s1", "r"), first) and cache.put(("c", "s2", "r"), second)
    assert _state.LAST["r"] is second and cache.nbytes == 20
    replacement = _Entry(30, freed)
    assert cache.put(("c", "s2", "r"), replacement)  # replaced: the old one only freed
    assert freed == [second] and _state.CALLS[("c", "s2", "r")] is replacement
    assert _state.LAST["r"] is replacement and cache.nbytes == 40
    assert cache.put(("c", "s3", "q"), third)  # 3 entries > 2: the oldest (first) goes
    assert freed == [second, first] and ("c", "s1", "r") not in _state.CALLS
    assert last == {"r": replacement, "q": third}
    assert not cache.put(("c", "s4", "p"), _Entry(101, freed))  # alone past the bytes
    assert "p" not in _state.LAST and ("c", "s4", "p") not in _state.CALLS
    cache.max_entries = 0
    assert not cache.put(("c", "s5", "p"), _Entry(1, freed))
    cache.max_entries = 2
    # dropping the entry LAST names puts another one of the same recvbuf in its place
    other = _Entry(1, freed)
    assert cache.put(("c", "s6", "r"), other)  # evicts replacement; LAST["r"] is other
    assert _state.LAST["r"] is other and freed[-1] is replacement
    cache.clear()
    assert _state.CALLS == {} and _state.LAST == {} and cache.nbytes == 0
    assert set(map(id, freed)) == {id(e) for e in (first, second, replacement, third, other)}


def test_the_call_cache_frees_shapes_it_replaces_or_drops(monkeypatch):
    from mpiallreduce import _state

    monkeypatch.setattr(_state, "SHAPES", {})
    monkeypatch.setattr(_state, "SHAPES_PER_COMM", 2)
    shapes_kept = _state.SHAPES
    freed = []
    cache = _state.CallCache()
    shapes = [_Entry(0, freed) for _ in range(4)]
    cache.put_shape("a", shapes[0])
    cache.put_shape("a", shapes[1])  # replaced: freed, SHAPES names the new one
    assert freed == [shapes[0]] and shapes_kept == {"a": shapes[1]}
    cache.put_shape("b", shapes[2])
    cache.put_shape("c", shapes[3])  # past SHAPES_PER_COMM: the oldest ("a") goes
    assert freed == [shapes[0], shapes[1]]
    assert shapes_kept == {"b": shapes[2], "c": shapes[3]}
    cache.clear()
    assert _state.SHAPES == {} and len(freed) == 4


def test_the_call_cache_discards_an_entry_or_a_shape_now(monkeypatch):
    """discard/discard_shape (auto's learning drops its case's entries with them): the entry
    is freed and no index names it; a key it does not hold is no error."""
    from mpiallreduce import _state

    for name in ("CALLS", "LAST", "SHAPES"):
        monkeypatch.setattr(_state, name, {})
    freed = []
    cache = _state.CallCache(entries=4, nbytes=100)
    entry, other, shape = _Entry(10, freed), _Entry(5, freed), _Entry(0, freed)
    assert cache.put(("c", "s1", "r"), entry) and cache.put(("c", "s2", "r"), other)
    cache.put_shape("k", shape)
    cache.discard(("c", "s2", "r"))
    assert freed == [other] and ("c", "s2", "r") not in _state.CALLS
    assert _state.LAST["r"] is entry and cache.nbytes == 10
    cache.discard_shape("k")
    assert freed == [other, shape] and _state.SHAPES == {}
    cache.discard(("c", "nothing", "x"))
    cache.discard_shape("nothing")
    assert freed == [other, shape] and len(cache.entries) == 1
