"""LowLatencyMixin argument validation, without a GPU.

A small stand-in for ElasticBuffer carries the attributes the mixin reads; every call below must
raise before it reaches a kernel launch (the stand-in has no runtime, so reaching one would fail
with AttributeError instead of the asserted error).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
from buffer_settings import buffer_settings

from deep_ep import _C
from deep_ep.low_latency import KERNEL_NAMES, LowLatencyHandle, LowLatencyMixin

CAP = 16
HIDDEN = 256
NUM_RANKS = 2
NUM_EXPERTS = 8
LL_TOPK = 4
NUM_LOCAL = NUM_EXPERTS // NUM_RANKS
_serials = itertools.count(1)


class FakeBuffer(LowLatencyMixin):
    """The attributes ElasticBuffer gives the mixin; tensors live on the CPU."""

    def __init__(self) -> None:
        self.num_ranks = NUM_RANKS
        self.hidden = HIDDEN
        self.device = 0
        self.num_max_dispatch_tokens_per_rank = CAP
        self.num_experts = NUM_EXPERTS
        self.num_ll_topk = LL_TOPK
        self._max_num_sms = 4
        self._serial = next(_serials)

    def _ensure_usable(self) -> None:
        pass

    def _check_fatal_errors(self, call: str | None = None) -> None:
        pass

    def _ll_device(self) -> torch.device:
        return torch.device("cpu")


def _x(num_tokens: int = 4, hidden: int = HIDDEN, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.ones(num_tokens, hidden, dtype=dtype)


def _idx(num_tokens: int = 4, num_topk: int = LL_TOPK, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(num_tokens, num_topk, dtype=dtype)


def _handle(buffer: FakeBuffer, *, num_tokens: int = 4, received: bool = True, op_index: int = 0) -> LowLatencyHandle:
    empty = torch.empty(0, dtype=torch.int32)
    return LowLatencyHandle(
        owner_id=buffer._serial,
        area=0,
        op_index=op_index,
        num_tokens=num_tokens,
        num_topk=LL_TOPK,
        num_max_dispatch_tokens_per_rank=CAP,
        hidden=HIDDEN,
        num_experts=NUM_EXPERTS,
        use_fp8=True,
        recv_count=empty,
        count_per_source=empty,
        recv_src_token=empty,
        recv_topk_slot=empty,
        received=received,
    )


def _combine_x() -> torch.Tensor:
    return torch.zeros(NUM_LOCAL, NUM_RANKS * CAP, HIDDEN, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("x", "topk_idx", "words"),
    [
        (_x(CAP + 1), _idx(CAP + 1), ["17 tokens", f"num_max_dispatch_tokens_per_rank={CAP}"]),
        (_x(hidden=200), _idx(), ["multiple of 128", "H=200"]),
        (_x(hidden=HIDDEN + 128), _idx(), ["the buffer's hidden", "384"]),
        (_x(dtype=torch.float32), _idx(), ["bfloat16", "float32"]),
        (torch.ones(4, 2, HIDDEN, dtype=torch.bfloat16), _idx(), ["bfloat16 [T, 256]"]),
        (_x(), _idx(dtype=torch.int32), ["int64", "int32 [4, 4]"]),
        (_x(), _idx(num_tokens=3), ["int64 [4, K]", "[3, 4]"]),
        (_x(), _idx(num_topk=LL_TOPK + 1), ["1 <= K <= 4", "low-latency top-k"]),
    ],
    ids=["too_many_tokens", "hidden_not_128", "hidden_not_buffers", "x_dtype", "x_rank", "idx_dtype", "idx_rows", "k"],
)
def test_dispatch_rejects_bad_inputs_naming_the_rule(x: torch.Tensor, topk_idx: torch.Tensor, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        FakeBuffer().low_latency_dispatch(x, topk_idx, CAP, NUM_EXPERTS)
    for word in words:
        assert word in str(info.value)


def test_dispatch_requires_the_buffers_cap_and_expert_count() -> None:
    buffer = FakeBuffer()
    with pytest.raises(
        ValueError, match=rf"num_max_dispatch_tokens_per_rank must equal the buffer's \({CAP}\), got 32"
    ):
        buffer.low_latency_dispatch(_x(), _idx(), 32, NUM_EXPERTS)
    with pytest.raises(ValueError, match=rf"num_experts must equal the buffer's \({NUM_EXPERTS}\), got 16"):
        buffer.low_latency_dispatch(_x(), _idx(), CAP, 16)


def test_dispatch_without_low_latency_region_raises() -> None:
    buffer = FakeBuffer()
    buffer.num_max_dispatch_tokens_per_rank = 0
    with pytest.raises(ValueError, match="no low-latency region"):
        buffer.low_latency_dispatch(_x(), _idx(), 0, NUM_EXPERTS)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"use_fp8": False, "round_scale": True}, ValueError, "needs use_fp8=True"),
        ({"use_ue8m0": True}, ValueError, "needs round_scale=True"),
        ({"use_ue8m0": True, "round_scale": True}, ValueError, "multiple of 512, got 256"),
        ({"recv_layout": "blocks"}, ValueError, "recv_layout must be one of"),
        ({"recv_layout": "per_source", "use_tma_aligned_col_major_sf": True}, ValueError, "recv_layout='compact'"),
        ({"round_scale": 1}, TypeError, "round_scale must be a bool"),
        ({"cumulative_local_expert_recv_stats": torch.zeros(NUM_LOCAL, dtype=torch.int64)}, ValueError, "int32 [4]"),
        ({"dispatch_wait_recv_cost_stats": torch.zeros(NUM_RANKS + 1, dtype=torch.int64)}, ValueError, "int64 [2]"),
        ({"dispatch_wait_recv_cost_stats": [0, 0]}, TypeError, "must be a tensor"),
    ],
    ids=["round_bf16", "ue8m0_no_round", "ue8m0_hidden", "layout", "col_per_source", "bool", "stats", "cost", "list"],
)
def test_dispatch_options_follow_their_rules(options: dict, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        FakeBuffer().low_latency_dispatch(_x(), _idx(), CAP, NUM_EXPERTS, **options)
    assert words in str(info.value)


def test_async_finish_and_hook_together_are_rejected() -> None:
    buffer = FakeBuffer()
    with pytest.raises(ValueError, match="cannot be combined"):
        buffer.low_latency_dispatch(_x(), _idx(), CAP, NUM_EXPERTS, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="cannot be combined"):
        buffer.low_latency_combine(
            _combine_x(), _idx(), torch.zeros(4, LL_TOPK), _handle(buffer), async_finish=True, return_recv_hook=True
        )


def test_a_third_outstanding_operation_raises_naming_the_rule() -> None:
    buffer = FakeBuffer()
    buffer._ll_num_pending = 2
    with pytest.raises(RuntimeError, match="at most two low-latency operations may be outstanding"):
        buffer.low_latency_dispatch(_x(), _idx(), CAP, NUM_EXPERTS, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="at most two low-latency operations may be outstanding"):
        buffer.low_latency_combine(_combine_x(), _idx(), torch.zeros(4, LL_TOPK), _handle(buffer))


def test_combine_checks_zero_copy_and_its_stats_argument() -> None:
    buffer = FakeBuffer()
    args = (_combine_x(), _idx(), torch.zeros(4, LL_TOPK), _handle(buffer))
    with pytest.raises(TypeError, match="zero_copy must be a bool"):
        buffer.low_latency_combine(*args, zero_copy="yes")
    with pytest.raises(ValueError, match="combine_wait_recv_cost_stats must be a contiguous int64 \\[2\\]"):
        buffer.low_latency_combine(*args, combine_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int32))


def test_combine_rejects_foreign_unreceived_and_stale_handles() -> None:
    buffer, other = FakeBuffer(), FakeBuffer()
    args = (_combine_x(), _idx(), torch.zeros(4, LL_TOPK))
    with pytest.raises(TypeError, match="LowLatencyHandle"):
        buffer.low_latency_combine(*args, handle=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="another buffer"):
        buffer.low_latency_combine(*args, handle=_handle(other))
    with pytest.raises(RuntimeError, match="call its hook"):
        buffer.low_latency_combine(*args, handle=_handle(buffer, received=False))
    buffer._ll_num_ops = 3
    with pytest.raises(RuntimeError, match="stale"):
        buffer.low_latency_combine(*args, handle=_handle(buffer, op_index=0))


@pytest.mark.parametrize(
    ("x", "topk_idx", "weights", "out", "words"),
    [
        (_combine_x()[:, :-1], _idx(), torch.zeros(4, LL_TOPK), None, ["x must be bfloat16 [4, 32, 256]"]),
        (_combine_x().float(), _idx(), torch.zeros(4, LL_TOPK), None, ["x must be bfloat16"]),
        (_combine_x(), _idx(num_tokens=5), torch.zeros(5, LL_TOPK), None, ["topk_idx must be int64 [4, 4]"]),
        (_combine_x(), _idx(), torch.zeros(4, LL_TOPK, dtype=torch.float64), None, ["topk_weights must be float32"]),
        (_combine_x(), _idx(), torch.zeros(4, LL_TOPK), torch.empty(4, HIDDEN), ["out must be bfloat16 [4, 256]"]),
        (
            _combine_x(),
            _idx(),
            torch.zeros(4, LL_TOPK),
            torch.empty(HIDDEN, 4, dtype=torch.bfloat16).t(),
            ["out must be contiguous"],
        ),
    ],
    ids=["x_shape", "x_dtype", "idx_rows", "weights_dtype", "out_dtype", "out_strides"],
)
def test_combine_rejects_bad_inputs_naming_the_rule(
    x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None, words: list[str]
) -> None:
    buffer = FakeBuffer()
    with pytest.raises(ValueError) as info:
        buffer.low_latency_combine(x, topk_idx, weights, _handle(buffer), out=out)
    for word in words:
        assert word in str(info.value)


def test_tensors_on_another_device_are_rejected() -> None:
    buffer = FakeBuffer()
    buffer._ll_device = lambda: torch.device("cuda", 0)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="x must be on cuda:0"):
        buffer.low_latency_dispatch(_x(), _idx(), CAP, NUM_EXPERTS)


def test_non_tensor_arguments_are_type_errors_naming_the_argument() -> None:
    buffer = FakeBuffer()
    with pytest.raises(TypeError, match=r"x must be a tensor \(bfloat16 \[T, 256\]\), got list"):
        buffer.low_latency_dispatch([[0.0]], _idx(), CAP, NUM_EXPERTS)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="topk_idx must be a tensor"):
        buffer.low_latency_dispatch(_x(), None, CAP, NUM_EXPERTS)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- rank masking


class MaskingBuffer(FakeBuffer):
    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.rank_idx = 0
        self._torch_device = torch.device("cpu")
        self._ll_rank_mask = torch.zeros(NUM_RANKS, dtype=torch.int32) if enabled else None


def test_mask_calls_without_rank_masking_name_the_constructor_argument():
    buffer = MaskingBuffer(enabled=False)
    for call in (
        lambda: buffer.low_latency_update_mask_buffer(1, True),
        lambda: buffer.low_latency_query_mask_buffer(torch.zeros(NUM_RANKS, dtype=torch.int32)),
        buffer.low_latency_clean_mask_buffer,
    ):
        with pytest.raises(RuntimeError, match="enable_rank_masking=True"):
            call()


def test_update_query_and_clean_round_trip_through_the_mask():
    buffer = MaskingBuffer()
    status = torch.full((NUM_RANKS,), -1, dtype=torch.int32)
    buffer.low_latency_update_mask_buffer(1, True)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 1]
    assert buffer._ll_masked_ranks() == [1]
    buffer.low_latency_update_mask_buffer(1, False)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0]
    buffer.low_latency_update_mask_buffer(1, True)
    buffer.low_latency_clean_mask_buffer()
    assert buffer._ll_masked_ranks() == []


@pytest.mark.parametrize(
    ("rank", "message"), [(0, "cannot mask itself"), (NUM_RANKS, "rank_to_mask must be a rank"), (-1, "rank_to_mask")]
)
def test_update_refuses_its_own_rank_and_ranks_outside_the_group(rank, message):
    with pytest.raises(ValueError, match=message):
        MaskingBuffer().low_latency_update_mask_buffer(rank, True)


@pytest.mark.parametrize(
    "status",
    [torch.zeros(NUM_RANKS, dtype=torch.int64), torch.zeros(NUM_RANKS + 1, dtype=torch.int32)],
    ids=["int64", "wrong-length"],
)
def test_query_refuses_a_status_tensor_of_another_dtype_or_size(status):
    with pytest.raises(ValueError, match="mask_status must be an int32 tensor of 2 elements"):
        MaskingBuffer().low_latency_query_mask_buffer(status)


def test_rank_masking_needs_a_low_latency_region():
    from deep_ep.buffer import ElasticBuffer

    settings = buffer_settings(hidden=HIDDEN, num_topk=LL_TOPK, num_experts=NUM_EXPERTS)
    with pytest.raises(ValueError, match="enable_rank_masking=True masks ranks in low-latency operations only"):
        ElasticBuffer._check_settings(**settings, enable_rank_masking=True)
    assert ElasticBuffer._check_settings(**settings)["enable_rank_masking"] is False
    settings["num_max_dispatch_tokens_per_rank"] = CAP
    assert ElasticBuffer._check_settings(**settings, enable_rank_masking=True)["enable_rank_masking"] is True


# ------------------------------------------------------------- kernel functions and phases
#
# DeepEP's bench_kineto finds the LL kernels of a profile by the words "dispatch" and "combine" and
# needs each to name exactly one kernel: one kernel function per operation, launched once without a
# receive hook and twice with one. What is checkable without a GPU is checked here; the profiles
# themselves are in tests/gpu/test_low_latency.py (_launches).

OPERATION_WORDS = ("dispatch", "combine")


def test_each_operation_kernel_name_carries_its_own_word_only() -> None:
    assert len(KERNEL_NAMES) == len(OPERATION_WORDS)
    for name, word in zip(KERNEL_NAMES, OPERATION_WORDS, strict=True):
        assert [w for w in OPERATION_WORDS if w in name] == [word], name


def _without_anonymous_namespaces(mangled: str) -> str:
    """``mangled`` without nvcc's per-file anonymous namespace names (``_GLOBAL__N__<hash>_<n>_<file
    name>_<hash>``, length-prefixed), which demanglers, and so profilers, print as ``(anonymous
    namespace)``: the file name is never part of what a profiler shows."""
    while (match := re.search(r"(\d+)(?=_GLOBAL__N_)", mangled)) is not None:
        mangled = mangled[: match.start()] + mangled[match.end() + int(match.group(1)) :]
    return mangled


def _device_kernel_entries() -> list[str]:
    """Mangled names of the kernels in the extension's device code (the cubins' per-kernel
    ``.nv.info.<name>`` sections); empty when the device code is stored compressed."""
    data = Path(_C.__file__).read_bytes()
    return sorted({name.decode() for name in re.findall(rb"\.nv\.info\.(_Z[A-Za-z0-9_]+)", data)})


def test_the_extension_has_one_kernel_function_per_low_latency_operation() -> None:
    """Every kernel of the LL source files is one of KERNEL_NAMES (no separate send or receive
    kernel), both are there, and each one's full name (template arguments and parameter types as a
    profiler shows them) contains its own operation word and not the other's."""
    entries = _device_kernel_entries()
    if not entries:
        pytest.skip("the extension's device code is compressed: no kernel names to read")
    # nvcc names each file's anonymous namespace after the file: low_latency_dispatch.cu, ...combine.cu.
    from_ll_files = [name for name in entries if "_low_latency_" in name]
    low_latency = [name for name in entries if name in from_ll_files or any(k in name for k in KERNEL_NAMES)]
    for name in low_latency:
        functions = [kernel for kernel in KERNEL_NAMES if f"{len(kernel)}{kernel}" in name]
        assert len(functions) == 1, f"{name}: a kernel of the LL source files that is not one of {KERNEL_NAMES}"
        visible = _without_anonymous_namespaces(name)
        words = [word for word in OPERATION_WORDS if word in visible]
        assert words == [word for word in OPERATION_WORDS if word in functions[0]], (visible, words)
    for kernel in KERNEL_NAMES:
        assert any(kernel in name for name in low_latency), f"{kernel} is not in the extension"


def test_without_hook_one_launch_runs_both_phases_and_with_one_the_hook_launches_the_receive_phase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every mode goes through one launcher, which launches the operation's one kernel function with
    the phases as an argument: both at once without a hook, send now and receive from the hook."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    buffer = FakeBuffer()
    launched: list[tuple[int, str]] = []
    received: list[bool] = []

    def launch(phases: int, stream: str) -> None:
        launched.append((phases, stream))

    event, hook = buffer._ll_run("low_latency_dispatch", launch, lambda: received.append(True), False, False, ())
    assert (event, hook) == (None, None)
    assert launched == [(_C.LL_PHASE_BOTH, "stream")] and received == [True]

    launched.clear()
    received.clear()
    event, hook = buffer._ll_run("low_latency_dispatch", launch, lambda: received.append(True), False, True, ())
    assert event is None and hook is not None
    assert launched == [(_C.LL_PHASE_SEND, "stream")] and received == [] and buffer._ll_num_pending == 1
    hook()
    assert launched == [(_C.LL_PHASE_SEND, "stream"), (_C.LL_PHASE_RECEIVE, "stream")] and received == [True]
    assert buffer._ll_num_pending == 0
    assert (_C.LL_PHASE_SEND | _C.LL_PHASE_RECEIVE) == _C.LL_PHASE_BOTH
