"""deep_ep: expert-parallel dispatch and combine for Mixture-of-Experts models."""

# torch first: whichever libnccl.so.2 loads first is the one every later dependency resolves to,
# and it must be torch's (the extension links the same file by path).
import torch  # noqa: F401  (import order matters)

from deep_ep import _C
from deep_ep._nccl_check import check_nccl

check_nccl(_C.nccl_compiled_version(), _C.nccl_loaded_version(), _C.nccl_library_path())

from importlib import metadata as _metadata  # noqa: E402

from deep_ep import utils  # noqa: E402
from deep_ep.buffer import ElasticBuffer  # noqa: E402
from deep_ep.compat.buffer import Buffer  # noqa: E402  (DeepEP V1's API over an ElasticBuffer)
from deep_ep.compat.config import (  # noqa: E402
    Config,
    get_combine_config,
    get_dispatch_config,
    get_low_latency_rdma_size_hint,
)
from deep_ep.domains import get_logical_domain_size, get_physical_domain_size  # noqa: E402
from deep_ep.errors import BufferTooSmallError, CommTimeoutError, PeerInputError  # noqa: E402
from deep_ep.event import EventOverlap  # noqa: E402
from deep_ep.fp8 import per_token_cast_back, per_token_cast_to_fp8  # noqa: E402
from deep_ep.handle import EPHandle  # noqa: E402
from deep_ep.low_latency import LowLatencyHandle  # noqa: E402
from deep_ep.utils import EventHandle  # noqa: E402

# dtype of top-k expert indices everywhere in the API (DeepEP V1 exposes the same name).
topk_idx_t = torch.int64

_VERSION_NOT_INSTALLED = "0.0.0+unknown"


def _package_version() -> str:
    """The installed distribution's version; ``0.0.0+unknown`` when deep_ep runs from a source tree
    that was never installed (no package metadata to read)."""
    try:
        return _metadata.version("deep_ep")
    except _metadata.PackageNotFoundError:
        return _VERSION_NOT_INSTALLED


__version__ = _package_version()

__all__ = [
    "Buffer",
    "BufferTooSmallError",
    "CommTimeoutError",
    "Config",
    "ElasticBuffer",
    "EPHandle",
    "EventHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "PeerInputError",
    "__version__",
    "get_combine_config",
    "get_dispatch_config",
    "get_logical_domain_size",
    "get_low_latency_rdma_size_hint",
    "get_physical_domain_size",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "topk_idx_t",
    "utils",
]
