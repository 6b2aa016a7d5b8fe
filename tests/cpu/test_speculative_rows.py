"""The speculative output capacity of an uncached HT dispatch (EP_HT_SPECULATIVE_EPILOGUE): the
previous count of the shape plus a quarter and 128 rows, in whole 128-row blocks, capped at the
worst case."""

from __future__ import annotations

import pytest

from deep_ep.high_throughput import SPECULATIVE_HEADROOM_ROWS, speculative_rows


@pytest.mark.parametrize(
    ("last", "worst", "expected"),
    [
        (0, 8192, 128),  # no rows last time: one block of headroom
        (1000, 8192, 1408),  # 1000 + 250 + 128 = 1378, in whole blocks
        (1024, 8192, 1408),  # 1024 + 256 + 128 = 1408 exactly
        (8000, 8192, 8192),  # capped at the worst case
        (100, 64, 64),  # a worst case below one block
    ],
)
def test_capacity_is_last_plus_a_quarter_and_a_block_capped_at_the_worst_case(last, worst, expected):
    assert speculative_rows(last, worst) == expected


def test_capacity_never_falls_below_the_last_count_unless_capped():
    for last in range(0, 5000, 37):
        rows = speculative_rows(last, 1 << 20)
        assert rows >= last + SPECULATIVE_HEADROOM_ROWS and rows % SPECULATIVE_HEADROOM_ROWS == 0
