"""DeepEP V1's ``Config`` and buffer-size helpers, answered with this package's window geometry.

A V1 client sizes its buffers like this::

    num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, R)
                        for cfg in (get_dispatch_config(R), get_combine_config(R)))
    num_rdma_bytes = max(... get_rdma_buffer_size_hint ...,
                         get_low_latency_rdma_size_hint(T_ll, hidden, R, E))   # with LL

The hints here return the exact ``num_bytes`` of an ``ElasticBuffer`` window (workspace
included), from the same C++ geometry the buffer allocates with (``deep_ep._C``):

- ``get_nvl_buffer_size_hint`` is the whole high-throughput (HT) window; ``get_rdma_buffer_size_hint``
  is 0, since there is one window and no separate RDMA buffer. The bytes a V1 client passes as
  ``num_nvl_bytes`` therefore hold its HT window and ``num_rdma_bytes`` its LL window.
- ``get_low_latency_rdma_size_hint`` is ``ElasticBuffer.get_low_latency_size_hint``.

Token capacity. V1 moves an HT call through per-channel rings: each of the ``num_sms / 2``
channels gives every source rank ``num_max_nvl_chunked_recv_tokens`` receive slots, recycled while
the call runs, so V1 has no per-call token limit. Our window gives every source rank ``T_max``
slots that hold the whole call. A Config is mapped to the same number of slots per source rank::

    T_max = (num_sms // 2) * num_max_nvl_chunked_recv_tokens

which makes our window about the size of V1's NVL buffer (R = 8, H = 7168, the default configs:
T_max = 2560, 292 MiB here, 320 MiB for V1). A call with more tokens on a rank than the window
holds is refused (``ElasticBuffer`` raises ``BufferTooSmallError`` naming the bytes needed).
Since the window grows with ``R`` (``R * T_max`` receive slots), the larger configs of V1's tables
cost much more than V1's buffers (R = 64: 3.1 GiB; R = 160: 19.4 GiB).
``EP_V1_NUM_MAX_TOKENS_PER_RANK``, when set, replaces the mapping: the hints then size for exactly
that many tokens per rank, whatever the Config (every rank must see the same value: the window
must be equal everywhere).

The HT window is sized for the worst case the hint's arguments leave open: top-k 32 (the largest
our kernels take), bf16 or fp8 payload, and, above 8 ranks (V1's node size), both a direct window
(every rank in one load/store domain) and a hybrid one (8-rank nodes); the largest wins.
``hidden_bytes`` is read as V1's clients compute it, ``hidden * max(element size, 2)``, so the
hidden size is ``ceil(hidden_bytes / 2)`` rounded up to a multiple of 8.
"""

from __future__ import annotations

import os

from deep_ep import _C
from deep_ep.buffer import ElasticBuffer

__all__ = [
    "Config",
    "DEFAULT_NUM_SMS",
    "TOKENS_ENV",
    "UnsupportedRankCountError",
    "get_combine_config",
    "get_dispatch_config",
    "get_low_latency_rdma_size_hint",
]

DEFAULT_NUM_SMS = 20  # V1's Buffer.num_sms
NUM_RANKS_PER_NODE = 8  # V1's NUM_MAX_NVL_PEERS: V1 assumes 8-GPU nodes
TOKENS_ENV = "EP_V1_NUM_MAX_TOKENS_PER_RANK"

# V1's tuned tables: ranks -> (nvl send, nvl recv, rdma send, rdma recv) chunk sizes in tokens.
_DISPATCH_CHUNKS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_CHUNKS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


class UnsupportedRankCountError(ValueError, AssertionError):
    """No tuned V1 config for this rank count. A ``ValueError``, and an ``AssertionError`` as V1's
    ``assert`` raises, so either ``except`` clause catches it."""


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _tokens_override() -> int | None:
    raw = os.environ.get(TOKENS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{TOKENS_ENV} must be a positive integer (tokens per rank), got {raw!r}")
    return value


def _hidden_from_bytes(hidden_bytes: int) -> int:
    """The hidden size a V1 client's ``hidden_bytes`` (``hidden * max(elem, 2)``) stands for."""
    _check_int("hidden_bytes", hidden_bytes)
    if hidden_bytes <= 0:
        raise ValueError(f"hidden_bytes must be positive, got {hidden_bytes}")
    hidden = -(-hidden_bytes // 2)
    return -(-hidden // 8) * 8


def _check_num_ranks(num_ranks: int) -> int:
    _check_int("num_ranks", num_ranks)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_ranks > NUM_RANKS_PER_NODE and num_ranks % NUM_RANKS_PER_NODE != 0:
        raise ValueError(
            f"num_ranks must be below {NUM_RANKS_PER_NODE} or a multiple of it (DeepEP V1's "
            f"{NUM_RANKS_PER_NODE}-GPU nodes), got {num_ranks}"
        )
    return num_ranks


def _ht_window_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int) -> int:
    """Window bytes (workspace included) of the largest HT layout a V1 client of ``num_ranks`` ranks
    could get for ``T_max`` tokens and hidden size ``hidden``: top-k 32, bf16 or fp8 (fp8 only when
    ``hidden % 128 == 0``), direct, and above 8 ranks also hybrid with 8-rank nodes."""
    scaleup_sizes = [num_ranks]
    if num_ranks > NUM_RANKS_PER_NODE:
        scaleup_sizes.append(NUM_RANKS_PER_NODE)
    formats = [False, True] if hidden % 128 == 0 else [False]
    region = max(
        _C.high_throughput_layout(num_ranks, scaleup, num_max_tokens_per_rank, hidden, 0, use_fp8)["region_bytes"]
        for scaleup in scaleup_sizes
        for use_fp8 in formats
    )
    return _C.window_layout(region, 0)["total_bytes"]


class Config:
    """DeepEP V1's HT tuning record (``deep_ep.Config``), with V1's arguments, defaults and checks.

    ``num_sms`` is the SM count the HT kernels may use; the chunk sizes tune V1's ring transfers and
    here only decide the token capacity the size hints allocate for (module docstring). As in V1,
    ``num_max_rdma_chunked_recv_tokens`` is rounded up to a multiple of the RDMA send chunk.
    Invalid values raise ``ValueError`` (V1: a ``RuntimeError`` from its C++ assertion).
    """

    def __init__(
        self,
        num_sms: int = DEFAULT_NUM_SMS,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        num_sms = _check_int("num_sms", num_sms)
        nvl_send = _check_int("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens)
        nvl_recv = _check_int("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens)
        rdma_send = _check_int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens)
        rdma_recv = _check_int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)
        if num_sms < 0:
            raise ValueError(f"num_sms must be >= 0, got {num_sms}")
        if nvl_send <= 0 or nvl_recv <= 0 or nvl_send >= nvl_recv:
            raise ValueError(
                "need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, got "
                f"{nvl_send} and {nvl_recv}"
            )
        if rdma_send <= 0 or rdma_recv <= 0:
            raise ValueError(
                "num_max_rdma_chunked_send_tokens and num_max_rdma_chunked_recv_tokens must be positive, got "
                f"{rdma_send} and {rdma_recv}"
            )
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        if rdma_send > rdma_recv // 2:
            raise ValueError(
                f"num_max_rdma_chunked_send_tokens ({rdma_send}) must be at most half of "
                f"num_max_rdma_chunked_recv_tokens ({rdma_recv} after rounding up to a multiple of the send chunk)"
            )
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, "
            f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
            f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
            f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
            f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})"
        )

    def get_num_max_tokens_per_rank(self) -> int:
        """Tokens per rank the size hints allocate for: ``(num_sms // 2) * num_max_nvl_chunked_recv_tokens``,
        or ``EP_V1_NUM_MAX_TOKENS_PER_RANK`` when that is set."""
        override = _tokens_override()
        if override is not None:
            return override
        return (self.num_sms // 2) * self.num_max_nvl_chunked_recv_tokens

    def _check_hint_args(self, hidden_bytes: int, num_ranks: int) -> int:
        hidden = _hidden_from_bytes(hidden_bytes)
        _check_num_ranks(num_ranks)
        if num_ranks > NUM_RANKS_PER_NODE and self.num_sms % 2 != 0:
            raise ValueError(f"num_sms must be even above {NUM_RANKS_PER_NODE} ranks, got {self.num_sms}")
        return hidden

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Exact ``num_bytes`` of the HT window (workspace included) that holds
        ``get_num_max_tokens_per_rank()`` tokens per rank of ``hidden_bytes`` each (module docstring)."""
        hidden = self._check_hint_args(hidden_bytes, num_ranks)
        return _ht_window_bytes(num_ranks, self.get_num_max_tokens_per_rank(), hidden)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: the HT window is one allocation, all of it in ``get_nvl_buffer_size_hint``. The arguments
        are checked as there."""
        self._check_hint_args(hidden_bytes, num_ranks)
        return 0


def _lookup(table: dict[int, tuple[int, int, int, int]], what: str, num_ranks: int, num_sms: int) -> Config:
    _check_int("num_ranks", num_ranks)
    if num_ranks not in table:
        raise UnsupportedRankCountError(
            f"no DeepEP V1 {what} config for {num_ranks} ranks (tuned for {sorted(table)}); build a Config yourself"
        )
    return Config(num_sms, *table[num_ranks])


def get_dispatch_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """DeepEP V1's tuned dispatch Config for ``num_ranks`` (2, 4, 8, 16, 24, 32, 48, 64, 96, 128,
    144, 160) with ``num_sms`` SMs (V1 uses its ``Buffer.num_sms``, default 20). Another rank count
    raises ``UnsupportedRankCountError`` (a ``ValueError`` and an ``AssertionError``)."""
    return _lookup(_DISPATCH_CHUNKS, "dispatch", num_ranks, num_sms)


def get_combine_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    """DeepEP V1's tuned combine Config for ``num_ranks``; see ``get_dispatch_config``."""
    return _lookup(_COMBINE_CHUNKS, "combine", num_ranks, num_sms)


def get_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Exact ``num_bytes`` (workspace included) of an LL-only window for these settings, sized for
    top-k ``min(32, num_experts)``: ``ElasticBuffer.get_low_latency_size_hint``."""
    return ElasticBuffer.get_low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
