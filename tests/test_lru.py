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
