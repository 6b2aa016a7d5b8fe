"""LL rank masking (``ElasticBuffer(enable_rank_masking=True)``): serving keeps going when a rank dies.

One rank (the last) exits between LL operations, or right after taking part in a dispatch. Every
survivor's next LL dispatch + combine must return within the GPU timeout + 2 s, mask the dead rank
(``low_latency_query_mask_buffer`` names it on every survivor) and give exact results over what is
left: the dispatch receives exactly the survivors' tokens (a dispatch the dead rank took part in
receives its tokens too), and combine sums only the slots whose expert is on a surviving rank (the
dead rank's contributions count as zero). The following operations, with and without hooks, are
exact and fast (no wait on the masked rank). ``low_latency_clean_mask_buffer`` restores the rank,
so the next operation waits for it again, masks it again after the timeout and is still exact;
``low_latency_update_mask_buffer`` masks it ahead of time, so no operation waits for it. Before the
death, with masking enabled and every rank alive, results are exact and nothing is masked. The
"between" case also runs through DeepEP V1's spelling (``deep_ep.Buffer(enable_shrink=True)``, a
mask set and cleaned before its LL window exists); destroy() skips the closing barriers of both of
its windows for the masked rank.

Experts are identities (combine gets back each rank's received rows unchanged) and the dispatch is
bf16, so every check is bitwise: compact rows of local expert ``l`` equal the selecting tokens of
every counted source in (source, token) order, and combine equals sum_k w_k x over the kept slots in
the kernel's order (k ascending, product rounded to fp32, then added; one bf16 rounding).

The "between" case runs once more with the ranks as 2 virtual nodes whose LL traffic crosses the
scale-out transport (``EP_LL_SCALEOUT=1``, ``lsa-deferred``): the dead rank is on the other node
than half of the survivors, so their waits on it are waits on transport signals.

Without masking a dead peer stays fatal (CommTimeoutError naming it): tests/gpu/test_faults.py.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.testing import launch
from deep_ep.testing.data import make_routing, make_tokens, make_weights

LL_TOKENS = 32
HIDDEN = 512
TOPK = 4
EXPERTS_PER_RANK = 4
TIMEOUT = 3.0
SLACK = 2.0  # what a survivor's operation may take beyond the GPU timeout (timeout + 2 s)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _inputs(rank: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (x, topk_idx, weights) of step ``seed`` on the CPU: every rank can rebuild
    every other rank's inputs."""
    generator = torch.Generator().manual_seed(7919 * seed + 31 * rank + 5)
    topk_idx = make_routing(LL_TOKENS, num_experts, TOPK, generator=generator)
    weights = make_weights(topk_idx, generator)
    x = make_tokens(LL_TOKENS, HIDDEN, generator)
    return x, topk_idx, weights


def _local_rows(rank: int, num_ranks: int, num_experts: int, seed: int, sources: list[int]) -> list[torch.Tensor]:
    """Compact rows of each local expert of ``rank``: the counted sources' tokens that selected it,
    in (source, token) order."""
    num_local = num_experts // num_ranks
    inputs = [_inputs(source, num_experts, seed) for source in sources]
    rows = []
    for local in range(num_local):
        expert = rank * num_local + local
        parts = [x[(topk_idx == expert).any(dim=1)] for x, topk_idx, _ in inputs]
        rows.append(torch.cat(parts) if parts else torch.empty(0, HIDDEN, dtype=torch.bfloat16))
    return rows


def _combined(x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """sum_k w_k x over the kept slots, k ascending, product rounded to fp32 then added."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(topk_idx.shape[1]):
        term = weights[:, k : k + 1] * x.float()
        acc = acc + torch.where(keep[:, k : k + 1], term, torch.zeros_like(term))
    return acc.bfloat16()


class _Rank:
    """One rank's buffer and the checks of one LL dispatch + combine."""

    def __init__(self, rank: int, num_ranks: int, group: dist.ProcessGroup, api: str = "elastic") -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_experts = EXPERTS_PER_RANK * num_ranks
        if api == "v1":
            # DeepEP V1's spelling: Buffer(enable_shrink=True); its timeout comes from the environment.
            os.environ["EP_GPU_TIMEOUT_SECS"] = str(TIMEOUT)
            num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
                LL_TOKENS, HIDDEN, num_ranks, self.num_experts
            )
            self.buffer = deep_ep.Buffer(
                group, 0, num_rdma_bytes, low_latency_mode=True, explicitly_destroy=True, enable_shrink=True
            )
            return
        nodes = {}
        if api == "elastic-nodes":
            # Every rank sets the same values before the buffer reads them.
            os.environ["EP_LL_SCALEOUT"] = "1"
            os.environ["EP_SCALEOUT_TRANSPORT"] = "lsa-deferred"
            nodes = {"num_ranks_per_node": num_ranks // 2}
        self.buffer = deep_ep.ElasticBuffer(
            group,
            num_max_dispatch_tokens_per_rank=LL_TOKENS,
            hidden=HIDDEN,
            num_topk=TOPK,
            num_experts=self.num_experts,
            num_gpu_timeout_secs=TIMEOUT,
            explicitly_destroy=True,
            enable_rank_masking=True,
            **nodes,
        )
        if api == "elastic-nodes" and not self.buffer.ll_scaleout:
            raise AssertionError("the buffer's LL does not cross the scale-out transport")

    def masked(self) -> list[int]:
        status = torch.full((self.num_ranks,), -1, dtype=torch.int32, device=_device())
        self.buffer.low_latency_query_mask_buffer(status)
        return [rank for rank, value in enumerate(status.tolist()) if value != 0]

    def dispatch(self, seed: int, *, hook: bool = False):
        x, topk_idx, _ = _inputs(self.rank, self.num_experts, seed)
        recv_x, recv_count, handle, _, recv_hook = self.buffer.low_latency_dispatch(
            x.to(_device()), topk_idx.to(_device()), LL_TOKENS, self.num_experts, use_fp8=False, return_recv_hook=hook
        )
        if recv_hook is not None:
            recv_hook()
        return recv_x, recv_count, handle

    def combine(self, seed: int, dispatched, *, hook: bool = False) -> torch.Tensor:
        recv_x, _, handle = dispatched
        _, topk_idx, weights = _inputs(self.rank, self.num_experts, seed)
        combined, _, recv_hook = self.buffer.low_latency_combine(
            recv_x.clone(), topk_idx.to(_device()), weights.to(_device()), handle, return_recv_hook=hook
        )
        if recv_hook is not None:
            recv_hook()
        return combined

    def check(self, seed: int, dispatched, combined: torch.Tensor, sources: list[int], absent: int | None) -> list[str]:
        """What differs from the exact result: dispatch over ``sources``, combine without the
        experts of ``absent``."""
        failures = []
        recv_x, recv_count, _ = dispatched
        expected_rows = _local_rows(self.rank, self.num_ranks, self.num_experts, seed, sources)
        counts = recv_count.cpu().tolist()
        for local, rows in enumerate(expected_rows):
            if counts[local] != rows.shape[0]:
                failures.append(f"seed {seed}: expert {local} got {counts[local]} rows, expected {rows.shape[0]}")
            elif not torch.equal(recv_x[local, : rows.shape[0]].cpu(), rows):
                failures.append(f"seed {seed}: local expert {local}: received rows differ from the sources' tokens")
        x, topk_idx, weights = _inputs(self.rank, self.num_experts, seed)
        keep = topk_idx >= 0
        if absent is not None:
            keep &= topk_idx // (self.num_experts // self.num_ranks) != absent
        if not torch.equal(combined.cpu(), _combined(x, topk_idx, weights, keep)):
            failures.append(f"seed {seed}: combine differs from the sum over the kept experts (absent: {absent})")
        return failures

    def pair(self, seed: int, sources: list[int], absent: int | None, *, hook: bool = False) -> dict:
        start = time.monotonic()
        dispatched = self.dispatch(seed, hook=hook)
        combined = self.combine(seed, dispatched, hook=hook)
        torch.cuda.synchronize()
        seconds = time.monotonic() - start
        failures = self.check(seed, dispatched, combined, sources, absent)
        return {"seconds": seconds, "failures": failures, "masked": self.masked()}


def _dies(rank: int, num_ranks: int, group: dist.ProcessGroup, when: str, api: str) -> dict:
    victim = num_ranks - 1
    everyone = list(range(num_ranks))
    survivors = everyone[:victim]
    me = _Rank(rank, num_ranks, group, api)
    if api == "v1":  # before the LL window exists: kept by the Buffer, applied when the window is built
        me.buffer.low_latency_update_mask_buffer(victim if rank != victim else 0, True)
        me.buffer.low_latency_clean_mask_buffer()
    results = {"all alive": me.pair(1, everyone, None)}
    dist.barrier(group=group)  # the last collective: the victim is gone after it
    if rank == victim:
        if when == "after-dispatch":
            me.dispatch(2)  # takes part in the next dispatch (its tokens reach the survivors), then dies
        torch.cuda.synchronize()  # nothing of the victim's is in flight when it dies
        os._exit(0)
    if when == "between":
        time.sleep(1.0)  # the victim exits meanwhile
    first_sources = everyone if when == "after-dispatch" else survivors
    results["first after the death"] = me.pair(2, first_sources, victim)
    results["next, with hooks"] = me.pair(3, survivors, victim, hook=True)
    me.buffer.low_latency_clean_mask_buffer()
    results["masked after clean"] = me.masked()
    results["after clean"] = me.pair(4, survivors, victim)
    me.buffer.low_latency_clean_mask_buffer()
    me.buffer.low_latency_update_mask_buffer(victim, True)
    results["masked by update"] = me.masked()
    results["after update"] = me.pair(5, survivors, victim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        me.buffer.destroy()
        results["destroy seconds"] = time.monotonic() - start
    results["destroy warnings"] = [str(warning.message) for warning in caught]
    return results


@pytest.mark.parametrize(
    ("when", "api"),
    [("between", "elastic"), ("after-dispatch", "elastic"), ("between", "v1"), ("between", "elastic-nodes")],
)
def test_a_dead_rank_is_masked_and_the_survivors_results_stay_exact(num_ranks: int, when: str, api: str) -> None:
    if num_ranks < 2:
        pytest.skip("needs a survivor")
    if api == "elastic-nodes" and (num_ranks < 4 or num_ranks % 2):
        pytest.skip(f"2 virtual nodes of at least 2 ranks need an even count >= 4; this run launches {num_ranks}")
    victim = num_ranks - 1
    results = launch(_dies, num_ranks, when, api, may_exit=(victim,), timeout_secs=300)
    assert results[victim] is None
    for rank, result in enumerate(results[:victim]):
        alive = result["all alive"]
        assert alive["failures"] == [] and alive["masked"] == [], (rank, alive)
        first = result["first after the death"]
        assert first["failures"] == [], (rank, first)
        assert first["masked"] == [victim], (rank, first)
        assert first["seconds"] < TIMEOUT + SLACK, (rank, first)
        following = result["next, with hooks"]
        assert following["failures"] == [] and following["masked"] == [victim], (rank, following)
        assert following["seconds"] < TIMEOUT, (rank, following)  # the masked rank is not waited for
        # Restored, then masked again: only a wait on it that timed out sets the mask.
        assert result["masked after clean"] == [], (rank, result)
        again = result["after clean"]
        assert again["failures"] == [] and again["masked"] == [victim], (rank, again)
        assert result["masked by update"] == [victim], (rank, result)
        updated = result["after update"]
        assert updated["failures"] == [] and updated["masked"] == [victim], (rank, updated)
        assert updated["seconds"] < TIMEOUT, (rank, updated)
        assert result["destroy seconds"] < SLACK, (rank, result)
        assert any(f"masked rank(s) [{victim}]" in message for message in result["destroy warnings"]), (rank, result)
    print(
        f"\n[masking] {api} {when}: first op after the death per survivor (s): "
        f"{[round(r['first after the death']['seconds'], 2) for r in results[:victim]]}"
    )


def _no_masking_without_death(rank: int, num_ranks: int, group: dist.ProcessGroup) -> dict:
    me = _Rank(rank, num_ranks, group)
    try:
        everyone = list(range(num_ranks))
        results = [me.pair(seed, everyone, None, hook=seed % 2 == 0) for seed in range(10, 16)]
        errors = {}
        for name, call in (
            ("self", lambda: me.buffer.low_latency_update_mask_buffer(rank, True)),
            ("range", lambda: me.buffer.low_latency_update_mask_buffer(num_ranks, True)),
            ("status dtype", lambda: me.buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, device=_device()))),
        ):
            try:
                call()
                errors[name] = None
            except ValueError as error:
                errors[name] = str(error)
        return {"pairs": results, "errors": errors}
    finally:
        me.buffer.destroy()


def test_with_masking_enabled_and_every_rank_alive_nothing_is_masked_and_results_are_exact(num_ranks: int) -> None:
    results = launch(_no_masking_without_death, num_ranks, timeout_secs=300)
    for rank, result in enumerate(results):
        for pair in result["pairs"]:
            assert pair["failures"] == [] and pair["masked"] == [], (rank, pair)
        assert all(message is not None for message in result["errors"].values()), (rank, result["errors"])
