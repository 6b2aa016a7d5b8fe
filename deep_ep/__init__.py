"""deep_ep: expert-parallel dispatch and combine for Mixture-of-Experts models."""

# torch first: whichever libnccl.so.2 loads first is the one every later dependency resolves to,
# and it must be torch's (the extension links the same file by path).
import torch  # noqa: F401  (import order matters)

from deep_ep import _C
from deep_ep._nccl_check import check_nccl

check_nccl(_C.nccl_compiled_version(), _C.nccl_loaded_version(), _C.nccl_library_path())

from deep_ep.buffer import ElasticBuffer  # noqa: E402
from deep_ep.errors import BufferTooSmallError, CommTimeoutError, PeerInputError  # noqa: E402
from deep_ep.event import EventOverlap  # noqa: E402
from deep_ep.fp8 import per_token_cast_back, per_token_cast_to_fp8  # noqa: E402
from deep_ep.handle import EPHandle  # noqa: E402
from deep_ep.low_latency import LowLatencyHandle  # noqa: E402

__all__ = [
    "BufferTooSmallError",
    "CommTimeoutError",
    "ElasticBuffer",
    "EPHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "PeerInputError",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
]
