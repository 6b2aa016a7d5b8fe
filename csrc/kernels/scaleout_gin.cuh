// The gin scale-out transport: NCCL 2.28.9 GPU-initiated networking (GIN) for ranks on other hosts.
// The interface and its rules are in scaleout.cuh; this file maps each call onto NCCL's ncclGin.
//
// Every call addresses the peer as a rank of the world team (ncclTeamWorld), so `peer` is the
// global rank, and uses the one registered window (view.scaleout.gin_window) as both source and
// destination: offsets here are window offsets, as everywhere in the transport.
//
// Contexts. A GIN context is a set of connections, one per peer (GDAKI: one queue pair per peer;
// proxy: one descriptor queue per peer). NCCL orders operations only within one (context, peer)
// pair: a signal becomes visible at the peer after every earlier operation of the same context to
// that peer has landed, and nothing is ordered across contexts. Each CTA therefore posts all of its
// puts and signals on one context, `blockIdx.x % ginContextCount`, so that "the signal covers every
// put this CTA issued to the peer before it" is exactly NCCL's per-(context, peer) rule. CTAs that
// share a context only add ordering, never remove it.
//
// Signals are per context. In 2.28.9 each context owns its own signal table (the devComm also
// keeps one shadow array per context), and a signal posted on context c lands in slot `id` of the
// receiver's context-c table. The receiving CTA does not know which context (which sender CTA)
// signalled, so read_signal returns the sum of slot `id` over every context. Every transport
// signal is a SignalAdd and never reset, so each slot and the sum are monotonic, and a sum that
// reached the expected total was read through acquire loads that saw every contributing add.
// Signals start at zero because every buffer creates its own communicator (fresh GIN tables).
//
// Flush. Both 2.28.9 backends implement flush per context, not per thread: every thread of the
// flushing coop takes a share of the peers and waits until that peer's connection on this context
// has completed all it was given (GDAKI: the send queue's completion reaches its reserved index;
// proxy: the consumer index reaches the producer index). NCCL's documented contract is narrower:
// the puts "from any thread in this coop" have consumed their sources. A put here is posted by
// lane 0 of the calling warp, so each warp flushes with the warp coop (which holds that lane) on
// its CTA's context: the contract covers the warp's own puts, and the 32 lanes share the waits.
// Called by every warp of the transport group, this covers every put the group posted.
//
// The GIN signal ids are 0..kMaxScaleoutSignals-1 (requested in csrc/memory/nccl_window.cpp);
// the host refuses a devComm whose signals or contexts do not fit.
#pragma once

#include <nccl_device.h>

#include <cstdint>

#include "common/device_view.hpp"

namespace deep_ep::scaleout::gin {

__device__ __forceinline__ const ncclDevComm& dev_comm(const DeviceView& view) {
  return *static_cast<const ncclDevComm*>(view.scaleout.gin_dev_comm);
}

__device__ __forceinline__ ncclWindow_t window(const DeviceView& view) {
  return static_cast<ncclWindow_t>(view.scaleout.gin_window);
}

// The context of this CTA: puts, signals and flushes of one CTA all use it (see above).
__device__ __forceinline__ int cta_context(const ncclDevComm& comm) {
  return static_cast<int>(blockIdx.x % comm.ginContextCount);
}

// Warp-collective: lane 0 posts one put of `bytes` from this rank's window at `src` to `peer`'s
// window at `dst`, with no remote or local action. The __syncwarp orders what the warp's lanes
// wrote (the source row) before the post; writes by other warps must be ordered before it by the
// caller (a named barrier). Returns at once: the source stays in use until a flush.
__device__ __forceinline__ void put(const DeviceView& view, int peer, int64_t dst, int64_t src, int64_t bytes) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
    const ncclDevComm& comm = dev_comm(view);
    const ncclGin gin(comm, cta_context(comm));
    const ncclWindow_t win = window(view);
    gin.put(ncclTeamWorld(comm), peer, win, static_cast<size_t>(dst), win, static_cast<size_t>(src),
            static_cast<size_t>(bytes), ncclGin_None{}, ncclGin_None{}, ncclCoopThread{});
  }
  __syncwarp();
}

// One thread: signal `id` at `peer` += `add`, on this CTA's context, so NCCL's per-(context, peer)
// ordering makes it visible only after every put this CTA posted to `peer` before it (the caller
// has ordered those posts before this thread with a named barrier).
__device__ __forceinline__ void signal(const DeviceView& view, int peer, int id, uint64_t add) {
  const ncclDevComm& comm = dev_comm(view);
  const ncclGin gin(comm, cta_context(comm));
  gin.signal(ncclTeamWorld(comm), peer, ncclGin_SignalAdd{static_cast<ncclGinSignal_t>(id), add}, ncclCoopThread{});
}

// Every thread of the group (whole warps): each warp flushes its CTA's context with the warp coop,
// which holds lane 0, the thread that posted the warp's puts. Afterwards every put the group
// posted has read its source (nothing is said about arrival at the peer).
__device__ __forceinline__ void flush(const DeviceView& view) {
  const ncclDevComm& comm = dev_comm(view);
  const ncclGin gin(comm, cta_context(comm));
  gin.flush(ncclCoopWarp{}, cuda::memory_order_acquire);
}

// This rank's signal `id`: the sum of its slot over every context (senders' CTAs pick the
// context), each read with acquire ordering.
__device__ __forceinline__ uint64_t read_signal(const DeviceView& view, int id) {
  const ncclDevComm& comm = dev_comm(view);
  uint64_t total = 0;
  for (int context = 0; context < comm.ginContextCount; ++context) {
    const ncclGin gin(comm, context);
    total += gin.readSignal(static_cast<ncclGinSignal_t>(id), 64, cuda::memory_order_acquire);
  }
  return total;
}

}  // namespace deep_ep::scaleout::gin
