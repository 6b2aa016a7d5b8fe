"""Before/after table of two benchmark results (bench_ht.json or bench_ll.json), as Markdown.

    python benchmarks/bench_compare.py BEFORE.json AFTER.json

The usual pair comes from ``scripts/ab_compare.sh`` (the same machine, built and run back to back).
Rows are matched by their key (HT: T, operation, requested SMs, ranks per node; LL: E, T,
operation); a row present on one side only is listed with "-" on the other. Per row: the
operation's time (HT: the slowest rank's median; LL: graph replay), the after/before ratio, the
floor fraction, HT's host µs of the call as "before → after" (median, max over ranks), and per
kernel its time as "before → after" (HT: max over ranks, and the min over ranks in brackets, which
for a kernel that waits for its peers is close to its own cost).

When the results carry the phase clock (``--phases``), a second table follows: per row and clocked
kernel (LL: per timing context, graph or chain), each phase's stamp as "before → after" (µs after
the kernel's first CTA entry, taken when its last CTA got there, max over ranks), and the start skew.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

Key = tuple[Any, ...]


def _kind(summary: dict[str, Any]) -> str:
    rows = summary.get("rows") or [{}]
    return "ll" if "num_experts" in rows[0] and isinstance(rows[0].get("time_us"), dict) else "ht"


def _key(kind: str, row: dict[str, Any]) -> Key:
    if kind == "ll":
        return (row["num_experts"], row["num_tokens"], row["operation"])
    return (row["num_tokens"], row["operation"], row.get("requested_num_sms", 0), row.get("num_ranks_per_node"))


def _label(kind: str, key: Key) -> str:
    if kind == "ll":
        return f"E={key[0]} T={key[1]} {key[2]}"
    label = f"T={key[0]} {key[1]}"
    if key[2]:
        label += f" sms={key[2]}"
    if key[3] is not None:
        label += f" S={key[3]}"
    return label


def _time(kind: str, row: dict[str, Any]) -> float:
    return row["time_us"]["graph"] if kind == "ll" else row["time_us"]


def _floor(kind: str, row: dict[str, Any]) -> float:
    return row["floor_fraction_graph"] if kind == "ll" else row["floor_fraction"]


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _kernels(before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
    """'name b → a' per kernel of either side; HT rows add the min over ranks in brackets."""
    sides = [row or {} for row in (before, after)]
    names = sorted({name for row in sides for name in row.get("kernels_us_max_over_ranks", {})})
    parts = []
    for name in names:
        values = []
        for row in sides:
            high = row.get("kernels_us_max_over_ranks", {}).get(name)
            low = row.get("kernels_us_min_over_ranks", {}).get(name)
            text = _number(high)
            if low is not None and high is not None and abs(high - low) >= 0.05:
                text += f" [{low:,.1f}]"
            values.append(text)
        parts.append(f"{name.removesuffix('_kernel')} {values[0]} → {values[1]}")
    return "; ".join(parts)


def _ordered_union(first: Any, second: Any) -> list[Any]:
    """The items of ``first`` in order, then those of ``second`` that ``first`` lacks."""
    return list(first) + [item for item in second if item not in first]


def _matched_rows(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, list[tuple[Key, Any, Any]]]:
    """The benchmark kind and (key, before row or None, after row or None) per row key of either
    side, before's order first. Raises ValueError for results of two different benchmarks."""
    kind, other = _kind(before), _kind(after)
    if kind != other:
        raise ValueError(f"the two files come from different benchmarks ({kind} and {other})")
    rows_before = {_key(kind, row): row for row in before["rows"]}
    rows_after = {_key(kind, row): row for row in after["rows"]}
    keys = _ordered_union(rows_before, rows_after)
    return kind, [(key, rows_before.get(key), rows_after.get(key)) for key in keys]


def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The Markdown table comparing two summaries of the same benchmark."""
    kind, pairs = _matched_rows(before, after)
    time_header = "graph µs" if kind == "ll" else "µs"
    host_header = "" if kind == "ll" else " host µs |"
    lines = [
        f"| row | {time_header} before | after | after / before | floor before | after |{host_header} kernels (µs) |",
        "|---|---|---|---|---|---|---|" + ("" if kind == "ll" else "---|"),
    ]
    for key, old, new in pairs:
        old_time = None if old is None else _time(kind, old)
        new_time = None if new is None else _time(kind, new)
        ratio = "-" if old_time is None or new_time is None or old_time == 0 else f"{new_time / old_time:.3f}"
        floors = ["-" if row is None else f"{_floor(kind, row):.2f}" for row in (old, new)]
        host = ""
        if kind == "ht":
            hosts = [None if row is None else row.get("host_us_max_over_ranks") for row in (old, new)]
            host = f" {_number(hosts[0])} → {_number(hosts[1])} |"
        lines.append(
            f"| {_label(kind, key)} | {_number(old_time)} | {_number(new_time)} | {ratio} | {floors[0]} | "
            f"{floors[1]} |{host} {_kernels(old, new)} |"
        )
    return "\n".join(lines)


def _phase_kernels(row: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{"[context ]kernel": {"stamps_us_max_over_ranks": ..., "start_skew_us": ...}} of one row:
    HT rows hold the kernels directly, LL rows one level of timing contexts above them."""
    found: dict[str, dict[str, Any]] = {}
    for name, value in ((row or {}).get("phases") or {}).items():
        if "stamps_us_max_over_ranks" in value:
            found[name] = value
        else:
            found.update({f"{name} {kernel}": clocked for kernel, clocked in value.items()})
    return found


def compare_phases(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The Markdown table of the phase stamps of two summaries ("" when neither has any)."""
    kind, pairs = _matched_rows(before, after)
    lines = []
    for key, old, new in pairs:
        sides = [_phase_kernels(old), _phase_kernels(new)]
        for kernel in _ordered_union(*sides):
            stamps = [side.get(kernel, {}).get("stamps_us_max_over_ranks", {}) for side in sides]
            cells = [
                f"{name} {_number(stamps[0].get(name))} → {_number(stamps[1].get(name))}"
                for name in _ordered_union(*stamps)
                if name != "start"
            ]
            skews = [_number(side.get(kernel, {}).get("start_skew_us")) for side in sides]
            lines.append(f"| {_label(kind, key)} | {kernel} | {'; '.join(cells)} | {skews[0]} → {skews[1]} |")
    if not lines:
        return ""
    header = [
        "| row | kernel | phase stamps, µs (before → after) | start skew µs |",
        "|---|---|---|---|",
    ]
    return "\n".join(header + lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="bench_ht.json or bench_ll.json of the before side")
    parser.add_argument("after", help="the same benchmark's JSON of the after side")
    args = parser.parse_args(argv)
    with open(args.before) as handle:
        before = json.load(handle)
    with open(args.after) as handle:
        after = json.load(handle)
    try:
        print(compare(before, after))
        phases = compare_phases(before, after)
        if phases:
            print()
            print(phases)
    except ValueError as error:
        raise SystemExit(f"bench_compare: {error}") from None


if __name__ == "__main__":
    main()
