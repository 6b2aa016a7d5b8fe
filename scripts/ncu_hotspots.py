"""Where a kernel's warps wait, from the SASS source page of an Nsight Compute report
(``ncu -i REP --page source --csv --print-source sass``, as scripts/ncu_kernel.sh writes it).

    python scripts/ncu_hotspots.py out/notify_source.csv [--top 25]     # hottest instructions
    python scripts/ncu_hotspots.py out/notify_source.csv --regions      # code regions by samples

Instructions of every profiled launch of the kernel are summed (more samples; the launches run the
same code). ``--regions`` groups consecutive instructions with the same execution count (of the
first launch): such a run is code that one set of warps executes, e.g. 8 = only CTA 0's eight warps
of a 256-thread kernel, so a region's samples are the time those warps spent there (about one
sample per SM every 64 cycles at sampling interval 0). Each region lists its memory, barrier and
atomic instructions, which is usually enough to find it in the CUDA source.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LANDMARKS = ("BAR", "MEMBAR", "ATOM", "RED", "STG", "LDG", "ST.E", "LD.E", "SHFL", "NANOSLEEP", "CCTL", "EXIT")


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_launches(path: str) -> tuple[list[str], list[list[dict[str, str]]]]:
    """(stall column names, one list of instruction rows per profiled launch)."""
    launches: list[list[dict[str, str]]] = []
    header: list[str] | None = None
    with open(path, newline="") as file:
        for row in csv.reader(file):
            if not row:
                continue
            if row[0] == "Kernel Name":
                launches.append([])
                header = None
            elif SAMPLES in row:
                header = row
            elif header is not None and launches:
                launches[-1].append(dict(zip(header, row, strict=False)))
    stalls = [name for name in (header or []) if name.startswith("stall_") and "Not Issued" not in name]
    return stalls, [launch for launch in launches if launch]


def opcode(source: str) -> str:
    words = source.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def hottest(stalls: list[str], launches: list[list[dict[str, str]]], top: int) -> None:
    rows = launches[0]
    sums = [collections.Counter() for _ in rows]
    for launch in launches:
        for index, values in enumerate(launch[: len(rows)]):
            for name in (SAMPLES, EXECUTED, *stalls):
                sums[index][name] += number(values.get(name, "0"))
    total = sum(item[SAMPLES] for item in sums) or 1.0
    by_reason = collections.Counter()
    for item in sums:
        for name in stalls:
            by_reason[name] += item[name]
    print(
        f"{total:.0f} samples over {len(launches)} launch(es); by reason: "
        + ", ".join(f"{name[6:]} {100 * value / total:.1f}%" for name, value in by_reason.most_common(8))
    )
    for index in sorted(range(len(rows)), key=lambda i: -sums[i][SAMPLES])[:top]:
        item = sums[index]
        reasons = " ".join(f"{name[6:]}={item[name]:.0f}" for name in sorted(stalls, key=lambda n: -item[n])[:2])
        print(
            f"{100 * item[SAMPLES] / total:5.1f}% {item[SAMPLES]:6.0f} #{index:<6d} exec={item[EXECUTED]:7.0f} "
            f"{reasons:30s} {rows[index].get('Source', '').strip()[:80]}"
        )


def regions(launches: list[list[dict[str, str]]], min_share: float) -> None:
    rows = launches[0]
    runs: list[list] = []  # [first, last, executions, samples, landmarks]
    for index, values in enumerate(rows):
        executed, samples = number(values.get(EXECUTED, "0")), number(values.get(SAMPLES, "0"))
        source = values.get("Source", "").strip()
        if runs and runs[-1][2] == executed:
            runs[-1][1] = index
            runs[-1][3] += samples
        else:
            runs.append([index, index, executed, samples, []])
        if any(opcode(source).startswith(mark) for mark in LANDMARKS):
            runs[-1][4].append(opcode(source))
    total = sum(run[3] for run in runs) or 1.0
    print(f"{total:.0f} samples (first launch); regions of equal execution count with >= {min_share:.1%} of them")
    for first, last, executed, samples, marks in runs:
        if samples < min_share * total:
            continue
        counted = collections.Counter(marks)
        landmarks = " ".join(f"{name}x{count}" if count > 1 else name for name, count in counted.items())
        print(
            f"#{first:>6d}-{last:<6d} exec={executed:6.0f} samples={samples:6.0f} ({100 * samples / total:4.1f}%) "
            f"{landmarks[:90]}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--regions", action="store_true", help="code regions (runs of equal execution count)")
    parser.add_argument("--min-share", type=float, default=0.003, help="smallest region shown (--regions)")
    args = parser.parse_args()
    stalls, launches = read_launches(args.csv)
    if not launches:
        print(f"ncu_hotspots: no instruction rows with '{SAMPLES}' in {args.csv}", file=sys.stderr)
        return 1
    if args.regions:
        regions(launches, args.min_share)
    else:
        hottest(stalls, launches, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
