import pytest

from mpiallreduce.partition import block, block_counts, blocks, segments, span


@pytest.mark.parametrize("count", [0, 1, 2, 7, 64, 97, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8, 17])
def test_blocks_tile_the_range_and_differ_by_at_most_one(count, parts):
    ranges = blocks(count, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = block_counts(count, parts)
    assert max(sizes) - min(sizes) <= 1
    assert sorted(sizes, reverse=True) == sizes  # the larger blocks come first, as MPI users expect


def test_block_matches_the_formula():
    assert block(10, 3, 0) == (0, 4)
    assert block(10, 3, 1) == (4, 7)
    assert block(10, 3, 2) == (7, 10)
    assert block(2, 4, 3) == (2, 2)


def test_span_covers_contiguous_blocks():
    assert span(10, 4, 1, 3) == (block(10, 4, 1)[0], block(10, 4, 2)[1])
    assert span(10, 4, 2, 2) == (block(10, 4, 2)[0],) * 2


def test_segments():
    assert segments(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert segments(5, 5, 4) == [(5, 5)]
    with pytest.raises(ValueError, match="segment size"):
        segments(0, 4, 0)
