"""Phase clock: the environment switch and the summaries of raw stamps (no GPU needed)."""

from __future__ import annotations

import pytest

from deep_ep import _C, phase_clock

KERNELS = list(_C.PHASE_CLOCK_KERNELS)
CTAS = int(_C.PHASE_CLOCK_CTAS)
STAMPS = int(_C.PHASE_CLOCK_STAMPS)


def _raw(values: dict[tuple[str, int], list[int]]) -> list[int]:
    """Raw stamps with the given rows: (kernel, CTA) -> stamps from 0 (the rest stay 0)."""
    stamps = [0] * (len(KERNELS) * CTAS * STAMPS)
    for (kernel, cta), row in values.items():
        base = (KERNELS.index(kernel) * CTAS + cta) * STAMPS
        stamps[base : base + len(row)] = row
    return stamps


def test_the_switch_reads_its_variable(monkeypatch):
    monkeypatch.delenv(phase_clock.ENV, raising=False)
    assert phase_clock.requested() is False
    monkeypatch.setenv(phase_clock.ENV, "1")
    assert phase_clock.requested() is True
    monkeypatch.setenv(phase_clock.ENV, "yes")
    with pytest.raises(ValueError, match="EP_PHASE_CLOCK must be 0 or 1, got 'yes'"):
        phase_clock.requested()


def test_every_kernel_names_its_entry_first_and_fits_the_layout():
    for kernel, names in _C.PHASE_CLOCK_KERNELS.items():
        assert names[0] == "start", kernel
        assert 1 < len(names) <= STAMPS, kernel
        assert len(set(names)) == len(names), kernel


def test_a_phase_is_when_the_last_cta_reached_it_after_the_first_cta_entered():
    # Notify: CTA 0 enters at 1,000 ns and does the count exchange; CTA 1 enters at 3,000 ns.
    stamps = _raw(
        {
            ("ht_notify", 0): [1_000, 9_000, 12_000, 13_000, 40_000, 0, 41_000, 0],
            ("ht_notify", 1): [3_000, 9_500, 12_500, 0, 0, 0, 0, 20_000],
        }
    )
    phases = phase_clock.summarise(stamps)
    assert list(phases) == ["ht_notify"]  # kernels with no stamp are left out
    notify = phases["ht_notify"]
    assert notify["start_ns"] == 1_000
    assert notify["start"] == pytest.approx(2.0)  # the last CTA entered 2 µs after the first
    assert notify["blocks_counted"] == pytest.approx(8.5)
    assert notify["counts_arrived"] == pytest.approx(39.0)
    assert notify["send_bases_arrived"] is None  # no zero-copy receive: never reached
    assert notify["bases_added"] == pytest.approx(19.0)


def test_summarise_refuses_a_wrong_number_of_stamps():
    with pytest.raises(ValueError, match="expected .* stamps, got 3"):
        phase_clock.summarise([0, 0, 0])


def test_across_ranks_measures_from_the_first_rank_entry():
    rank0 = phase_clock.summarise(_raw({("ll_dispatch_recv", 0): [10_000, 30_000, 35_000]}))
    rank1 = phase_clock.summarise(_raw({("ll_dispatch_recv", 0): [14_000, 31_000, 33_000]}))
    merged = phase_clock.across_ranks([rank0, rank1])["ll_dispatch_recv"]
    assert merged["start_skew_us"] == pytest.approx(4.0)
    assert merged["counts_arrived"] == pytest.approx(21.0)  # rank 1 at 31 µs, from rank 0's 10 µs entry
    assert merged["rows_copied"] == pytest.approx(25.0)  # rank 0 at 35 µs


def test_a_runtime_without_a_phase_clock_refuses_to_read_one():
    # Construction of the runtime needs a GPU; the refusal is the runtime's, checked on the GPU by
    # tests/gpu/test_phase_clock.py. Here: the reader needs a runtime at all.
    class Destroyed:
        _runtime = None

    with pytest.raises(RuntimeError, match="no runtime"):
        phase_clock.read(Destroyed())
