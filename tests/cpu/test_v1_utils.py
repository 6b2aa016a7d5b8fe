"""DeepEP V1's small API surface: ``deep_ep.utils`` (events, ``utils.math`` casts and helpers),
``deep_ep.Config`` with its size hints and tuned tables, ``topk_idx_t`` and ``__version__``."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch

import deep_ep
from deep_ep import _C, ElasticBuffer, fp8
from deep_ep.compat.config import TOKENS_ENV, Config, get_combine_config, get_dispatch_config
from deep_ep.utils import EventHandle, EventOverlap
from deep_ep.utils import math as v1_math

SUPPORTED_RANKS = [2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160]


def _row(values: list[float], hidden: int) -> torch.Tensor:
    row = torch.zeros(1, hidden)
    row[0, : len(values)] = torch.tensor(values)
    return row


# ------------------------------------------------------------------ package surface


def test_package_exports_the_v1_names():
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.Config is Config
    assert deep_ep.get_dispatch_config is get_dispatch_config
    assert deep_ep.get_combine_config is get_combine_config
    assert deep_ep.utils.EventOverlap is deep_ep.EventOverlap is EventOverlap
    assert deep_ep.EventHandle is EventHandle
    assert deep_ep.utils.math.per_token_cast_to_fp8 is v1_math.per_token_cast_to_fp8
    for name in deep_ep.__all__:
        assert hasattr(deep_ep, name), name


def test_version_comes_from_the_installed_metadata():
    assert isinstance(deep_ep.__version__, str)
    assert deep_ep.__version__ == importlib.metadata.version("deep_ep")


def test_version_falls_back_when_the_package_is_not_installed(monkeypatch):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert deep_ep._package_version() == "0.0.0+unknown"


# ------------------------------------------------------------------ EventHandle


class _FakeStream:
    def __init__(self) -> None:
        self.recorded: list[object] = []
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def test_event_handle_is_a_cuda_event_so_the_buffer_accepts_it():
    # ElasticBuffer's previous_event takes an EventOverlap holding a torch.cuda.Event.
    assert issubclass(EventHandle, torch.cuda.Event)


def test_event_handle_records_on_the_current_stream_and_waits_on_the_current_one(monkeypatch):
    created_on, waiting = _FakeStream(), _FakeStream()
    current = [created_on]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda.Event, "record", lambda self, stream=None: stream.recorded.append(self))

    handle = EventHandle()
    assert created_on.recorded == [handle]
    current[0] = waiting
    handle.current_stream_wait()
    assert waiting.waited == [handle] and created_on.waited == []

    explicit = _FakeStream()
    other = EventHandle(explicit)
    assert explicit.recorded == [other] and waiting.recorded == []

    # Megatron's pattern: previous_event = EventOverlap(EventHandle()).
    EventOverlap(other).current_stream_wait()
    assert waiting.waited == [handle, other]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="EventHandle records a real CUDA event: needs a CUDA device")
def test_event_handle_orders_streams_on_a_gpu():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        value = torch.full((1 << 20,), 3.0, device="cuda")
        done = EventHandle()
    done.current_stream_wait()
    total = value.sum()
    torch.cuda.synchronize()
    assert done.query() and total.item() == 3.0 * (1 << 20)


# ------------------------------------------------------------------ utils.math casts


def test_aligned_cast_is_bitwise_the_strict_cast():
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    quantised, scales = v1_math.per_token_cast_to_fp8(x)
    strict_quantised, strict_scales = fp8.per_token_cast_to_fp8(x)
    assert torch.equal(quantised.view(torch.uint8), strict_quantised.view(torch.uint8))
    assert torch.equal(scales, strict_scales)
    assert torch.equal(v1_math.per_token_cast_back(quantised, scales), fp8.per_token_cast_back(quantised, scales))


def test_cast_back_reads_scales_by_their_contents_as_deepep_does():
    # DeepEP's LL test: packed UE8M0 scales [L, R * T, H / 512] made contiguous and viewed as
    # int32 [-1, H / 128] (a quarter as many rows as tokens), fp8 viewed as [-1, H].
    num_local, rows, hidden = 2, 8, 1024
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(num_local * rows, hidden, generator=generator)
    x = x * torch.rand(num_local * rows, 1, generator=generator)
    quantised, scales = fp8.per_token_cast_to_fp8(x.bfloat16(), round_scale=True)
    packed = fp8.pack_ue8m0(scales).view(num_local, rows, hidden // 512)
    expected = fp8.per_token_cast_back(quantised, scales)
    deepep_view = packed.contiguous().view(-1, hidden // 128)
    assert list(deepep_view.shape) == [num_local * rows // 4, hidden // 128]
    assert torch.equal(v1_math.per_token_cast_back(quantised, deepep_view), expected)
    # The same bytes in their own shape, and fp32 scales of another shape with the same contents.
    assert torch.equal(v1_math.per_token_cast_back(quantised, packed.view(-1, hidden // 512)), expected)
    assert torch.equal(v1_math.per_token_cast_back(quantised, scales.view(num_local, rows, -1)), expected)
    # Column-major fp32 scales are indexed, not reinterpreted.
    column_major = scales.t().contiguous().t()
    assert torch.equal(v1_math.per_token_cast_back(quantised, column_major), expected)
    with pytest.raises(ValueError, match="exponent bytes"):
        v1_math.per_token_cast_back(quantised, deepep_view[:-1])
    with pytest.raises(ValueError, match="float32 values"):
        v1_math.per_token_cast_back(quantised, scales[:-1])


def test_cast_pads_a_hidden_size_that_is_not_a_multiple_of_128():
    # n = 130: group 0 = channels 0..127 (amax 7: scale 7/448 = 1/64, quotient 64 exactly),
    # group 1 = channels 128, 129 plus 126 zero pads (amax 224: scale 1/2, quotient 2).
    x = _row([7.0, 3.5, -0.25], 130)
    x[0, 128:] = torch.tensor([224.0, -1.0])
    quantised, scales = v1_math.per_token_cast_to_fp8(x.bfloat16())
    assert quantised.dtype == torch.float8_e4m3fn and list(quantised.shape) == [1, 130]
    assert quantised.is_contiguous()
    assert scales.dtype == torch.float32 and scales.tolist() == [[1.0 / 64.0, 0.5]]
    assert quantised.float()[0, :4].tolist() == [448.0, 224.0, -16.0, 0.0]
    assert quantised.float()[0, 128:].tolist() == [448.0, -2.0]
    restored = v1_math.per_token_cast_back(quantised, scales)
    assert restored.dtype == torch.bfloat16 and list(restored.shape) == [1, 130]
    assert restored[0, :3].tolist() == [7.0, 3.5, -0.25] and restored[0, 128:].tolist() == [224.0, -1.0]
    # The strict cast (what the kernels are checked against) refuses this shape.
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.per_token_cast_to_fp8(x.bfloat16())


def test_cast_clamps_amax_of_a_zero_group_to_1e_minus_4():
    quantised, scales = v1_math.per_token_cast_to_fp8(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert scales.tolist() == [[float(np.float32(1e-4) / np.float32(448.0))]] * 2
    assert quantised.view(torch.uint8).eq(0).all()


def test_cast_divides_correctly_rounded_unlike_a_reciprocal_multiply():
    # amax 1.5, x = 1.125 * 2^-14: the correctly rounded 448 / 1.5 puts the product exactly on the
    # tie 21 * 2^-10 between E4M3 subnormals 10 and 11 * 2^-9 -> 10 * 2^-9 (even). A reciprocal
    # then multiply (how PyTorch may evaluate DeepEP's `448.0 / amax`) is one ulp larger -> 11 * 2^-9.
    value = float(np.float32(1.125 * 2.0**-14))
    x = _row([1.5, value], 128)
    quantised, _ = v1_math.per_token_cast_to_fp8(x)
    assert quantised.float()[0, 1].item() == 10 * 2.0**-9
    reciprocal_quotient = torch.tensor([1.5]).reciprocal() * 448.0
    assert (torch.tensor([value]) * reciprocal_quotient).to(torch.float8_e4m3fn).float().item() == 11 * 2.0**-9


def test_cast_accepts_float16_and_matches_the_float32_cast():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).half()
    quantised, scales = v1_math.per_token_cast_to_fp8(x)
    reference_quantised, reference_scales = fp8.per_token_cast_to_fp8(x.float())
    assert torch.equal(quantised.view(torch.uint8), reference_quantised.view(torch.uint8))
    assert torch.equal(scales, reference_scales)


def test_cast_wants_two_dimensions_like_deepep():
    with pytest.raises(ValueError, match="2-D"):
        v1_math.per_token_cast_to_fp8(torch.ones(2, 3, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        v1_math.per_token_cast_to_fp8(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        v1_math.per_token_cast_back(torch.zeros(2, 3, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 3, 1))


def test_round_trip_with_padding_stays_within_fp8_precision():
    x = torch.randn(32, 200, generator=torch.Generator().manual_seed(7)).bfloat16()
    quantised, scales = v1_math.per_token_cast_to_fp8(x)
    assert list(scales.shape) == [32, 2]
    restored = v1_math.per_token_cast_back(quantised, scales).float()
    reference = x.float()
    group_scales = scales.repeat_interleave(128, dim=1)[:, :200]
    bound = reference.abs() * (2.0**-4 + 2.0**-8) * (1 + 2.0**-4) + group_scales * 2.0**-10
    assert ((restored - reference).abs() <= bound).all()


def test_cast_back_reads_column_major_scales():
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(9)).bfloat16()
    quantised, scales = v1_math.per_token_cast_to_fp8(x)
    column_major = scales.t().contiguous().t()
    assert column_major.stride() == (1, 6)
    restored = v1_math.per_token_cast_back(quantised, column_major)
    assert torch.equal(restored, v1_math.per_token_cast_back(quantised, scales))


def test_cast_back_decodes_packed_ue8m0_scales():
    # One int32 packs the exponents of four 128-channel groups, lowest byte first:
    # 127 -> 2^0, 128 -> 2^1, 126 -> 2^-1, 0 -> 0.0.
    quantised = torch.full((1, 512), 3.0).to(torch.float8_e4m3fn)
    packed = torch.tensor([[127 | (128 << 8) | (126 << 16)]], dtype=torch.int32)
    restored = v1_math.per_token_cast_back(quantised, packed)
    assert restored.dtype == torch.bfloat16
    assert [restored[0, 128 * g].item() for g in range(4)] == [3.0, 6.0, 1.5, 0.0]
    as_float = torch.tensor([[1.0, 2.0, 0.5, 0.0]])
    assert torch.equal(restored, v1_math.per_token_cast_back(quantised, as_float))
    with pytest.raises(ValueError, match="UE8M0"):
        v1_math.per_token_cast_back(quantised, torch.zeros(1, 4, dtype=torch.int32))


def test_cast_back_of_an_empty_input_is_empty_bf16():
    restored = v1_math.per_token_cast_back(torch.empty(0, 256, dtype=torch.float8_e4m3fn), torch.empty(0, 2))
    assert restored.dtype == torch.bfloat16 and list(restored.shape) == [0, 256]


def test_cast_back_rejects_mismatched_or_unsupported_scales():
    quantised = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"must hold 2 x 2 float32 values.*got float32 \[2, 3\]"):
        v1_math.per_token_cast_back(quantised, torch.ones(2, 3))
    with pytest.raises(ValueError, match="float32 or int32"):
        v1_math.per_token_cast_back(quantised, torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        v1_math.per_token_cast_back(torch.zeros(2, 256), torch.ones(2, 2))


# ------------------------------------------------------------------ utils.math helpers


def test_integer_helpers():
    assert v1_math.ceil_div(7168, 128) == 56 and v1_math.ceil_div(130, 128) == 2 and v1_math.ceil_div(0, 4) == 0
    assert v1_math.align(130, 128) == 256 and v1_math.align(256, 128) == 256
    assert v1_math.safe_div(0, 0) == 0 and v1_math.safe_div(3, 2) == 1.5
    with pytest.raises(ZeroDivisionError):
        v1_math.safe_div(1, 0)


def test_calc_diff_on_hand_worked_values():
    x = torch.zeros(4)
    assert v1_math.calc_diff(x, x) == 0.0
    # x' = 1, y' = 2 everywhere: 1 - 2 * 2 / (1 + 4) = 0.2.
    assert v1_math.calc_diff(torch.zeros(3), torch.ones(3)) == pytest.approx(0.2, abs=1e-15)


def test_inplace_unique_keeps_distinct_ids_descending_then_minus_one():
    x = torch.tensor([[3, 1, 3, -1], [0, 0, 0, 0], [-1, -1, 2, 1]])
    v1_math.inplace_unique(x, 4)
    assert x.tolist() == [[3, 1, -1, -1], [0, -1, -1, -1], [2, 1, -1, -1]]
    narrow = torch.tensor([[1, 0, 1]])
    v1_math.inplace_unique(narrow, 2)
    assert narrow.tolist() == [[1, 0, -1]]


def test_create_grouped_scores_zeroes_experts_outside_the_chosen_groups():
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    grouped = v1_math.create_grouped_scores(scores, torch.tensor([[2, 0]]), 3)
    assert grouped.tolist() == [[1.0, 2.0, 0.0, 0.0, 5.0, 6.0]]


def test_hashes_and_byte_counts():
    ints = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert v1_math.hash_tensor(ints) == 6
    halves = torch.tensor([1.0], dtype=torch.bfloat16)  # bytes 0x80 0x3f
    assert v1_math.hash_tensor(halves) == 0x80 + 0x3F
    assert v1_math.hash_tensors(ints, None, [halves, (ints,)]) == 6 ^ (0x80 + 0x3F) ^ 6
    assert v1_math.count_bytes(ints, None, (halves, [torch.zeros(2, 3)])) == 12 + 2 + 24


# ------------------------------------------------------------------ Config


def test_config_defaults_and_keyword_construction():
    default = Config()
    assert (
        default.num_sms,
        default.num_max_nvl_chunked_send_tokens,
        default.num_max_nvl_chunked_recv_tokens,
        default.num_max_rdma_chunked_send_tokens,
        default.num_max_rdma_chunked_recv_tokens,
    ) == (20, 6, 256, 6, 258)  # RDMA recv rounded up to a multiple of the send chunk, as V1 does
    settings = {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 8,
        "num_max_nvl_chunked_recv_tokens": 512,
        "num_max_rdma_chunked_send_tokens": 16,
        "num_max_rdma_chunked_recv_tokens": 128,
    }
    by_keyword = Config(**settings)
    assert vars(by_keyword) == settings
    assert vars(Config(24, 8, 512, 16, 128)) == settings
    assert vars(eval(repr(by_keyword), {"Config": Config})) == settings


def test_config_rejects_what_v1_asserts():
    with pytest.raises(ValueError, match="num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens"):
        Config(20, 256, 256, 6, 128)
    with pytest.raises(ValueError, match="at most half"):
        Config(20, 6, 256, 128, 128)
    with pytest.raises(ValueError, match="positive"):
        Config(20, 6, 256, 0, 128)
    with pytest.raises(ValueError, match="num_sms"):
        Config(-2)
    with pytest.raises(TypeError, match="num_sms"):
        Config(20.0)


def test_tuned_tables_match_v1():
    dispatch_8 = get_dispatch_config(8)
    assert vars(dispatch_8) == vars(Config(20, 6, 256, 6, 128))
    assert dispatch_8.num_max_rdma_chunked_recv_tokens == 132
    assert vars(get_dispatch_config(16)) == vars(Config(20, 36, 288, 20, 128))
    assert vars(get_combine_config(8)) == vars(Config(20, 4, 256, 6, 128))
    assert vars(get_dispatch_config(160)) == vars(Config(20, 28, 720, 12, 128))
    assert vars(get_combine_config(2)) == vars(Config(20, 10, 256, 6, 128))
    assert get_dispatch_config(8, num_sms=24).num_sms == 24
    for num_ranks in SUPPORTED_RANKS:
        assert get_dispatch_config(num_ranks).num_sms == get_combine_config(num_ranks).num_sms == 20


@pytest.mark.parametrize("num_ranks", [1, 3, 12, 256])
def test_unsupported_rank_counts_raise_like_v1(num_ranks):
    for lookup in (get_dispatch_config, get_combine_config):
        with pytest.raises(ValueError, match=f"{num_ranks} ranks"):
            lookup(num_ranks)
        with pytest.raises(AssertionError):  # V1 asserts
            lookup(num_ranks)


# ------------------------------------------------------------------ size hints


def _window(num_ranks: int, scaleup: int, tokens: int, hidden: int, num_topk: int, use_fp8: bool) -> int:
    region = _C.high_throughput_layout(num_ranks, scaleup, tokens, hidden, num_topk, use_fp8)["region_bytes"]
    return _C.window_layout(region, 0)["total_bytes"]


def test_worked_example_equals_our_geometry():
    # R = 8, H = 7168 (hidden_bytes = 2 H), default dispatch config: 10 channels x 256 slots.
    config = get_dispatch_config(8)
    assert config.get_num_max_tokens_per_rank() == 2560
    hint = config.get_nvl_buffer_size_hint(2 * 7168, 8)
    assert hint == _window(8, 8, 2560, 7168, 32, False)
    # Every source rank's 2560 bf16 rows (payload alone 14336 B) land in this rank's window.
    assert hint >= _C.WORKSPACE_BYTES + 8 * 2560 * 14336
    assert hint % _C.WINDOW_ALIGN_BYTES == 0
    assert config.get_rdma_buffer_size_hint(2 * 7168, 8) == 0
    # Above 8 ranks: the larger of a direct window and a hybrid one with 8-rank nodes.
    config = get_dispatch_config(16)
    expected = max(_window(16, 16, 2880, 7168, 32, fp) for fp in (False, True))
    expected = max(expected, *(_window(16, 8, 2880, 7168, 32, fp) for fp in (False, True)))
    assert config.get_nvl_buffer_size_hint(2 * 7168, 16) == expected


@pytest.mark.parametrize("num_ranks", SUPPORTED_RANKS)
def test_client_allocation_fits_every_call_the_config_allows(num_ranks):
    """A V1 client allocating max(hint) over its configs fits T_max tokens per rank in any format,
    top-k and (above 8 ranks) either HT mode."""
    configs = (get_dispatch_config(num_ranks), get_combine_config(num_ranks))
    hidden = 7168
    allocated = max(config.get_nvl_buffer_size_hint(2 * hidden, num_ranks) for config in configs)
    tokens = max(config.get_num_max_tokens_per_rank() for config in configs)
    assert tokens == 10 * configs[0].num_max_nvl_chunked_recv_tokens
    scaleups = [num_ranks] + ([8] if num_ranks > 8 else [])
    for scaleup in scaleups:
        for num_topk in (1, 8, 32):
            for use_fp8 in (False, True):
                assert _window(num_ranks, scaleup, tokens, hidden, num_topk, use_fp8) <= allocated


def test_hint_grows_with_the_config_and_ignores_the_rdma_chunks():
    def hint(*args: int) -> int:
        return Config(*args).get_nvl_buffer_size_hint(2 * 4096, 8)

    base = hint(20, 6, 256, 6, 128)
    assert hint(24, 6, 256, 6, 128) > base  # more channels
    assert hint(20, 6, 512, 6, 128) > base  # deeper rings
    assert hint(21, 6, 256, 6, 128) == base  # channels = num_sms // 2
    assert hint(20, 100, 256, 6, 128) == base  # send chunks size nothing
    assert hint(20, 6, 256, 32, 1024) == base  # RDMA chunks size nothing
    sizes = [hint(num_sms, 6, 256, 6, 128) for num_sms in range(0, 66, 2)]
    assert sizes == sorted(sizes)
    assert sizes[0] == _C.WORKSPACE_BYTES  # no channel, no token


def test_hint_reads_hidden_bytes_as_v1_clients_compute_it():
    config = Config()
    bf16 = config.get_nvl_buffer_size_hint(2 * 7168, 8)
    assert config.get_nvl_buffer_size_hint(2 * 7168 - 1, 8) == bf16  # rounded up to whole, 8-aligned H
    assert config.get_nvl_buffer_size_hint(2 * 7168 - 12, 8) == bf16
    # An odd byte count rounds H up (to 7176, 16 more bytes a row), never down; 65536 tokens per
    # rank make those bytes outgrow the 2 MiB alignment.
    large = Config(128, 6, 1024, 6, 128)
    assert large.get_nvl_buffer_size_hint(2 * 7168 + 1, 8) == _window(8, 8, 65536, 7176, 32, False)
    assert _window(8, 8, 65536, 7176, 32, False) > _window(8, 8, 65536, 7168, 32, False)
    assert config.get_nvl_buffer_size_hint(4 * 7168, 8) == _window(8, 8, 2560, 14336, 32, False)
    with pytest.raises(ValueError, match="hidden_bytes"):
        config.get_nvl_buffer_size_hint(0, 8)


def test_hints_check_the_rank_count_like_v1():
    config, odd = Config(), Config(21)
    for name in ("get_nvl_buffer_size_hint", "get_rdma_buffer_size_hint"):
        with pytest.raises(ValueError, match="multiple of it"):
            getattr(config, name)(2 * 7168, 12)
        with pytest.raises(ValueError, match="even"):
            getattr(odd, name)(2 * 7168, 16)
    assert odd.get_nvl_buffer_size_hint(2 * 7168, 4) == config.get_nvl_buffer_size_hint(2 * 7168, 4)


def test_environment_override_sizes_for_exactly_that_many_tokens(monkeypatch):
    monkeypatch.setenv(TOKENS_ENV, "4096")
    for config in (Config(), Config(64, 6, 1024, 6, 128)):
        assert config.get_num_max_tokens_per_rank() == 4096
        assert config.get_nvl_buffer_size_hint(2 * 7168, 8) == _window(8, 8, 4096, 7168, 32, False)
    for bad in ("0", "-5", "many"):
        monkeypatch.setenv(TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=TOKENS_ENV):
            Config().get_nvl_buffer_size_hint(2 * 7168, 8)


def test_low_latency_hint_is_our_exact_low_latency_window():
    hint = deep_ep.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint == ElasticBuffer.get_low_latency_size_hint(128, 7168, 8, 256)
    region = _C.low_latency_layout(8, 128, 7168, 256, 0)["region_bytes"]
    assert hint == _C.window_layout(0, region)["total_bytes"]
    assert deep_ep.get_low_latency_rdma_size_hint(256, 7168, 8, 256) > hint
    with pytest.raises(ValueError, match="num_experts"):
        deep_ep.get_low_latency_rdma_size_hint(128, 7168, 8, 260)
