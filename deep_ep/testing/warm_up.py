"""Load the compute libraries' kernels before ranks that share a GPU start communicating.

Ranks that share a GPU run under MPS. Loading a kernel module may wait for the GPU's running
kernels to finish (CUDA's documentation on lazy loading: "loading kernels might require context
synchronization"), and under MPS that includes the peers' kernels. A peer whose dispatch spins
until this rank sends therefore blocks this rank's first matmul until the peer's wait deadline
(measured on one H200, 4 ranks: the example MoE layer's first expert GEMMs stalled one
rank for exactly the 10 s deadline, after the other ranks' combine kernels had started). The
library loads its own kernels when a buffer is built and the launcher sets CUDA_MODULE_LOADING=EAGER,
but cuBLAS / cuBLASLt load a kernel's module when a call first needs it, and they pick kernels by
shape. ``warm_up_cuda_libraries`` makes the first call of every common GEMM form (2-D and batched,
both transposes as backward needs them, bf16 / fp16 / fp32) before any communication; code that
meets many shapes warms those itself (the example's ``MoELayer.warm_up``).
"""

from __future__ import annotations

import torch

_WARM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def warm_up_cuda_libraries(device: torch.device | int | None = None) -> None:
    """Run one small forward + backward GEMM of each form on ``device`` and wait for it."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    for dtype in _WARM_DTYPES:
        for batch in ((), (2,)):
            a = torch.randn(*batch, 64, 128, device=device, dtype=dtype, requires_grad=True)
            b = torch.randn(*batch, 128, 96, device=device, dtype=dtype, requires_grad=True)
            torch.nn.functional.silu(a @ b).sum().backward()
    torch.cuda.synchronize(device)
