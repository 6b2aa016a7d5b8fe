"""Copy ceilings of this machine: device-to-device copy on GPU 0 and peer copies between GPU 0 and 1
(one direction and both at once). Prints GB/s (bytes moved once per copy; the device copy also as
read + write)."""

from __future__ import annotations

import json
import sys

import torch


def _time_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int = 20) -> float:
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    events = []
    for dst, src in pairs:
        with torch.cuda.device(src.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream()
            start.record(stream)
            for _ in range(repeats):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
            events.append((start, end))
    torch.cuda.synchronize()
    seconds = max(start.elapsed_time(end) for start, end in events) / 1e3
    return sum(src.numel() for _, src in pairs) * repeats / seconds / 1e9


def main() -> None:
    num_bytes = 1 << 30
    gpu0 = [torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    result = {"device_copy_gbs_read_plus_write": 2 * _time_copies([(gpu0[1], gpu0[0])])}
    if torch.cuda.device_count() >= 2:
        gpu1 = [torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1") for _ in range(2)]
        result["peer_copy_0_to_1_gbs"] = _time_copies([(gpu1[0], gpu0[0])])
        result["peer_copy_both_directions_gbs"] = _time_copies([(gpu1[0], gpu0[0]), (gpu0[1], gpu1[1])])
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
