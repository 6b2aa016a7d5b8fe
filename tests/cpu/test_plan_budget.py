"""The planner's memory budget mode: the largest caps whose window fits, exactly at the boundary."""

from __future__ import annotations

import pytest

from deep_ep.plan import buffer_bytes
from deep_ep.plan.__main__ import main
from deep_ep.plan.budget import caps_within_budget, largest_fitting, parse_bytes

GiB = 1 << 30
# 16 ranks as 2 nodes of 8, a DeepSeek-V3-like layer.
SETUP = {"num_ranks": 16, "num_ranks_per_node": 8, "num_experts": 256, "num_topk": 8, "hidden": 7168, "use_fp8": True}


def _window(ht_tokens: int, ll_tokens: int) -> int:
    sizes = buffer_bytes(
        SETUP["num_ranks"],
        SETUP["num_ranks_per_node"],
        SETUP["num_experts"],
        SETUP["num_topk"],
        SETUP["hidden"],
        ht_tokens,
        ll_tokens,
        SETUP["use_fp8"],
    )
    return sizes["window"]["total_bytes"]


def test_largest_fitting_finds_the_boundary_and_respects_the_limit():
    assert largest_fitting(lambda n: n <= 37) == 37
    assert largest_fitting(lambda n: n <= 1024) == 1024
    assert largest_fitting(lambda n: False) == 0
    assert largest_fitting(lambda n: True, limit=100) == 100
    assert largest_fitting(lambda n: True, limit=64) == 64


def test_byte_sizes_parse_in_binary_units():
    assert parse_bytes("8GiB") == 8 * GiB
    assert parse_bytes("8G") == 8 * GiB
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5gib") == 3 * GiB // 2
    assert parse_bytes("1073741824") == GiB
    with pytest.raises(ValueError, match="must look like 8GiB"):
        parse_bytes("eight")


@pytest.mark.parametrize("budget", [2 * GiB, 8 * GiB, 40 * GiB])
def test_each_cap_is_the_largest_whose_window_fits(budget):
    ht_cap, ll_cap = 1024, 64
    caps = caps_within_budget(budget, **SETUP, num_max_tokens_per_rank=ht_cap, num_max_dispatch_tokens_per_rank=ll_cap)
    assert caps["configured_bytes"] == _window(ht_cap, ll_cap)
    assert caps["configured_fits"] == (_window(ht_cap, ll_cap) <= budget)
    windows = {
        "ht_with_ll": lambda n: _window(n, ll_cap),
        "ll_with_ht": lambda n: _window(ht_cap, n),
        "ht_only": lambda n: _window(n, 0),
        "ll_only": lambda n: _window(0, n),
    }
    for name, window in windows.items():
        cap = caps[name]
        assert cap == 0 or window(cap) <= budget, (name, cap)
        assert window(cap + 1) > budget, (name, cap)


def test_a_budget_below_one_token_gives_zero_caps():
    caps = caps_within_budget(1 << 20, **SETUP, num_max_tokens_per_rank=1, num_max_dispatch_tokens_per_rank=1)
    assert not caps["configured_fits"]
    assert (caps["ht_with_ll"], caps["ll_with_ht"], caps["ht_only"], caps["ll_only"]) == (0, 0, 0, 0)


def test_the_cli_prints_the_budget_section_and_refuses_a_bad_size(capsys):
    assert main(["--memory-budget", "8GiB", "--num-sampled-tokens", "200"]) == 0
    output = capsys.readouterr().out
    assert "Memory budget 8,589,934,592 B (8.00 GiB) per rank" in output
    assert "largest HT cap with LL 128" in output and "largest LL cap, LL-only buffer" in output
    assert main(["--memory-budget", "eight"]) == 2
    assert "--memory-budget: a byte size must look like 8GiB" in capsys.readouterr().err
