"""One plan for one MoE setup: buffer bytes, routing statistics, transfer times, SM estimate.

``build_plan`` returns a JSON-ready dict (what ``python -m deep_ep.plan --json`` prints);
``format_plan`` renders it as the human table (the CLI default, also printed by the demo).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deep_ep.plan.budget import caps_within_budget
from deep_ep.plan.estimates import theoretical_num_qps, theoretical_num_sms, uniform_cross_node_copies
from deep_ep.plan.routing import check_placement, node_limited_topk, random_scores, require
from deep_ep.plan.sizing import buffer_bytes
from deep_ep.plan.traffic import COPY_KINDS, cross_node_copies, transfer_times


@dataclass(frozen=True)
class PlanConfig:
    """A DeepSeek-V3-like setup by default: 8 nodes x 8 GPUs, 256 experts, top-8, hidden 7168."""

    num_ranks: int = 64
    num_ranks_per_node: int = 8
    num_experts: int = 256
    num_topk: int = 8
    hidden: int = 7168
    num_max_tokens_per_rank: int = 4096  # HT T_max
    num_max_dispatch_tokens_per_rank: int = 128  # LL T_max
    use_fp8: bool = True
    zero_copy_combine: bool = False  # size the HT region for zero-copy combines (direct mode only)
    max_nodes: int | None = None  # node limit for routing; None = min(4, num_nodes)
    link_gbs: float = 50.0  # scale-out link per GPU (400 Gb/s NIC)
    nvlink_gbs: float = 450.0  # scale-up one-way bandwidth per GPU
    num_sampled_tokens: int = 20000
    seed: int = 0
    memory_budget_bytes: int | None = None  # per rank: also report the largest caps whose window fits

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.num_ranks_per_node

    @property
    def resolved_max_nodes(self) -> int:
        return min(4, self.num_nodes) if self.max_nodes is None else self.max_nodes

    def validate(self) -> None:
        """Raise ValueError naming the first bad argument (buffer sizes are validated again by _C)."""
        check_placement(self.num_experts, self.num_ranks, self.num_ranks_per_node)
        require(
            1 <= self.num_topk <= self.num_experts,
            f"num_topk must be in [1, num_experts={self.num_experts}], got {self.num_topk}",
        )
        require(
            1 <= self.resolved_max_nodes <= self.num_nodes,
            f"max_nodes must be in [1, num_nodes={self.num_nodes}], got {self.max_nodes}",
        )
        reachable = self.resolved_max_nodes * (self.num_experts // self.num_nodes)
        require(
            self.num_topk <= reachable,
            f"num_topk ({self.num_topk}) must be <= the experts on max_nodes={self.resolved_max_nodes} "
            f"nodes ({reachable})",
        )
        require(self.hidden > 0, f"hidden must be positive, got {self.hidden}")
        require(
            not self.zero_copy_combine or self.num_nodes == 1,
            f"zero_copy_combine is direct mode only (one node), got {self.num_nodes} nodes",
        )
        require(
            not self.use_fp8 or self.hidden % 128 == 0,
            f"hidden must be a multiple of 128 for fp8 (one scale per 128 channels), got {self.hidden}",
        )
        require(
            self.num_max_tokens_per_rank >= 0,
            f"num_max_tokens_per_rank must be >= 0, got {self.num_max_tokens_per_rank}",
        )
        require(
            self.num_max_dispatch_tokens_per_rank >= 0,
            f"num_max_dispatch_tokens_per_rank must be >= 0, got {self.num_max_dispatch_tokens_per_rank}",
        )
        require(self.link_gbs > 0, f"link_gbs must be > 0, got {self.link_gbs}")
        require(self.nvlink_gbs > 0, f"nvlink_gbs must be > 0, got {self.nvlink_gbs}")
        require(self.num_sampled_tokens >= 1, f"num_sampled_tokens must be >= 1, got {self.num_sampled_tokens}")
        require(
            self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
            f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}",
        )


def _routing(config: PlanConfig) -> dict[str, dict[str, float]]:
    """Copies per token: closed form for uniform routing, and both routings sampled from one set of scores."""
    scores = random_scores(config.num_sampled_tokens, config.num_experts, config.seed)
    uniform_idx = scores.topk(config.num_topk, dim=-1).indices
    limited_idx = node_limited_topk(scores, config.num_nodes, config.num_topk, config.resolved_max_nodes)
    placement = (config.num_experts, config.num_ranks, config.num_ranks_per_node)
    return {
        "uniform_exact": uniform_cross_node_copies(
            config.num_experts, config.num_topk, config.num_ranks, config.num_ranks_per_node
        ),
        "uniform_sampled": cross_node_copies(uniform_idx, *placement),
        "node_limited_sampled": cross_node_copies(limited_idx, *placement),
    }


def build_plan(config: PlanConfig | None = None) -> dict:
    config = config or PlanConfig()
    config.validate()
    buffers = buffer_bytes(
        config.num_ranks,
        config.num_ranks_per_node,
        config.num_experts,
        config.num_topk,
        config.hidden,
        config.num_max_tokens_per_rank,
        config.num_max_dispatch_tokens_per_rank,
        config.use_fp8,
        config.zero_copy_combine,
    )
    routing = _routing(config)
    # What crosses the link per copy: a whole HT dispatch slot, or one LL message.
    batches = {
        "high_throughput": (config.num_max_tokens_per_rank, buffers["high_throughput"]["dispatch_token_bytes"]),
        "low_latency": (config.num_max_dispatch_tokens_per_rank, buffers["low_latency"]["message_bytes"]),
    }
    times = {
        batch: {
            "num_tokens": num_tokens,
            "message_bytes": message_bytes,
            **{
                routing_name: transfer_times(
                    routing[routing_name], message_bytes=message_bytes, num_tokens=num_tokens, link_gbs=config.link_gbs
                )
                for routing_name in ("uniform_sampled", "node_limited_sampled")
            },
        }
        for batch, (num_tokens, message_bytes) in batches.items()
        if num_tokens > 0
    }
    hybrid = config.num_nodes > 1
    sms_args = (config.num_experts, config.num_topk, config.num_ranks, config.num_ranks_per_node, config.num_nodes)
    sms_kwargs = {"nvlink_gbs": config.nvlink_gbs, "rdma_gbs": config.link_gbs if hybrid else 0.0}
    num_sms = theoretical_num_sms(*sms_args, **sms_kwargs)
    budget = {}
    if config.memory_budget_bytes is not None:
        budget["memory_budget"] = caps_within_budget(
            config.memory_budget_bytes,
            num_ranks=config.num_ranks,
            num_ranks_per_node=config.num_ranks_per_node,
            num_experts=config.num_experts,
            num_topk=config.num_topk,
            hidden=config.hidden,
            use_fp8=config.use_fp8,
            num_max_tokens_per_rank=config.num_max_tokens_per_rank,
            num_max_dispatch_tokens_per_rank=config.num_max_dispatch_tokens_per_rank,
            zero_copy_combine=config.zero_copy_combine,
        )
    return {
        "config": {**dataclasses.asdict(config), "max_nodes": config.resolved_max_nodes, "num_nodes": config.num_nodes},
        **buffers,
        "routing": routing,
        "transfer_times_s": times,
        "theoretical": {
            "num_sms": num_sms,
            "num_sms_no_overlap": theoretical_num_sms(*sms_args, **sms_kwargs, prefer_overlap_with_compute=False),
            "num_qps": theoretical_num_qps(num_sms, hybrid),
        },
        **budget,
    }


def _bytes(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{int(value):,} B ({value / scale:.2f} {unit})"
    return f"{int(value):,} B"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3f} ms" if value >= 1e-3 else f"{value * 1e6:.1f} us"


def format_plan(plan: dict) -> str:
    config = plan["config"]
    ht, ll, window = plan["high_throughput"], plan["low_latency"], plan["window"]
    lines = [
        (
            f"deep_ep plan: {config['num_ranks']} ranks ({config['num_nodes']} node(s) x "
            f"{config['num_ranks_per_node']}), {config['num_experts']} experts, top-{config['num_topk']}, "
            f"hidden {config['hidden']}, {'fp8' if config['use_fp8'] else 'bf16'} dispatch"
        ),
        (
            f"HT max tokens per rank {config['num_max_tokens_per_rank']}, "
            f"LL max tokens per rank {config['num_max_dispatch_tokens_per_rank']}"
        ),
        "",
        "Buffer bytes per rank (what ElasticBuffer allocates)",
    ]
    rows = [
        ("HT dispatch token slot", _bytes(ht["dispatch_token_bytes"])),
        ("HT combine token slot", _bytes(ht["combine_token_bytes"])),
        ("HT dispatch footprint", _bytes(ht["dispatch_bytes"])),
        ("HT combine footprint", _bytes(ht["combine_bytes"])),
        *(
            [("HT zero-copy combine footprint", _bytes(ht["zero_copy_combine_bytes"]))]
            if config["zero_copy_combine"]
            else []
        ),
        ("HT region", _bytes(ht["region_bytes"])),
        ("LL message", _bytes(ll["message_bytes"])),
        ("LL receive slots", _bytes(ll["recv_slot_bytes"])),
        (
            f"LL expected used (uniform top-{config['num_topk']})",
            f"{_bytes(ll['expected_used_bytes'])}, {100 * ll['used_fraction']:.2f} % of the slots",
        ),
        ("LL region (3 areas, with combine)", _bytes(ll["total_buffer_bytes"])),
        ("Workspace", _bytes(window["workspace_bytes"])),
        ("Window total", _bytes(window["total_bytes"])),
    ]
    lines += [f"  {label:<38} {value}" for label, value in rows]

    routing = plan["routing"]
    columns = ("uniform_exact", "uniform_sampled", "node_limited_sampled")
    lines += [
        "",
        (
            f"Per token from node 0 ({config['num_sampled_tokens']} tokens sampled, seed {config['seed']}, "
            f"node limit {config['max_nodes']} node(s))"
        ),
        f"  {'':<38} {'uniform exact':>14} {'uniform':>14} {'node-limited':>14}",
    ]
    routing_rows = [
        ("ranks touched", "ranks_per_token"),
        ("nodes touched (holding its experts)", "nodes_per_token"),
        ("cross-node copies, per expert", "per_expert"),
        ("cross-node copies, per rank", "per_rank"),
        ("cross-node copies, per node", "per_node"),
    ]
    for label, key in routing_rows:
        lines.append(f"  {label:<38} " + " ".join(f"{routing[column][key]:>14.3f}" for column in columns))

    lines += ["", f"Time for one rank's cross-node copies at {config['link_gbs']:g} GB/s"]
    lines.append(f"  {'':<38} {'uniform':>14} {'node-limited':>14}")
    for batch, times in plan["transfer_times_s"].items():
        name = "HT" if batch == "high_throughput" else "LL"
        lines.append(f"  {name} batch: {times['num_tokens']} tokens x {times['message_bytes']:,} B")
        for kind in COPY_KINDS:
            label = f"    {kind.replace('_', ' ')}"
            lines.append(
                f"  {label:<38} {_seconds(times['uniform_sampled'][kind]):>14} "
                f"{_seconds(times['node_limited_sampled'][kind]):>14}"
            )

    theoretical = plan["theoretical"]
    lines += [
        "",
        (
            f"Analytic SMs (NVLink {config['nvlink_gbs']:g} GB/s, scale-out {config['link_gbs']:g} GB/s): "
            f"{theoretical['num_sms']} overlapping compute, {theoretical['num_sms_no_overlap']} otherwise; "
            f"QPs {theoretical['num_qps']}"
        ),
    ]
    if "memory_budget" in plan:
        budget = plan["memory_budget"]
        ht_cap, ll_cap = config["num_max_tokens_per_rank"], config["num_max_dispatch_tokens_per_rank"]
        verdict = "fits" if budget["configured_fits"] else "does NOT fit"
        lines += [
            "",
            f"Memory budget {_bytes(budget['budget_bytes'])} per rank (window bytes as allocated)",
            f"  {f'configured window (HT {ht_cap}, LL {ll_cap})':<38} {_bytes(budget['configured_bytes'])}: {verdict}",
            f"  {f'largest HT cap with LL {ll_cap}':<38} {budget['ht_with_ll']} tokens per rank",
            f"  {f'largest LL cap with HT {ht_cap}':<38} {budget['ll_with_ht']} tokens per rank",
            f"  {'largest HT cap, HT-only buffer':<38} {budget['ht_only']} tokens per rank",
            f"  {'largest LL cap, LL-only buffer':<38} {budget['ll_only']} tokens per rank",
        ]
    return "\n".join(lines)
