"""ElasticBuffer.get_theoretical_num_sms / num_qps with DeepEP V2's arguments, on a stand-in that
carries the attributes the mixin reads (no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deep_ep.high_throughput import DIRECT_SM_WRITE_GBS, NVLINK_GBS, HighThroughputMixin
from deep_ep.plan.estimates import theoretical_num_sms


class FakeBuffer(HighThroughputMixin):
    def __init__(self, num_ranks: int, num_scaleout_ranks: int, ranks_per_gpu: int = 1, cap: int = 132) -> None:
        self.num_ranks = num_ranks
        self.num_scaleout_ranks = num_scaleout_ranks
        self.topology = SimpleNamespace(ranks_per_gpu=ranks_per_gpu)
        self._max_num_sms = cap
        self._max_ht_num_sms = cap


def test_direct_mode_uses_the_calibrated_direct_model() -> None:
    buffer = FakeBuffer(8, 1)
    want = theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=NVLINK_GBS, sm_write_gbs=DIRECT_SM_WRITE_GBS)
    assert buffer.get_theoretical_num_sms(256, 8) == want
    assert buffer.get_theoretical_num_qps(want) == min(want, 9)


def test_hybrid_mode_uses_the_node_model_and_v2_link_rates() -> None:
    buffer = FakeBuffer(64, 8)
    got = buffer.get_theoretical_num_sms(256, 8, rdma_gbs=50.0, nvlink_gbs=400.0)
    want = theoretical_num_sms(256, 8, 64, 8, 8, nvlink_gbs=400.0, rdma_gbs=50.0, sm_write_gbs=DIRECT_SM_WRITE_GBS)
    assert got == want
    direct = theoretical_num_sms(256, 8, 64, 64, 1, nvlink_gbs=400.0, sm_write_gbs=DIRECT_SM_WRITE_GBS)
    assert want != direct  # the topology matters: the hybrid estimate is not the direct one
    assert buffer.get_theoretical_num_qps(got) == got * 16 + 1


def test_the_estimate_is_capped_at_the_rank_share() -> None:
    assert FakeBuffer(8, 1, cap=6).get_theoretical_num_sms(256, 8, sm_write_gbs=1.0) == 6


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_scaleout_topk": 4}, "num_scaleout_topk must be 0"),
        ({"rdma_gbs": -1.0}, "rdma_gbs must be a number >= 0"),
        ({"nvlink_gbs": "fast"}, "nvlink_gbs must be a number >= 0"),
        ({"sm_write_gbs": -5}, "sm_write_gbs must be a number >= 0"),
    ],
)
def test_bad_v2_arguments_raise_naming_them(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        FakeBuffer(8, 1).get_theoretical_num_sms(256, 8, **kwargs)
