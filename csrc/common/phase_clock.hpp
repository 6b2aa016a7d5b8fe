// Phase clock (opt-in, for profiling): kernels stamp the GPU's global nanosecond timer at the
// boundaries of their phases, per CTA, into device memory the runtime owns (read back with a copy
// after the device is idle). Off (the default), DeviceView::phase_clock is null and a stamp costs
// one predicated branch.
//
// Layout: [kernel][CTA][stamp] uint64 nanoseconds, 0 = not reached. Stamp 0 of every kernel is its
// entry. The global timer is one clock for the whole GPU, so the stamps of ranks sharing a GPU can
// be compared directly (e.g. how far apart their kernels started).
#pragma once

#include <cstdint>

namespace deep_ep {

enum class ClockedKernel : int32_t {
  kHtNotify = 0,
  kHtDispatch = 1,
  kLlDispatchSend = 2,
  kLlDispatchRecv = 3,
  kLlCombineSend = 4,
  kLlCombineRecv = 5,
  kHtCombinePull = 6,
};

constexpr int kPhaseClockKernels = static_cast<int>(ClockedKernel::kHtCombinePull) + 1;
constexpr int kPhaseClockCtas = 160;  // stamps of CTAs beyond this are not kept
constexpr int kPhaseClockStamps = 14;
constexpr int64_t kPhaseClockEntries = int64_t{kPhaseClockKernels} * kPhaseClockCtas * kPhaseClockStamps;

struct ClockedKernelNames {
  const char* kernel;
  const char* stamps[kPhaseClockStamps];  // nullptr: unused
};

// What each stamp of each kernel marks: the time its CTA (thread 0) reached that point.
inline constexpr ClockedKernelNames kClockedKernelNames[kPhaseClockKernels] = {
    {"ht_notify",
     {"start", "blocks_counted", "bases_summed", "counts_sent", "counts_arrived", "send_bases_arrived",
      "counts_written", "bases_added", "ids_staged", "own_blocks_scanned", "ids_loaded", "block_counted",
      "expert_counts_taken", "mapped_counts_stored"}},
    {"ht_dispatch", {"start", "entry_barrier", "rows_sent", "grid_synced", "exit_barrier"}},
    {"ll_dispatch_send", {"start", "gate_open", "lists_built", "rows_sent", "arrivals_published", "end"}},
    {"ll_dispatch_recv", {"start", "counts_arrived", "rows_copied"}},
    {"ll_combine_send", {"start", "gate_open", "rows_sent", "arrivals_published", "end"}},
    {"ll_combine_recv", {"start", "rows_arrived", "rows_reduced"}},
    {"ht_combine_pull", {"start", "entry_barrier", "grid_synced", "rows_summed", "exit_grid_synced", "exit_barrier"}},
};
static_assert(kClockedKernelNames[kPhaseClockKernels - 1].kernel != nullptr,
              "every ClockedKernel needs its names (in enum order)");

}  // namespace deep_ep
