"""The keyword arguments of ``ElasticBuffer._check_settings`` (the constructor's checks, which run
without a GPU), at values that pass: tests override the one setting they are about."""

from __future__ import annotations

from typing import Any


def buffer_settings(**overrides: Any) -> dict[str, Any]:
    settings = dict(
        num_bytes=None,
        num_max_tokens_per_rank=64,
        hidden=2048,
        num_topk=8,
        use_fp8_dispatch=False,
        num_max_dispatch_tokens_per_rank=0,
        num_experts=64,
        allow_hybrid_mode=True,
        allow_multiple_reduction=True,
        num_gpu_timeout_secs=None,
        num_cpu_timeout_secs=None,
        backend=None,
        num_ranks_per_node=None,
    )
    settings.update(overrides)
    return settings
