"""GPU tests: rank counts come from EP_TEST_RANKS; everything skips cleanly without a GPU."""

from __future__ import annotations

import os

import pytest
import torch


def _rank_counts() -> list[int]:
    value = os.environ.get("EP_TEST_RANKS", "1,2,4,8")
    return [int(part) for part in value.split(",") if part.strip()]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (GPU tests run via scripts/gpu_check.sh)")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "num_ranks" in metafunc.fixturenames:
        metafunc.parametrize("num_ranks", _rank_counts(), ids=lambda n: f"{n}ranks")
