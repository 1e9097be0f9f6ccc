"""Row ownership and layout refusals of flowlock.parallel that need no process group."""

import pytest

from flowlock.parallel import RowShards, check_heads


@pytest.mark.parametrize("seq_len, degree, sizes", [(24, 4, [6, 6, 6, 6]), (25, 4, [7, 6, 6, 6]),
                                                    (3, 4, [1, 1, 1, 0]), (25, 2, [13, 12]), (0, 2, [0, 0])])
def test_row_shards_are_tensor_split_blocks(seq_len, degree, sizes):
    shards = [RowShards(seq_len, degree, r) for r in range(degree)]
    assert shards[0].sizes == sizes
    assert [s.bounds() for s in shards] == [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(degree)]
    assert shards[0].padded == max(sizes)


def test_row_shards_refuse_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        RowShards(8, 2, 2)


def test_heads_not_divisible_by_the_degree_are_refused_with_the_supported_degrees():
    with pytest.raises(ValueError, match=r"degree 3 does not divide the 56 heads.*\[1, 2, 4, 7, 8, 14, 28, 56\]"):
        check_heads(56, 3)
    check_heads(56, 7)
