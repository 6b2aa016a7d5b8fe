"""An expert-parallel MoE layer on deep_ep, checked against a dense single-process model.

    torchrun --nproc-per-node 4 examples/moe_layer.py     # one process per rank (torchrun)
    python examples/moe_layer.py --num-ranks 4            # ranks spawned by deep_ep.testing.launch

More ranks than GPUs (ranks sharing a GPU) need NVIDIA MPS running and, under torchrun,
``CUDA_MODULE_LOADING=EAGER`` in the environment (the launcher sets it itself); docs/testing.md.

Either runs, on every rank, one training step (forward + backward) of ``MoELayer``, its two-batch
overlap and its decode path, computes the same on ``DenseMoE`` (every expert of the group in one
process), prints the differences and exits with status 1 when a check fails. ``check_rank`` is the
function both run per rank (``deep_ep.testing.launch(check_rank, num_ranks, CheckConfig())``);
tests/gpu/test_moe_layer.py asserts on its results.

The layer, one instance per rank (rank ``r`` holds experts ``[r*L, (r+1)*L)``, ``L = E / R``):

* **Router** (replicated on every rank): fp32 logits ``x @ W_g^T``, softmax or sigmoid scores,
  top-k. Optionally node-limited (DeepSeek-V3): a token's experts lie on at most ``max_nodes``
  nodes, the nodes being the buffer's logical scale-out ranks (``get_logical_domain_size()``) unless
  ``num_nodes`` names another grouping of consecutive experts. The top-k weights are the gathered
  scores (renormalised with ``normalize_topk_weights``) and carry the router's gradient.
* **Training and prefill (HT)**: ``deep_ep.autograd.dispatch(..., do_expand=True,
  expert_alignment=a)`` returns one row per (token, local expert). Expert ``l``'s rows form one
  segment that starts at a multiple of ``a``; the segment sizes are the aligned counts
  ``handle.num_recv_tokens_per_expert_list`` and the padding rows at a segment's end are zero with
  weight 0 (docs/api.md). Each local expert runs ``silu(rows @ W1[l]) @ W2[l]`` over its whole
  aligned segment, as a grouped GEMM would (padding rows give zero rows). Combine does not weight
  ("the caller multiplies by the weights before combine, as in DeepEP"), so every row is multiplied
  by its routing weight (``recv_topk_weights``, one per expanded row) in fp32 and rounded to bf16,
  then ``deep_ep.autograd.combine`` sums a token's rows back on its rank. Backward: combine's
  backward is a cached dispatch of the output gradient, dispatch's backward a combine of the row
  gradients and of the weights' gradients (the router's gradient comes back that way).
* **Decode (LL)**, inference only: ``low_latency_dispatch`` (fp8 or bf16; the default
  ``recv_layout="compact"`` packs expert ``l``'s rows in ``[0, recv_count[l])`` of ``recv_x[l]``),
  one batched GEMM over all local experts with the rows past ``recv_count[l]`` set to zero first (a
  masked grouped GEMM: no host sync, CUDA-graph capturable; those rows are undefined and may hold
  NaN), and ``low_latency_combine``, which applies the top-k weights itself.
* **Two-batch overlap** (``forward_two_batch``): the whole batch is routed once, then split into
  micro-batches A and B, and the work is ordered so that one micro-batch's communication runs while
  the other's experts compute. HT: A and B are issued on two CUDA streams in the order dispatch A,
  experts A, dispatch B, combine A, experts B, combine B. Each deep_ep call makes the communication
  stream wait only for the stream it is issued from, so dispatch B moves tokens while experts A run,
  and combine A runs under experts B; autograd runs each backward op on its forward op's stream,
  so the backward overlaps the same way. (Without autograd, ``async_with_compute_stream=True`` and
  ``previous_event`` express the same schedule on one compute stream; ``deep_ep.autograd`` refuses
  ``async_with_compute_stream`` because its outputs must be ready on the caller's stream.) LL: both
  dispatches are sent with ``return_recv_hook=True`` before A is received, so B's tokens travel
  while A's experts run and A's combine travels while B's experts run, with no SM held by a waiting
  kernel. ``overlap=False`` runs the same micro-batches one after the other on the caller's stream
  (LL without hooks): the same computation on the same shapes, hence the same bits.

Accuracy: the layer computes in bf16 (matmul outputs, the weighted rows and each rank's partial sum
rounded to bf16) and ``DenseMoE`` in fp32 on the same bf16 parameters, with bitwise the same routing
(the same ``route`` on the same per-rank shapes). ``TOLERANCES`` holds the accepted differences.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import deep_ep
from deep_ep.fp8 import per_token_cast_back, per_token_cast_to_fp8
from deep_ep.plan import node_limited_topk
from deep_ep.testing.data import make_tokens

SCORE_FUNCS = ("softmax", "sigmoid")

# Accepted difference between the bf16 layer and the fp32 dense model, as max|layer - dense| over
# max|dense| of the compared tensor. One bf16 rounding is off by at most 2^-9 of the value (8-bit
# significand). Forward, a value goes through about six roundings (x @ W1, silu, @ W2, the weighted
# row, the rank's partial sum, the final sum) and GEMMs accumulate in their own order; backward
# goes through as many again (bf16 output gradient, W^T products, silu derivative, the combine of
# the row gradients), and weight gradients sum many bf16 products. With CPU matmuls (the reference
# model standing in for the buffer, 2 and 4 ranks, H = 256 and 1024) the largest was 0.9 %; 2^-5
# (3.1 %) leaves 3x room, while one lost (token, expert) contribution shows as 8 % (router gradient)
# to 90 % (output, expert gradients).
TOLERANCES = {"output": 2.0**-5, "grad": 2.0**-5}


# ----------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape, router and init. ``num_nodes`` None: the buffer's scale-out ranks."""

    hidden: int = 1024
    ffn_hidden: int = 512
    num_experts: int = 32
    num_topk: int = 4
    score_func: str = "softmax"
    normalize_topk_weights: bool = False
    max_nodes: int | None = None
    num_nodes: int | None = None
    expert_alignment: int = 16
    ll_use_fp8: bool = True
    seed: int = 0
    num_sms: int = 0  # HT communication SMs per rank (dispatch, combine and their backward); 0: the estimate


def _generator(device: torch.device, seed: int, stream: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + stream)


def init_gate_weight(cfg: MoEConfig, device: torch.device) -> torch.Tensor:
    """fp32 ``[E, H]``, the same on every rank (seeded)."""
    generator = _generator(device, cfg.seed, 0)
    return torch.randn(cfg.num_experts, cfg.hidden, generator=generator, device=device) / math.sqrt(cfg.hidden)


def init_expert_weights(cfg: MoEConfig, expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``W1 [H, F]`` and ``W2 [F, H]`` of global expert ``expert`` (seeded by its id, so a rank
    holding it and the dense model get the same values)."""
    generator = _generator(device, cfg.seed, 1 + expert)
    w1 = torch.randn(cfg.hidden, cfg.ffn_hidden, generator=generator, device=device) / math.sqrt(cfg.hidden)
    w2 = torch.randn(cfg.ffn_hidden, cfg.hidden, generator=generator, device=device) / math.sqrt(cfg.ffn_hidden)
    return w1.to(torch.bfloat16), w2.to(torch.bfloat16)


def stack_expert_weights(cfg: MoEConfig, experts: range, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``W1 [n, H, F]`` and ``W2 [n, F, H]`` of the global experts ``experts``."""
    pairs = [init_expert_weights(cfg, expert, device) for expert in experts]
    return torch.stack([w1 for w1, _ in pairs]), torch.stack([w2 for _, w2 in pairs])


def check_routing_config(cfg: MoEConfig, num_nodes: int) -> None:
    if cfg.score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {cfg.score_func!r}")
    if not 1 <= cfg.num_topk <= cfg.num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={cfg.num_experts}], got {cfg.num_topk}")
    if num_nodes < 1 or cfg.num_experts % num_nodes != 0:
        raise ValueError(f"num_nodes must divide num_experts ({cfg.num_experts}), got {num_nodes}")
    if cfg.max_nodes is not None:  # max_nodes >= num_nodes: no limit
        per_node = cfg.num_experts // num_nodes
        if cfg.max_nodes < 1 or cfg.num_topk > min(cfg.max_nodes, num_nodes) * per_node:
            raise ValueError(
                f"max_nodes must be >= 1 with num_topk ({cfg.num_topk}) <= max_nodes * experts per node "
                f"({per_node}), got {cfg.max_nodes}"
            )


# ---------------------------------------------------------------------------------- shared math


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, cfg: MoEConfig, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx int64 [T, K], topk_weights fp32 [T, K])``; the weights are differentiable.

    Logits are fp32 (``x.float() @ W_g^T``) so that the layer and the dense model, which run this
    on the same per-rank shapes, pick the same experts bit for bit."""
    logits = x.float() @ gate_weight.t()
    scores = logits.softmax(dim=-1) if cfg.score_func == "softmax" else logits.sigmoid()
    with torch.no_grad():
        if cfg.max_nodes is not None and cfg.max_nodes < num_nodes:
            topk_idx = node_limited_topk(scores, num_nodes, cfg.num_topk, cfg.max_nodes)
        else:
            topk_idx = scores.topk(cfg.num_topk, dim=-1).indices
    topk_weights = scores.gather(1, topk_idx)
    if cfg.normalize_topk_weights:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx, topk_weights


def expert_mlp(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``silu(rows @ W1) @ W2``; ``[M, H]`` with one expert's weights, or ``[L, M, H]`` with ``[L, ...]``."""
    return F.silu(rows @ w1) @ w2


def _autograd() -> Any:
    try:
        import deep_ep.autograd as ep_autograd
    except ImportError as error:
        raise RuntimeError(
            "MoELayer's training/prefill path needs deep_ep.autograd (differentiable dispatch and combine), "
            f"which this deep_ep does not have: {error}"
        ) from error
    return ep_autograd


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


@dataclass
class _HTState:
    recv_x: torch.Tensor
    recv_weights: torch.Tensor
    handle: Any


@dataclass
class _LLState:
    recv_x: Any
    recv_count: torch.Tensor
    handle: Any
    hook: Any


@dataclass
class _WarmUpHandle:
    num_recv_tokens_per_expert_list: list[int]


def _micro_batches(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The first ``ceil(T/2)`` rows of every tensor, then the rest (contiguous row slices)."""
    half = (tensors[0].shape[0] + 1) // 2
    return [tuple(tensor[:half] for tensor in tensors), tuple(tensor[half:] for tensor in tensors)]


# ------------------------------------------------------------------------------------------ layer


class MoELayer(torch.nn.Module):
    """This rank's part of an expert-parallel MoE layer (module docstring).

    ``forward(x)`` trains / prefills through HT dispatch and combine; ``forward(x, decode=True)``
    decodes through LL (``x`` at most the buffer's ``num_max_dispatch_tokens_per_rank`` rows, no
    autograd); ``forward_two_batch`` does either with two micro-batches overlapped. Every rank of
    the buffer's group must make the same calls. The buffer needs ``hidden`` = ``cfg.hidden``, an HT
    region for ``forward`` and an LL region for ``E = cfg.num_experts`` for ``decode``
    (``make_buffer`` builds one). The router weight is replicated: sum its gradient over the ranks
    (data parallel) before an optimizer step.
    """

    def __init__(self, buffer: Any, cfg: MoEConfig, device: torch.device | None = None) -> None:
        super().__init__()
        if cfg.num_experts % buffer.num_ranks != 0:
            raise ValueError(f"num_experts ({cfg.num_experts}) must be a multiple of the ranks ({buffer.num_ranks})")
        self.buffer = buffer
        self.cfg = cfg
        self.num_nodes = cfg.num_nodes if cfg.num_nodes is not None else buffer.get_logical_domain_size()[0]
        check_routing_config(cfg, self.num_nodes)
        self.num_local_experts = cfg.num_experts // buffer.num_ranks
        self.first_expert = buffer.rank_idx * self.num_local_experts
        self.ll_use_fp8 = cfg.ll_use_fp8
        device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.gate_weight = torch.nn.Parameter(init_gate_weight(cfg, device))
        w1, w2 = stack_expert_weights(cfg, range(self.first_expert, self.first_expert + self.num_local_experts), device)
        self.w1 = torch.nn.Parameter(w1)  # [L, H, F] bf16
        self.w2 = torch.nn.Parameter(w2)  # [L, F, H] bf16
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.gate_weight, self.cfg, self.num_nodes)

    def warm_up(self, num_tokens: int) -> None:
        """Run the layer's compute once per shape it can meet, without communication.

        For ranks that share a GPU (MPS), before the first step: the first use of a kernel may wait
        until every kernel on the GPU has finished, the peers' too, and cuBLAS picks its kernels by
        GEMM shape and loads each one's module on first use. A rank whose peers already wait for it
        in a dispatch or combine would stall until their deadline (measured at 4 ranks on one H200:
        one rank's first expert GEMMs blocked the host for exactly the peers' deadline). This
        runs the HT experts (forward and backward, every aligned row count up to the most rows an
        expert can receive when every rank sends ``num_tokens`` tokens, on the caller's stream and
        on the two-batch overlap's streams) and the LL experts (bf16 and fp8 receive), then drops
        the gradients.
        """
        device = self.w1.device
        hidden = self.cfg.hidden
        align = max(1, self.cfg.expert_alignment)
        max_rows = -(-num_tokens * self.buffer.num_ranks // align) * align
        zeros = [0] * (self.num_local_experts - 1)
        # The two-batch overlap's streams too: each stream gets its own cuBLAS workspace.
        streams = self._side_streams(device) or ()
        for stream in (None, *streams):
            with _on_stream(stream):
                for rows in range(align, max_rows + 1, align):
                    recv_x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
                    weights = torch.zeros(rows, dtype=torch.float32, device=device, requires_grad=True)
                    handle = _WarmUpHandle([rows, *zeros])
                    self._ht_experts(_HTState(recv_x, weights, handle)).float().sum().backward()
        self.zero_grad(set_to_none=True)
        if self.buffer.num_max_dispatch_tokens_per_rank > 0:
            num_rows = self.buffer.num_ranks * self.buffer.num_max_dispatch_tokens_per_rank
            count = torch.zeros(self.num_local_experts, dtype=torch.int32, device=device)
            with torch.no_grad():
                bf16 = torch.zeros(self.num_local_experts, num_rows, hidden, dtype=torch.bfloat16, device=device)
                self._ll_experts(_LLState(bf16, count, None, None))
                self._ll_experts(_LLState(per_token_cast_to_fp8(bf16), count, None, None))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward(self, x: torch.Tensor, *, decode: bool = False) -> torch.Tensor:
        """bf16 ``[T, H]`` -> bf16 ``[T, H]``."""
        if decode:
            with torch.no_grad():
                topk_idx, topk_weights = self.route(x)
                return self._ll_forward(x, topk_idx, topk_weights)
        topk_idx, topk_weights = self.route(x)
        state = self._ht_dispatch(x, topk_idx, topk_weights)
        return self._ht_combine(self._ht_experts(state), state.handle)

    def forward_two_batch(self, x: torch.Tensor, *, decode: bool = False, overlap: bool = True) -> torch.Tensor:
        """``forward`` over two micro-batches (the first ``ceil(T/2)`` tokens, then the rest), with
        one's communication overlapping the other's experts when ``overlap``."""
        if x.shape[0] < 2:
            raise ValueError(f"two micro-batches need at least 2 tokens, got {x.shape[0]}")
        if decode:
            with torch.no_grad():
                return torch.cat(self._ll_two_batch(_micro_batches(x, *self.route(x)), overlap))
        return torch.cat(self._ht_two_batch(_micro_batches(x, *self.route(x)), overlap))

    # ----------------------------------------------------------------------------- HT

    def _ht_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> _HTState:
        recv_x, _, recv_weights, handle = _autograd().dispatch(
            self.buffer,
            x,
            topk_idx,
            topk_weights,
            self.cfg.num_experts,
            do_expand=True,
            expert_alignment=self.cfg.expert_alignment,
            num_sms=self.cfg.num_sms,
        )
        return _HTState(recv_x, recv_weights, handle)

    def _ht_experts(self, state: _HTState) -> torch.Tensor:
        """Weighted expert outputs, one bf16 row per expanded row (what combine sums)."""
        counts = state.handle.num_recv_tokens_per_expert_list  # aligned segment sizes, host ints
        if len(counts) != self.num_local_experts:
            raise RuntimeError(
                f"the dispatch handle has {len(counts)} per-expert counts, expected {self.num_local_experts}: "
                "the experts loop needs a dispatch with CPU sync (do_cpu_sync=True, the default)"
            )
        # One unbind rather than self.w1[local] per expert: the backward of an index is a zero-filled
        # full [L, H, F] gradient per expert (measured: out of memory at 4 ranks, H 7168, F 2048, 64
        # local experts), the backward of unbind one stack of the experts' gradients.
        w1, w2 = self.w1.unbind(0), self.w2.unbind(0)
        outputs, start = [], 0
        for local, count in enumerate(counts):
            outputs.append(expert_mlp(state.recv_x[start : start + count], w1[local], w2[local]))
            start += count
        rows = torch.cat(outputs)
        return (rows.float() * state.recv_weights.unsqueeze(1)).to(torch.bfloat16)

    def _ht_combine(self, weighted: torch.Tensor, handle: Any) -> torch.Tensor:
        combined, _ = _autograd().combine(self.buffer, weighted, handle, num_sms=self.cfg.num_sms)
        return combined

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        if device.type != "cuda":
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams

    def _ht_two_batch(self, parts: list[tuple[torch.Tensor, ...]], overlap: bool) -> list[torch.Tensor]:
        streams = self._side_streams(parts[0][0].device) if overlap else None
        main = torch.cuda.current_stream(parts[0][0].device) if streams is not None else None
        stream_of = streams if streams is not None else (None, None)
        if streams is not None:
            for stream in streams:
                stream.wait_stream(main)  # the routing (and x) come from the caller's stream
        states: list[Any] = [None, None]
        weighted: list[Any] = [None, None]
        outputs: list[Any] = [None, None]
        # The order every rank issues (the communication stream runs dispatch A, dispatch B,
        # combine A, combine B): dispatch B is issued after experts A are queued on A's stream, so
        # it runs beside them; combine A waits only for A's stream and runs beside experts B.
        with _on_stream(stream_of[0]):
            states[0] = self._ht_dispatch(*parts[0])
            weighted[0] = self._ht_experts(states[0])
        with _on_stream(stream_of[1]):
            states[1] = self._ht_dispatch(*parts[1])
        with _on_stream(stream_of[0]):
            outputs[0] = self._ht_combine(weighted[0], states[0].handle)
        with _on_stream(stream_of[1]):
            weighted[1] = self._ht_experts(states[1])
            outputs[1] = self._ht_combine(weighted[1], states[1].handle)
        if streams is not None:
            for stream, output in zip(streams, outputs, strict=True):
                main.wait_stream(stream)
                output.record_stream(main)  # made on a side stream, used (and freed) on the caller's
        return outputs

    # ----------------------------------------------------------------------------- LL

    def _ll_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, hook: bool = False) -> _LLState:
        recv_x, recv_count, handle, _, recv_hook = self.buffer.low_latency_dispatch(
            x,
            topk_idx,
            self.buffer.num_max_dispatch_tokens_per_rank,
            self.cfg.num_experts,
            use_fp8=self.ll_use_fp8,
            return_recv_hook=hook,
        )
        return _LLState(recv_x, recv_count, handle, recv_hook)

    def _ll_experts(self, state: _LLState) -> torch.Tensor:
        """bf16 ``[L, R*T_ll, H]`` laid out like ``recv_x``: every local expert in one batched GEMM."""
        recv_x = state.recv_x
        rows = per_token_cast_back(*recv_x) if isinstance(recv_x, (tuple, list)) else recv_x
        # Rows past recv_count[l] are undefined (possibly NaN): zero them so only defined rows feed
        # the GEMM (their outputs are never read by combine either way).
        valid = torch.arange(rows.shape[1], device=rows.device) < state.recv_count.unsqueeze(1)
        rows = torch.where(valid.unsqueeze(-1), rows, 0.0)
        return expert_mlp(rows, self.w1, self.w2)

    def _ll_combine(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any, *, hook: bool = False
    ) -> tuple[torch.Tensor, Any]:
        combined, _, recv_hook = self.buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=hook
        )
        return combined, recv_hook

    def _ll_forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        state = self._ll_dispatch(x, topk_idx)
        combined, _ = self._ll_combine(self._ll_experts(state), topk_idx, topk_weights, state.handle)
        return combined

    def _ll_two_batch(self, parts: list[tuple[torch.Tensor, ...]], overlap: bool) -> list[torch.Tensor]:
        if not overlap:
            return [self._ll_forward(*part) for part in parts]
        (x_a, idx_a, weights_a), (x_b, idx_b, weights_b) = parts
        # Send both dispatches first; each hook launches its receive later. At most two LL
        # operations are outstanding at any point: (dA, dB), (dB, cA), (cA, cB).
        a = self._ll_dispatch(x_a, idx_a, hook=True)
        b = self._ll_dispatch(x_b, idx_b, hook=True)
        a.hook()
        out_a, combine_a = self._ll_combine(self._ll_experts(a), idx_a, weights_a, a.handle, hook=True)
        b.hook()
        out_b, combine_b = self._ll_combine(self._ll_experts(b), idx_b, weights_b, b.handle, hook=True)
        combine_a()
        combine_b()
        return [out_a, out_b]


def make_buffer(
    group: Any,
    cfg: MoEConfig,
    num_max_tokens_per_rank: int,
    num_max_dispatch_tokens_per_rank: int = 0,
    num_gpu_timeout_secs: float | None = None,
) -> deep_ep.ElasticBuffer:
    """A buffer for ``MoELayer``: HT for ``num_max_tokens_per_rank`` tokens, LL (when > 0) for
    ``num_max_dispatch_tokens_per_rank``; ``num_gpu_timeout_secs`` None: the library's default.
    Collective; call ``destroy()`` on every rank."""
    return deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        hidden=cfg.hidden,
        num_topk=cfg.num_topk,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        num_experts=cfg.num_experts,
        num_gpu_timeout_secs=num_gpu_timeout_secs,
        explicitly_destroy=True,
    )


# ------------------------------------------------------------------------------ dense reference


class DenseMoE:
    """The whole group's MoE in one process: every expert, every rank's tokens, fp32 math on the
    layer's bf16 parameter values. Same seed and init as ``MoELayer``, and the router runs per rank
    on that rank's tokens (the shapes the layer uses), so the routing decisions are the layer's."""

    def __init__(self, cfg: MoEConfig, num_nodes: int, device: torch.device) -> None:
        check_routing_config(cfg, num_nodes)
        self.cfg = cfg
        self.num_nodes = num_nodes
        self.gate_weight = init_gate_weight(cfg, device).requires_grad_()
        w1, w2 = stack_expert_weights(cfg, range(cfg.num_experts), device)
        self.w1 = w1.float().requires_grad_()  # [E, H, F]
        self.w2 = w2.float().requires_grad_()  # [E, F, H]

    def forward(self, xs: list[torch.Tensor], *, fp8_inputs: bool = False) -> dict[str, list[torch.Tensor]]:
        """``xs``: bf16 ``[T_r, H]`` per rank. Returns ``x`` (fp32 leaves with the values of ``xs``,
        for their gradients), ``topk_idx`` and ``output`` (fp32), per rank. ``fp8_inputs``: experts
        see ``x`` after the per-token fp8 cast LL dispatch applies (no gradient then)."""
        leaves = [x.float().requires_grad_(not fp8_inputs) for x in xs]
        routing = [route(leaf, self.gate_weight, self.cfg, self.num_nodes) for leaf in leaves]
        if fp8_inputs:
            inputs = torch.cat([per_token_cast_back(*per_token_cast_to_fp8(x)).float() for x in xs])
        else:
            inputs = torch.cat(leaves)
        topk_idx = torch.cat([idx for idx, _ in routing])
        topk_weights = torch.cat([weights for _, weights in routing])
        output = torch.zeros_like(inputs)
        for expert in range(self.cfg.num_experts):
            tokens, slots = (topk_idx == expert).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            rows = expert_mlp(inputs[tokens], self.w1[expert], self.w2[expert])
            output = output.index_add(0, tokens, rows * topk_weights[tokens, slots].unsqueeze(1))
        sizes = [x.shape[0] for x in xs]
        return {"x": leaves, "topk_idx": [idx for idx, _ in routing], "output": list(output.split(sizes))}


# ------------------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class CheckConfig:
    """What ``check_rank`` runs: every variant on one buffer (they share H, K and E)."""

    variants: tuple[tuple[str, MoEConfig], ...] = field(
        default_factory=lambda: (
            ("softmax", MoEConfig()),
            (
                "sigmoid-node-limited",
                MoEConfig(score_func="sigmoid", normalize_topk_weights=True, num_nodes=4, max_nodes=2, seed=1),
            ),
        )
    )
    num_tokens: int = 128  # per rank; also the LL cap, so the decode path runs on the same tokens
    seed: int = 0
    gpu_timeout_secs: float | None = None  # the buffer's device wait deadline (None: library default)


def group_tokens(
    num_ranks: int, num_tokens: int, hidden: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's bf16 input and output gradient (CPU), the same in every process."""
    xs, grads = [], []
    for rank in range(num_ranks):
        generator = torch.Generator().manual_seed(seed * 7919 + rank)
        xs.append(make_tokens(num_tokens, hidden, generator))
        grads.append(torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16))
    return xs, grads


def relative_error(actual: torch.Tensor | None, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected| (inf for a missing or non-finite ``actual``)."""
    if actual is None:
        return math.inf
    actual = actual.detach().float()
    expected = expected.detach().float().to(actual.device)
    if not bool(torch.isfinite(actual).all()):
        return math.inf
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return float((actual - expected).abs().max()) / scale if scale > 0 else float((actual - expected).abs().max())


def bitwise_differences(actual: torch.Tensor | None, expected: torch.Tensor | None) -> int:
    """Elements whose bits differ (-1 when the shapes, dtypes or presence differ)."""
    if actual is None or expected is None:
        return 0 if actual is None and expected is None else -1
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return -1
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    return int((actual.detach().contiguous().view(view) != expected.detach().contiguous().view(view)).sum())


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over the group (through the host when the group is gloo)."""
    if dist.get_backend(group) == "gloo" and tensor.is_cuda:
        host = tensor.detach().cpu()
        dist.all_reduce(host, group=group)
        return host.to(tensor.device)
    result = tensor.detach().clone()
    dist.all_reduce(result, group=group)
    return result


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _train_step(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor, mode: str) -> dict[str, Any]:
    """Forward + backward of one mode (``plain``, ``two-batch``, ``two-batch-overlap``); this rank's grads."""
    layer.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    if mode == "plain":
        output = layer(leaf)
    else:
        output = layer.forward_two_batch(leaf, overlap=mode == "two-batch-overlap")
    output.backward(grad_out)
    return {
        "output": output.detach(),
        "x": leaf.grad,
        "w1": layer.w1.grad,
        "w2": layer.w2.grad,
        "gate": layer.gate_weight.grad,
    }


def _check_variant(
    buffer: Any, rank: int, num_ranks: int, group: Any, cfg: MoEConfig, config: CheckConfig, device: torch.device
) -> dict[str, Any]:
    layer = MoELayer(buffer, cfg, device)
    if device.type == "cuda":
        layer.warm_up(config.num_tokens)
    dense = DenseMoE(cfg, layer.num_nodes, device)
    xs_cpu, grads_cpu = group_tokens(num_ranks, config.num_tokens, cfg.hidden, config.seed)
    xs = [x.to(device) for x in xs_cpu]
    x, grad_out = xs[rank], grads_cpu[rank].to(device)
    errors: dict[str, float] = {}
    bitwise: dict[str, int] = {}
    checks: dict[str, bool] = {}
    info: dict[str, int] = {}

    reference = dense.forward(xs)
    torch.autograd.backward(reference["output"], [grad.to(device).float() for grad in grads_cpu])
    local = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    expected = {
        "output": reference["output"][rank],
        "x": reference["x"][rank].grad,
        "w1": dense.w1.grad[local],
        "w2": dense.w2.grad[local],
        "gate": dense.gate_weight.grad,
    }

    topk_idx, _ = layer.route(x)
    checks["routing equals the dense model's"] = torch.equal(topk_idx, reference["topk_idx"][rank])
    if cfg.max_nodes is not None:
        nodes = topk_idx // (cfg.num_experts // layer.num_nodes)
        touched = torch.zeros(nodes.shape[0], layer.num_nodes, dtype=torch.bool, device=device)
        touched.scatter_(1, nodes, True)
        checks[f"every token within max_nodes={cfg.max_nodes} nodes"] = bool((touched.sum(1) <= cfg.max_nodes).all())

    steps = {mode: _train_step(layer, x, grad_out, mode) for mode in ("plain", "two-batch", "two-batch-overlap")}
    for mode, step in steps.items():
        for name, want in expected.items():
            got = step[name]
            if name == "gate" and got is not None:
                got = all_reduce_sum(got, group)  # the router is replicated: its gradient sums over ranks
            kind = "output" if name == "output" else "grad"
            errors[f"HT {mode} {name}"] = (relative_error(got, want), TOLERANCES[kind])
    for name in expected:
        bitwise[f"HT two-batch overlap vs sequential: {name}"] = bitwise_differences(
            steps["two-batch-overlap"][name], steps["two-batch"][name]
        )
    # Not a requirement: the micro-batches' expert GEMMs have other row counts than the whole
    # batch's, and a GEMM may accumulate differently per shape (the errors above bound it).
    info["HT two-batch vs plain: output elements differing"] = bitwise_differences(
        steps["two-batch-overlap"]["output"], steps["plain"]["output"]
    )

    with torch.no_grad():
        references = {False: expected["output"], True: dense.forward(xs, fp8_inputs=True)["output"][rank]}
        for use_fp8 in (True, False):
            layer.ll_use_fp8 = use_fp8
            label = "fp8" if use_fp8 else "bf16"
            plain = layer(x, decode=True)
            errors[f"LL {label} output"] = (relative_error(plain, references[use_fp8]), TOLERANCES["output"])
            sequential = layer.forward_two_batch(x, decode=True, overlap=False)
            overlapped = layer.forward_two_batch(x, decode=True, overlap=True)
            bitwise[f"LL {label} two-batch overlap vs sequential"] = bitwise_differences(overlapped, sequential)
            # Same GEMM shapes whatever the batch ([L, R*T_ll, H]) and a per-token combine: the
            # micro-batches give the plain forward's bits too.
            bitwise[f"LL {label} two-batch overlap vs plain"] = bitwise_differences(overlapped, plain)
    return {"errors": errors, "bitwise": bitwise, "checks": checks, "info": info}


def check_rank(rank: int, num_ranks: int, group: Any, config: CheckConfig, buffer: Any = None) -> dict[str, Any]:
    """Every variant of ``config`` on this rank: ``{variant: {"errors": {name: (error, tolerance)},
    "bitwise": {name: differing elements}, "checks": {name: bool}, "info": {name: value}}}``
    (``info`` is reported, not checked). Builds (and destroys) a
    buffer unless one is given. Usable with ``deep_ep.testing.launch(check_rank, R, config)``."""
    device = _device()
    first = config.variants[0][1]
    own_buffer = buffer is None
    if own_buffer:
        buffer = make_buffer(group, first, config.num_tokens, config.num_tokens, config.gpu_timeout_secs)
    try:
        results = {}
        for name, cfg in config.variants:
            if (cfg.hidden, cfg.num_topk, cfg.num_experts) != (first.hidden, first.num_topk, first.num_experts):
                raise ValueError(f"variant {name!r} must share hidden, num_topk and num_experts with the first")
            results[name] = _check_variant(buffer, rank, num_ranks, group, cfg, config, device)
        return results
    finally:
        if own_buffer:
            buffer.destroy()


def failures(results: dict[str, Any]) -> list[str]:
    """The failed checks of one rank's ``check_rank`` results, as readable lines."""
    lines = []
    for variant, result in results.items():
        for name, (error, tolerance) in result["errors"].items():
            if not error <= tolerance:
                lines.append(f"{variant}: {name}: relative error {error:.3g} > {tolerance:.3g}")
        for name, differ in result["bitwise"].items():
            if differ != 0:
                lines.append(
                    f"{variant}: {name}: {differ} elements differ"
                    if differ > 0
                    else f"{variant}: {name}: shape/dtype differ"
                )
        for name, passed in result["checks"].items():
            if not passed:
                lines.append(f"{variant}: {name}: failed")
    return lines


def _report(per_rank: list[dict[str, Any]]) -> int:
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    for results in per_rank:
        for variant, result in results.items():
            for name, (error, tolerance) in result["errors"].items():
                previous = worst.get((variant, name), (0.0, tolerance))
                worst[(variant, name)] = (max(previous[0], error), tolerance)
    print(f"{'variant':<22} {'check':<34} {'max rel. error (all ranks)':>26} {'tolerance':>10}")
    for (variant, name), (error, tolerance) in worst.items():
        print(f"{variant:<22} {name:<34} {error:>26.3e} {tolerance:>10.3e}")
    lines = [f"rank {rank}: {line}" for rank, results in enumerate(per_rank) for line in failures(results)]
    bitwise = sum(len(result["bitwise"]) + len(result["checks"]) for result in per_rank[0].values())
    print(f"{bitwise} bitwise / routing checks per rank")
    for variant in per_rank[0]:
        for name in per_rank[0][variant]["info"]:
            values = [results[variant]["info"][name] for results in per_rank]
            print(f"info {variant}: {name}, per rank: {values}")
    print("\n".join(lines) if lines else f"PASS ({len(per_rank)} ranks)")
    return 1 if lines else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-ranks", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--num-tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn-hidden", type=int, default=512)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--num-topk", type=int, default=4)
    parser.add_argument("--expert-alignment", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-sms", type=int, default=0, help="HT communication SMs per rank (0: the estimate)")
    args = parser.parse_args(argv)
    shape = {
        "hidden": args.hidden,
        "ffn_hidden": args.ffn_hidden,
        "num_experts": args.num_experts,
        "num_topk": args.num_topk,
        "expert_alignment": args.expert_alignment,
        "num_sms": args.num_sms,
    }
    config = CheckConfig(
        variants=tuple((name, replace(cfg, **shape)) for name, cfg in CheckConfig().variants),
        num_tokens=args.num_tokens,
        seed=args.seed,
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        num_gpus = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % num_gpus)
        dist.init_process_group("nccl" if world <= num_gpus else "gloo")
        if world > num_gpus:  # ranks share a GPU: load cuBLAS before any peer waits on this rank
            from deep_ep.testing import warm_up_cuda_libraries

            warm_up_cuda_libraries()
        try:
            results = check_rank(rank, world, dist.group.WORLD, config)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, results)
        finally:
            dist.destroy_process_group()
        return _report(gathered) if rank == 0 else (1 if any(failures(r) for r in gathered) else 0)
    from deep_ep.testing import launch

    return _report(launch(check_rank, args.num_ranks, config))


if __name__ == "__main__":
    sys.exit(main())
