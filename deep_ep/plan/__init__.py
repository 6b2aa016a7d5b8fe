"""Capacity and traffic planner: buffer bytes (from the C++ geometry), routing statistics,
cross-node copies under three deduplication strategies, transfer times and the analytic SM estimate.

CLI: ``python -m deep_ep.plan --help``.
"""

from deep_ep.plan.estimates import (
    expected_groups_touched,
    theoretical_num_qps,
    theoretical_num_sms,
    uniform_cross_node_copies,
)
from deep_ep.plan.report import PlanConfig, build_plan, format_plan
from deep_ep.plan.routing import node_limited_topk, random_scores
from deep_ep.plan.sizing import buffer_bytes, high_throughput_bytes, low_latency_slots, window_bytes
from deep_ep.plan.traffic import cross_node_copies, transfer_times

__all__ = [
    "PlanConfig",
    "buffer_bytes",
    "build_plan",
    "cross_node_copies",
    "expected_groups_touched",
    "format_plan",
    "high_throughput_bytes",
    "low_latency_slots",
    "node_limited_topk",
    "random_scores",
    "theoretical_num_qps",
    "theoretical_num_sms",
    "transfer_times",
    "uniform_cross_node_copies",
    "window_bytes",
]
