"""``python -m deep_ep.plan``: print the plan for one MoE setup (table, or ``--json``).

Bad arguments print one line naming the argument on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from deep_ep.plan.budget import parse_bytes
from deep_ep.plan.report import PlanConfig, build_plan, format_plan

USAGE_ERROR = 2


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    defaults = PlanConfig()
    parser = _OneLineParser(
        prog="python -m deep_ep.plan",
        description="Buffer bytes, routing traffic and time estimates for an expert-parallel MoE setup. "
        "Defaults describe a DeepSeek-V3-like deployment.",
    )
    parser.add_argument("--num-ranks", type=int, default=defaults.num_ranks)
    parser.add_argument("--num-ranks-per-node", type=int, default=defaults.num_ranks_per_node)
    parser.add_argument("--num-experts", type=int, default=defaults.num_experts)
    parser.add_argument("--num-topk", type=int, default=defaults.num_topk)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument(
        "--num-max-tokens-per-rank", type=int, default=defaults.num_max_tokens_per_rank, help="HT batch cap"
    )
    parser.add_argument(
        "--num-max-dispatch-tokens-per-rank",
        type=int,
        default=defaults.num_max_dispatch_tokens_per_rank,
        help="LL batch cap",
    )
    parser.add_argument(
        "--fp8", action=argparse.BooleanOptionalAction, default=defaults.use_fp8, help="fp8 dispatch payload"
    )
    parser.add_argument(
        "--zero-copy-combine",
        action="store_true",
        help="size the HT region for zero-copy combines (ElasticBuffer(zero_copy_combine=True); one node only)",
    )
    parser.add_argument(
        "--max-nodes", type=int, default=None, help="node limit of the routing (default: min(4, nodes))"
    )
    parser.add_argument("--link-gbs", type=float, default=defaults.link_gbs, help="scale-out GB/s per GPU")
    parser.add_argument("--nvlink-gbs", type=float, default=defaults.nvlink_gbs, help="scale-up GB/s per GPU")
    parser.add_argument("--num-sampled-tokens", type=int, default=defaults.num_sampled_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="window bytes per rank (e.g. 8GiB, 512MiB): also print the largest token caps that fit",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        budget = None if args.memory_budget is None else parse_bytes(args.memory_budget)
    except ValueError as error:
        print(f"python -m deep_ep.plan: error: --memory-budget: {error}", file=sys.stderr)
        return USAGE_ERROR
    config = PlanConfig(
        num_ranks=args.num_ranks,
        num_ranks_per_node=args.num_ranks_per_node,
        num_experts=args.num_experts,
        num_topk=args.num_topk,
        hidden=args.hidden,
        num_max_tokens_per_rank=args.num_max_tokens_per_rank,
        num_max_dispatch_tokens_per_rank=args.num_max_dispatch_tokens_per_rank,
        use_fp8=args.fp8,
        zero_copy_combine=args.zero_copy_combine,
        max_nodes=args.max_nodes,
        link_gbs=args.link_gbs,
        nvlink_gbs=args.nvlink_gbs,
        num_sampled_tokens=args.num_sampled_tokens,
        seed=args.seed,
        memory_budget_bytes=budget,
    )
    try:
        plan = build_plan(config)
    except ValueError as error:
        print(f"python -m deep_ep.plan: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
