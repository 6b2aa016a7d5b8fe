// Device side of the phase clock (common/phase_clock.hpp): thread 0 of a CTA stamps the global
// timer at a phase boundary. A no-op unless the runtime was built with a phase clock.
#pragma once

#include "common/device_view.hpp"
#include "common/phase_clock.hpp"
#include "kernels/ptx.cuh"

namespace deep_ep {

__device__ __forceinline__ void clock_phase(const DeviceView& view, ClockedKernel kernel, int stamp) {
  if (view.phase_clock == nullptr || threadIdx.x != 0 || blockIdx.x >= kPhaseClockCtas) return;
  const int64_t index =
      (int64_t{static_cast<int32_t>(kernel)} * kPhaseClockCtas + blockIdx.x) * kPhaseClockStamps + stamp;
  view.phase_clock[index] = ptx::global_timer_ns();
}

}  // namespace deep_ep
