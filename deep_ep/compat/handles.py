"""The handles a V1 ``Buffer`` returns: :class:`DispatchHandle` (HT: the core's ``EPHandle`` with V1's
tuple view of it) and :class:`LowLatencyDispatchHandle` (LL: V1's 5-tuple carrying the core's
``LowLatencyHandle``). Both are accepted back by the calls that take a handle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from deep_ep._util import describe_with_device
from deep_ep.compat.layout import dispatch_layout
from deep_ep.compat.outputs import fit_rows
from deep_ep.handle import EPHandle
from deep_ep.low_latency import LowLatencyHandle

__all__ = ["DispatchHandle", "LowLatencyDispatchHandle"]


_UNAVAILABLE_CHANNELS = (
    "is bookkeeping of V1's channel ring buffers (per-channel prefix sums and ring positions), which this "
    "implementation does not have: combine and cached dispatch take the whole handle instead"
)


class DispatchHandle:
    """What ``Buffer.dispatch`` returns as ``handle``: the core's ``EPHandle`` (``.core``) plus the
    V1 view of it. Pass it back to ``dispatch(handle=)`` and ``combine``.

    Indexable like V1's tuple where we can give V1's value exactly; other positions raise IndexError
    naming what is missing (iteration and unpacking raise TypeError: V1's tuple cannot be rebuilt).
    One node (V1's intranode tuple, ``len == 6``): ``[0]`` ``rank_prefix_matrix`` int32 [R, R]
    (``[i, j]``: tokens ranks ``0..i`` sent to rank ``j``; rows ``[M[i - 1, rank], M[i, rank])`` of
    the outputs came from rank ``i``), ``[3]`` ``recv_src_idx`` int32 [N] (source token of each
    received row) and ``[4]`` ``is_token_in_rank`` bool [T, R]. Several nodes (hybrid mode; V1's
    internode tuple, ``len == 10``): ``[0]`` ``is_token_in_rank`` and ``[6]``
    ``recv_gbl_rank_prefix_sum`` int32 [R]; ``rank_prefix_matrix`` as an attribute (None unless a
    CPU-synced dispatch without ``topk_idx`` gathered it, see :meth:`Buffer.gather_rank_prefix_matrix`).
    The tensors are valid once the dispatch's event completed, like every output.

    ``num_recv_tokens`` is the row count of the dispatch's outputs (``num_worst_tokens`` when given).
    """

    def __init__(
        self,
        core: EPHandle,
        *,
        num_recv_tokens: int,
        num_worst_tokens: int,
        rank: int,
        is_token_in_rank: torch.Tensor | None = None,
        rank_prefix_matrix: torch.Tensor | None = None,
    ) -> None:
        self.core = core
        self.num_recv_tokens = num_recv_tokens
        self.num_worst_tokens = num_worst_tokens
        self.rank = rank
        self._is_token_in_rank = is_token_in_rank
        self._rank_prefix_matrix = rank_prefix_matrix

    @property
    def rank_prefix_matrix(self) -> torch.Tensor | None:
        """V1's int32 [R, R] rank prefix matrix: the one the dispatch's layout exchange gathered, else
        the core's (filled by the notify kernel on one node), else None (hybrid mode)."""
        if self._rank_prefix_matrix is not None:
            return self._rank_prefix_matrix
        return self.core.rank_prefix_matrix

    @property
    def num_ranks(self) -> int:
        return self.core.num_ranks

    @property
    def internode(self) -> bool:
        """The dispatch ran in hybrid mode (several nodes): the handle mimics V1's internode tuple."""
        return self.core.num_nodes > 1

    @property
    def recv_rank_prefix_sum(self) -> torch.Tensor:
        """int32 [R]: inclusive prefix sum over source ranks of the tokens this rank received, i.e.
        column ``rank`` of V1's ``rank_prefix_matrix`` (and V1's internode ``recv_gbl_rank_prefix_sum``).
        Rows ``[prefix[s - 1], prefix[s])`` of the outputs came from rank ``s``."""
        return self.core.psum_num_recv_tokens_per_source

    @property
    def num_recv_tokens_device(self) -> torch.Tensor:
        """int32 [1] on the device: the rows really received (``<= num_recv_tokens``), without a sync."""
        return self.core.psum_num_recv_tokens_per_source[-1:]

    @property
    def recv_src_idx(self) -> torch.Tensor:
        """int32 [num_recv_tokens]: the source rank's token index of each received row (V1's
        ``recv_src_idx``; rows past the received count are undefined with ``num_worst_tokens``)."""
        column = self.core.recv_src_info[:, 1].contiguous()  # (source rank, source token, j, master lane) per row
        if column.shape[0] < self.num_recv_tokens:
            column = fit_rows(column, self.num_recv_tokens, -1)
        return column

    @property
    def is_token_in_rank(self) -> torch.Tensor:
        """bool [T, R]: the one passed to dispatch, else computed from the dispatch's routing."""
        if self._is_token_in_rank is None:
            core = self.core
            self._is_token_in_rank = dispatch_layout(core.routing, core.num_experts, core.num_ranks)[3]
        return self._is_token_in_rank

    def _fields(self) -> list[tuple[str, Any]]:
        """(name, getter or None) in V1's tuple order."""
        if not self.internode:
            matrix = self.rank_prefix_matrix
            return [
                ("rank_prefix_matrix", None if matrix is None else lambda: matrix),
                ("channel_prefix_matrix", None),
                ("recv_channel_prefix_matrix", None),
                ("recv_src_idx", lambda: self.recv_src_idx),
                ("is_token_in_rank", lambda: self.is_token_in_rank),
                ("send_head", None),
            ]
        return [
            ("is_token_in_rank", lambda: self.is_token_in_rank),
            ("rdma_channel_prefix_matrix", None),
            ("gbl_channel_prefix_matrix", None),
            ("recv_rdma_channel_prefix_matrix", None),
            ("recv_rdma_rank_prefix_sum", None),
            ("recv_gbl_channel_prefix_matrix", None),
            ("recv_gbl_rank_prefix_sum", lambda: self.recv_rank_prefix_sum),
            ("recv_src_meta", None),
            ("send_rdma_head", None),
            ("send_nvl_head", None),
        ]

    def __len__(self) -> int:
        return len(self._fields())

    def __getitem__(self, index: Any) -> Any:
        fields = self._fields()
        if isinstance(index, slice):
            return tuple(self[position] for position in range(*index.indices(len(fields))))
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"DispatchHandle indices must be integers or slices, got {type(index).__name__}")
        if not -len(fields) <= index < len(fields):
            raise IndexError(f"DispatchHandle index {index} out of range (V1's handle has {len(fields)} entries)")
        name, getter = fields[index]
        if getter is not None:
            return getter()
        kind = "internode" if self.internode else "intranode"
        if name == "rank_prefix_matrix":
            reason = (
                f"needs every rank's send counts, which this handle's core does not hold: column "
                f"{self.rank} of it is handle.recv_rank_prefix_sum (exact); Buffer.gather_rank_prefix_matrix(handle) "
                "builds the whole matrix with one all-gather over the group (collective)"
            )
        elif name == "recv_src_meta":
            reason = (
                "is V1's internode per-row source record; handle.core.recv_src_info holds ours "
                "(handle.core.recv_src_metadata: DeepEP V2's layout)"
            )
        elif name == "recv_rdma_rank_prefix_sum":
            reason = "counts V1's per-node forwarding; the hybrid routing here keeps other per-node counts"
        else:
            reason = _UNAVAILABLE_CHANNELS
        raise IndexError(f"handle[{index}] (V1 {kind} handle entry '{name}') is not available: it {reason}")

    def __iter__(self) -> Iterator[Any]:
        unavailable = [name for name, getter in self._fields() if getter is None]
        raise TypeError(
            f"a DispatchHandle cannot be iterated or unpacked like V1's tuple: {', '.join(unavailable)} are not "
            "available; index the entries you need (see DispatchHandle) or pass the handle back whole"
        )

    def __repr__(self) -> str:
        return (
            f"DispatchHandle(num_recv_tokens={self.num_recv_tokens}, num_worst_tokens={self.num_worst_tokens}, "
            f"rank={self.rank}, num_ranks={self.num_ranks}, internode={self.internode})"
        )


class LowLatencyDispatchHandle(tuple):
    """What ``Buffer.low_latency_dispatch`` returns as ``handle``: V1's tuple
    ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``, carrying the
    core's ``LowLatencyHandle`` as ``.core``. Pass it back to ``low_latency_combine`` and
    ``get_next_low_latency_combine_buffer``.

    A real tuple (``len == 5``, indexable, unpackable). ``[0]`` ``src_info`` int32 ``[L, R * T_ll]``:
    the source rank's token index of each row of ``recv_x``; ``[1]`` ``layout_range`` int64
    ``[L, R]``: ``(first row << 32) | count`` of each source rank's rows of each local expert. Both
    are the core's tensors (``recv_src_info``, ``recv_layout_range``), written by the dispatch's
    receive phase (valid once it ran: after the hook, the event, or the call); rows past
    ``recv_count`` are undefined, as in V1. Rows of a local expert are ordered by (source rank,
    source token), so source ``s``'s block is ``[begin_s, begin_s + count_s)`` with ``begin_s`` the
    sum of the earlier sources' counts (V1: the same block structure, rows within a block in arrival
    order). A tuple V1 code builds itself is not accepted back (it lacks the core's handle).
    """

    core: LowLatencyHandle

    def __new__(cls, core: LowLatencyHandle) -> LowLatencyDispatchHandle:
        entries = (
            core.recv_src_info,
            core.recv_layout_range,
            core.num_max_dispatch_tokens_per_rank,
            core.hidden,
            core.num_experts,
        )
        handle = super().__new__(cls, entries)
        handle.core = core
        return handle

    def __getnewargs__(self) -> tuple[LowLatencyHandle]:  # copy / pickle rebuild from the core handle
        return (self.core,)

    def __repr__(self) -> str:
        return (
            f"LowLatencyDispatchHandle(num_max_dispatch_tokens_per_rank={self[2]}, hidden={self[3]}, "
            f"num_experts={self[4]}, src_info={describe_with_device(self[0])}, "
            f"layout_range={describe_with_device(self[1])})"
        )
