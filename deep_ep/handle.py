"""EPHandle: what a high-throughput dispatch keeps for combine and for cached re-dispatch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def psum_per_scaleup_peer(num_recv_tokens_per_source: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """int32 ``[S]``: inclusive prefix sum over scale-up peers ``u`` of the tokens received from
    source ranks ``n * S + u`` (``S = R / num_nodes``), from the per-source counts ``[R]``."""
    per_peer = num_recv_tokens_per_source.view(num_nodes, -1).sum(dim=0, dtype=torch.int32)
    return per_peer.cumsum(0, dtype=torch.int32)


@dataclass(eq=False)
class EPHandle:
    """Routing metadata of one HT dispatch (DeepEP's field names where DeepEP has the field).

    Shapes: ``T`` tokens dispatched by this rank, ``K`` top-k, ``R`` ranks, ``L`` local experts,
    ``N`` received (non-expand) rows, ``N'`` expanded rows. Device tensors are int32 unless noted;
    they stay valid as long as the handle lives and are only read by later operations.

    Public (DeepEP):
        do_expand: the dispatch produced one row per (token, local expert).
        num_experts, expert_alignment, num_max_tokens_per_rank: the dispatch settings.
        num_sms: SMs the dispatch used; combine's default.
        topk_idx: int64 [T, K], this rank's routing: the sanitised copy dispatch took (an id outside
            [-1, E) or repeated in its row is -1 there), or, after ``do_handle_copy=False``, the
            caller's tensor itself (as in DeepEP V2; nothing here reads it).
        num_recv_tokens: N, exact after a CPU sync, else the worst case ``R * T_max`` (rows allocated).
        num_expanded_tokens: N' (rows of the expand output): the sum of the aligned per-expert
            counts after a CPU sync, else the worst case.
        num_recv_tokens_per_expert_list: aligned per-local-expert counts (Python list), empty
            without a CPU sync.
        psum_num_recv_tokens_per_scaleup_rank: [S] (``S`` ranks per node, R in direct mode),
            DeepEP V2's inclusive prefix sum over this rank's scale-up peers of the tokens received
            through each: entry ``u`` adds the tokens received from the source ranks of local index
            ``u`` on every node (``n * S + u``; each token counted once per receiving rank), the
            rows V2 forwards through peer ``u``. Direct mode: per source rank. The last entry is
            the real N. In hybrid mode derived on the device from ``num_recv_tokens_per_scaleup_rank``
            at each access (a view in direct mode).
        psum_num_recv_tokens_per_expert: [L]; non-expand: inclusive prefix sum of the aligned
            per-expert counts; expand: first row of expert l plus its count, so expert l's rows are
            ``[psum[l] - unaligned[l], psum[l])``.
        num_unaligned_recv_tokens_per_expert: [L], rows of each local expert.
        recv_src_metadata: [N, K + 2], DeepEP V2's layout (read-only, built on the device from
            ``recv_src_info`` at first access on the current stream, then kept): column 0 the
            source's global token id ``src_rank * T_max + src_token``, column 1 ``src_rank * K +
            master_lane``, columns 2.. the expanded row of each top-k lane (expand only: -1 where the
            lane's expert is elsewhere; non-expand: all -1). Rows past the received count (no CPU
            sync) are undefined, like every output's.
        dst_buffer_slot_idx: [T, K], the token's slot at the rank of expert k on the first k of each
            destination rank, -1 elsewhere (its row there is ``[this rank][slot]``).

    Internal:
        sanitized_topk_idx: int64 [T, K], the sanitised copy of the routing when ``topk_idx`` is
            the caller's tensor (``do_handle_copy=False``); None when ``topk_idx`` is that copy.
        routing (property): the sanitised copy, what combine and cached dispatch read.
        num_ranks, num_tokens, num_topk: group size, T and K of the dispatch.
        is_exact: sizes come from a CPU sync (False: worst case).
        expert_slot_idx: [T, K], ordinal of token t among this rank's tokens of expert k.
        num_recv_tokens_per_scaleup_rank: [R], tokens received from each source rank.
        psum_num_recv_tokens_per_source: [R], inclusive prefix sum of the above (last = N), in the
            order of the received rows (source rank ascending): V1's ``recv_rank_prefix_sum``.
        expert_offsets_per_source: [R, L], rows of local expert l coming from sources before s.
        expert_start: [L], first expanded row of each local expert (exclusive psum of aligned counts).
        recv_src_info: [N, 4] per received row (what combine reads): source rank, source token
            index, ``j`` (the row's combine slot at the source: index of this rank among the token's
            destination ranks, ascending; hybrid: among those on this node) and ``master_lane``
            (the first top-k lane whose expert is on this rank).
        recv_expanded_row_idx: expand only, [N, K], the expanded row of (received row, k), -1 where
            expert k is not local.
        counts: the single allocation the views above live in (what the kernels read).
        owner_id: serial of the buffer whose dispatch made the handle; combine and cached dispatch
            refuse a handle of another buffer (its window layout and slots are not theirs).
        hybrid_routing: hybrid mode only, one int32 allocation (layout: HybridRouting in
            csrc/kernels/high_throughput.hpp): the token's row in the scale-out stream to each node
            [T, N], own tokens per node [N], and, as forwarder, the rows kept from each rail peer
            (per-channel prefix, source token, experts) for combine and cached dispatch.
        num_nodes, home_node: node count and this rank's node (1 and 0 in direct mode).
        scaleout_row_bytes: bytes of one token row on the scale-out leg (0 in direct mode).
        zero_copy_send_base: [R] int32, made by a dispatch with ``zero_copy_recv=True``: this rank's
            first row among each rank's final received rows (its rows go there in final position);
            None otherwise. A cached zero-copy dispatch needs it.
        rank_prefix_matrix: [R, R] int32, direct mode (None in hybrid mode and for a handle rebuilt
            from a TensorHandle): DeepEP V1's ``rank_prefix_matrix``, entry ``[s, d]`` the tokens
            ranks ``0..s`` sent to rank ``d`` in this dispatch (exchanged by its notify kernel);
            column ``rank`` equals ``psum_num_recv_tokens_per_source``. Read by no operation.
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_source: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_info: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    num_ranks: int
    num_tokens: int
    num_topk: int
    is_exact: bool
    expert_slot_idx: torch.Tensor
    num_recv_tokens_per_scaleup_rank: torch.Tensor
    expert_offsets_per_source: torch.Tensor
    expert_start: torch.Tensor
    recv_expanded_row_idx: torch.Tensor | None
    counts: torch.Tensor
    owner_id: int = 0
    hybrid_routing: torch.Tensor | None = None
    num_nodes: int = 1
    home_node: int = 0
    scaleout_row_bytes: int = 0
    zero_copy_send_base: torch.Tensor | None = None
    rank_prefix_matrix: torch.Tensor | None = None
    sanitized_topk_idx: torch.Tensor | None = None
    # (recv_src_info it was built from, V2 recv_src_metadata): rebuilt when the info is replaced.
    _v2_src_metadata: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def routing(self) -> torch.Tensor:
        """int64 ``[T, K]``: the sanitised routing the kernels read (``topk_idx`` unless dispatch
        left the caller's tensor there)."""
        return self.topk_idx if self.sanitized_topk_idx is None else self.sanitized_topk_idx

    def keep_caller_topk_idx(self, topk_idx: torch.Tensor) -> None:
        """``do_handle_copy=False``: ``topk_idx`` becomes the caller's tensor (same storage, as in
        DeepEP V2); the sanitised copy stays in ``sanitized_topk_idx`` for the kernels."""
        if self.sanitized_topk_idx is None:
            self.sanitized_topk_idx = self.topk_idx
        self.topk_idx = topk_idx

    @property
    def psum_num_recv_tokens_per_scaleup_rank(self) -> torch.Tensor:
        """DeepEP V2's int32 ``[S]`` inclusive prefix sum of the tokens received through each
        scale-up peer (see the class docstring). Direct mode: ``psum_num_recv_tokens_per_source``
        itself. Hybrid mode: a new tensor built from the per-source counts on the current stream at
        each access (so it follows the counts of the latest replay of a captured dispatch too)."""
        if self.num_nodes <= 1:
            return self.psum_num_recv_tokens_per_source
        return psum_per_scaleup_peer(self.num_recv_tokens_per_scaleup_rank, self.num_nodes)

    @property
    def recv_src_metadata(self) -> torch.Tensor:
        """DeepEP V2's int32 ``[N, K + 2]`` source record of the received rows (see the class
        docstring). Built at first access: dispatch itself writes only ``recv_src_info``. An access
        under CUDA graph capture builds it inside the graph and keeps nothing (the captured
        kernels have not run yet, so the tensor is not valid outside the replays)."""
        info = self.recv_src_info
        if self._v2_src_metadata is not None and self._v2_src_metadata[0] is info:
            return self._v2_src_metadata[1]
        source_rank = info[:, 0]
        metadata = torch.empty((info.shape[0], self.num_topk + 2), dtype=torch.int32, device=info.device)
        metadata[:, 0] = source_rank * self.num_max_tokens_per_rank + info[:, 1]
        metadata[:, 1] = source_rank * self.num_topk + info[:, 3]
        if self.do_expand and self.recv_expanded_row_idx is not None:
            metadata[:, 2:] = self.recv_expanded_row_idx
        else:
            metadata[:, 2:] = -1
        if not (metadata.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._v2_src_metadata = (info, metadata)
        return metadata

    @recv_src_metadata.setter
    def recv_src_metadata(self, metadata: torch.Tensor) -> None:
        """Assign V2's source record, as V2's handle allows (e.g. its first ``n`` rows after a
        dispatch without CPU sync). The rows given become what combine and cached dispatch use:
        ``recv_src_info`` (and the expanded row map in expand mode) is rebuilt from them; rows past
        them, beyond the received count, are kept."""
        info = self.recv_src_info
        columns = self.num_topk + 2
        if (
            not isinstance(metadata, torch.Tensor)
            or metadata.dtype != torch.int32
            or metadata.dim() != 2
            or metadata.shape[1] != columns
            or metadata.shape[0] > info.shape[0]
            or metadata.device != info.device
        ):
            got = (
                f"{str(metadata.dtype).removeprefix('torch.')} {list(metadata.shape)} on {metadata.device}"
                if isinstance(metadata, torch.Tensor)
                else type(metadata).__name__
            )
            raise ValueError(
                f"recv_src_metadata must be int32 [n, {columns}] with n <= {info.shape[0]} on {info.device} "
                f"(the dispatch's record or its first rows), got {got}"
            )
        rows = metadata.shape[0]
        rebuilt = info.clone()
        source_rank = torch.div(metadata[:, 0], self.num_max_tokens_per_rank, rounding_mode="floor")
        rebuilt[:rows, 0] = source_rank
        rebuilt[:rows, 1] = metadata[:, 0] - source_rank * self.num_max_tokens_per_rank
        rebuilt[:rows, 3] = metadata[:, 1] - source_rank * self.num_topk
        if self.do_expand and self.recv_expanded_row_idx is not None:
            expanded = self.recv_expanded_row_idx.clone()
            expanded[:rows] = metadata[:, 2:]
            self.recv_expanded_row_idx = expanded
        self.recv_src_info = rebuilt
        self._v2_src_metadata = (rebuilt, metadata)

    @property
    def tokens_per_node(self) -> torch.Tensor | None:
        """Hybrid mode: this rank's tokens holding an expert on each node [N] (device), else None."""
        if self.hybrid_routing is None:
            return None
        start = self.num_tokens * self.num_nodes
        return self.hybrid_routing.narrow(0, start, self.num_nodes)

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Load-balance observability (exact, on the device): tokens received per source rank [R]
        and rows received per local expert [L] (unaligned). Hybrid mode adds what this rank's
        dispatch put on the scale-out leg: ``scaleout_copies`` (token copies: for each token, the
        other nodes holding one of its experts) and ``scaleout_bytes`` (copies x row bytes)."""
        stats = {
            "tokens_per_source_rank": self.num_recv_tokens_per_scaleup_rank,
            "tokens_per_local_expert": self.num_unaligned_recv_tokens_per_expert,
        }
        per_node = self.tokens_per_node
        if per_node is not None:
            copies = per_node.sum(dtype=torch.int64) - per_node[self.home_node].to(torch.int64)
            stats["scaleout_copies"] = copies
            stats["scaleout_bytes"] = copies * self.scaleout_row_bytes
        return stats

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every device tensor the handle owns (kept alive by events of operations that use them)."""
        owned = (self.routing, self.recv_src_info, self.dst_buffer_slot_idx, self.expert_slot_idx, self.counts)
        if self.recv_expanded_row_idx is not None:
            owned += (self.recv_expanded_row_idx,)
        if self.hybrid_routing is not None:
            owned += (self.hybrid_routing,)
        if self.zero_copy_send_base is not None:
            owned += (self.zero_copy_send_base,)
        if self.rank_prefix_matrix is not None:
            owned += (self.rank_prefix_matrix,)
        return owned
