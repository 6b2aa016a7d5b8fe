// The scale-out transport of hybrid mode: how a rank moves bytes to, and signals, a rank of another
// node. Window offsets only (NCCL GIN's put is window + offset based too), so the kernels are the
// same whatever reaches the peer:
//
//   put(peer, dst, src, bytes)      warp-collective, asynchronous: the source stays untouched until flush
//   signal(group, peer, id, add)    group-collective: signal `id` at `peer` += add, after (covering)
//                                   every put this group issued to `peer` before the call
//   signal_each(group, n, item)     group-collective: n such signals at once (one barrier)
//   read_signal(id)                 this rank's signal `id`, acquire
//   flush(group)                    every source this group put may be reused (not: data arrived)
//
// Implementations (DeviceView::scaleout.kind):
//   lsa           stores through the peer table; the signal is a system-scope release add on the
//                 peer's signal cell (virtual nodes on one host).
//   lsa-deferred  tests: a put only records (peer, dst, src, bytes); the bytes are copied when a
//                 signal to that peer is sent, or at flush. The emulation is never stronger than
//                 RDMA ordering, so a signal that does not cover its data, or a staging row reused
//                 before its flush, shows up as wrong data.
//   gin           NCCL's GPU-initiated networking (scaleout_gin.cuh), for ranks on other hosts.
//
// Signals are monotonic, never reset: a receiver waits for "its shadow + what it expects", then
// advances its shadow (a workspace cell only it touches). Every wait goes through wait_until.
#pragma once

#include <cstdint>

#include "common/device_view.hpp"
#include "common/geometry.hpp"
#include "kernels/ptx.cuh"
#include "kernels/scaleout_gin.cuh"
#include "kernels/timeout.cuh"

namespace deep_ep::scaleout {

// Warps of one CTA that synchronise through a named barrier (id 0 is __syncthreads').
struct WarpGroup {
  int barrier_id = 1;
  int num_threads = 32;
  int thread = 0;  // index of this thread in the group
  __device__ __forceinline__ void sync() const {
    asm volatile("bar.sync %0, %1;" ::"r"(barrier_id), "r"(num_threads) : "memory");
  }
};

// lsa-deferred: the puts a group issued and has not yet covered, in shared memory.
struct PendingPut {
  int32_t peer;
  int32_t done;
  int64_t dst;
  int64_t src;
  int64_t bytes;
};
constexpr int kMaxPendingPuts = 96;
struct DeferredQueue {
  PendingPut puts[kMaxPendingPuts];
  int count;
};

__device__ __forceinline__ uint64_t* signal_cell(const DeviceView& view, int rank, int id) {
  return view.peer<uint64_t>(rank, WorkspaceLayout::scaleout_signals_offset + int64_t{id} * 8);
}

__device__ __forceinline__ uint64_t* shadow_cell(const DeviceView& view, int id) {
  return view.local<uint64_t>(WorkspaceLayout::scaleout_shadows_offset + int64_t{id} * 8);
}

// One thread: signal `id` at `peer` += `add`, covering no put: a release of memory this rank is
// done with (its accesses are ordered before the call by the caller: stream order, a fence or an
// acq_rel counter). lsa / lsa-deferred: a system-scope release add; gin: a signal on this CTA's context.
__device__ __forceinline__ void signal_only(const DeviceView& view, int peer, int id, uint64_t add) {
  if (view.scaleout.kind == ScaleoutKind::kGin) {
    gin::signal(view, peer, id, add);
  } else {
    ptx::red_add_release_sys(signal_cell(view, peer, id), add);
  }
}

// This rank's signal `id` (acquire), outside a Transport.
__device__ __forceinline__ uint64_t read_own_signal(const DeviceView& view, int id) {
  if (view.scaleout.kind == ScaleoutKind::kGin) return gin::read_signal(view, id);
  return ptx::ld_acquire_sys_u64(signal_cell(view, view.rank, id));
}

// `bytes` of 16-byte vectors from this rank's window to `peer`'s, by one warp. The source may have
// been written by this launch (plain loads, not the non-coherent path).
__device__ __forceinline__ void warp_copy_window(const DeviceView& view, int peer, int64_t dst, int64_t src,
                                                 int64_t bytes) {
  const int4* from = view.local<int4>(src);
  int4* to = view.peer<int4>(peer, dst);
  for (int64_t index = threadIdx.x % 32; index < bytes / 16; index += 32) to[index] = from[index];
}

// One signal of Transport::signal_each; peer < 0: none.
struct SignalItem {
  int peer = -1;
  int id = 0;
  uint64_t add = 0;
};

class Transport {
 public:
  // `queue` is the group's shared-memory queue (lsa-deferred; may be null for the other kinds).
  __device__ Transport(const DeviceView& view, DeferredQueue* queue) : view_(view), queue_(queue) {}

  // Call once per group before its first put, then group.sync().
  __device__ void init(const WarpGroup& group) {
    if (queue_ != nullptr && group.thread == 0) queue_->count = 0;
  }

  // Warp-collective. `bytes` and both offsets are multiples of 16.
  __device__ void put(int peer, int64_t dst, int64_t src, int64_t bytes) {
    switch (view_.scaleout.kind) {
      case ScaleoutKind::kLsa:
        __syncwarp();
        warp_copy_window(view_, peer, dst, src, bytes);
        break;
      case ScaleoutKind::kLsaDeferred: {
        __syncwarp();
        int index = 0;
        if (threadIdx.x % 32 == 0) {
          index = atomicAdd(&queue_->count, 1);
          if (index < kMaxPendingPuts) queue_->puts[index] = PendingPut{peer, 0, dst, src, bytes};
        }
        index = __shfl_sync(0xffffffffu, index, 0);
        // A full queue copies at once: a legal RDMA outcome too (data may land early, never late).
        if (index >= kMaxPendingPuts) warp_copy_window(view_, peer, dst, src, bytes);
        break;
      }
      case ScaleoutKind::kGin:
        gin::put(view_, peer, dst, src, bytes);
        break;
    }
  }

  __device__ void signal(const WarpGroup& group, int peer, int id, uint64_t add) {
    group.sync();  // every put of the group to `peer` was issued (lsa: stored) before the signal
    if (view_.scaleout.kind == ScaleoutKind::kLsaDeferred && queue_ != nullptr) {
      copy_pending(group, peer);
      group.sync();
    }
    if (group.thread == 0) {
      if (view_.scaleout.kind == ScaleoutKind::kGin) {
        gin::signal(view_, peer, id, add);
      } else {
        release_signal(peer, id, add);
      }
    }
    group.sync();  // the queue may be appended to again
  }

  // Several signals at once, each covering every put this group issued before the call (as
  // signal() does for its peer): item(i) for i < count gives {peer, id, add}. One barrier for all:
  // with lsa / lsa-deferred, thread i sends item i (each thread's fence is cumulative over the
  // group's stores, ordered before it by the barrier), so the system fences overlap instead of
  // running one after another; with gin thread 0 posts them in order. Group-collective.
  template <typename Item>
  __device__ void signal_each(const WarpGroup& group, int count, const Item& item) {
    group.sync();
    if (view_.scaleout.kind == ScaleoutKind::kLsaDeferred && queue_ != nullptr) {
      copy_pending(group, -1);  // early for the peers signalled later: legal, never late
      group.sync();
    }
    if (view_.scaleout.kind == ScaleoutKind::kGin) {
      if (group.thread == 0) {
        for (int i = 0; i < count; ++i) {
          const SignalItem signal = item(i);
          if (signal.peer >= 0) gin::signal(view_, signal.peer, signal.id, signal.add);
        }
      }
    } else {
      for (int i = group.thread; i < count; i += group.num_threads) {
        const SignalItem signal = item(i);
        if (signal.peer >= 0) release_signal(signal.peer, signal.id, signal.add);
      }
    }
    group.sync();  // the queue may be appended to again
  }

  __device__ void flush(const WarpGroup& group) {
    group.sync();
    if (view_.scaleout.kind == ScaleoutKind::kLsaDeferred && queue_ != nullptr) {
      copy_pending(group, -1);
      group.sync();
    } else if (view_.scaleout.kind == ScaleoutKind::kGin) {
      gin::flush(view_);
      group.sync();
    }
  }

  __device__ uint64_t read_signal(int id) const { return read_own_signal(view_, id); }

 private:
  // lsa / lsa-deferred, one thread: a cumulative release of the group's stores, which the caller's
  // group barrier ordered before this thread, then the signal add.
  __device__ void release_signal(int peer, int id, uint64_t add) const {
    ptx::fence_acq_rel_sys();
    ptx::red_add_release_sys(signal_cell(view_, peer, id), add);
  }

  // lsa-deferred: copy the pending puts to `peer` (-1: to every peer), then forget them.
  __device__ void copy_pending(const WarpGroup& group, int peer) {
    const int count = min(queue_->count, kMaxPendingPuts);
    for (int entry = 0; entry < count; ++entry) {
      const PendingPut put = queue_->puts[entry];
      if (put.done != 0 || (peer >= 0 && put.peer != peer)) continue;
      const int4* from = view_.local<int4>(put.src);
      int4* to = view_.peer<int4>(put.peer, put.dst);
      for (int64_t index = group.thread; index < put.bytes / 16; index += group.num_threads) to[index] = from[index];
    }
    group.sync();
    if (group.thread == 0) {
      bool all_done = true;
      for (int entry = 0; entry < count; ++entry) {
        if (peer < 0 || queue_->puts[entry].peer == peer) queue_->puts[entry].done = 1;
        all_done = all_done && queue_->puts[entry].done != 0;
      }
      if (all_done) queue_->count = 0;
    }
  }

  const DeviceView& view_;
  DeferredQueue* queue_;
};

// Waits until this rank's signal `id` reaches `shadow` (its shadow cell's value, read by the
// caller) + `expected`; `*landed` gets the last value seen minus `shadow`, >= expected on success.
// A caller consuming a stream in order need not wait again for what `*landed` already covers.
// `peer` (the signalling rank) and `phase` name the wait in a timeout report.
__device__ __forceinline__ bool wait_signal_landed(const DeviceView& view, const Transport& transport,
                                                   Operation operation, Phase phase, int peer, int id, uint64_t shadow,
                                                   uint64_t expected, uint64_t* landed) {
  const uint64_t target = shadow + expected;
  return wait_until(view, operation, phase, peer, static_cast<int64_t>(target), [&](int64_t& seen) {
    const uint64_t value = transport.read_signal(id);
    seen = static_cast<int64_t>(value);
    *landed = value >= shadow ? value - shadow : 0;  // never below the shadow; guarded all the same
    return value >= target;
  });
}

// Waits until this rank's signal `id` reaches its shadow + `expected` (no shadow update).
__device__ __forceinline__ bool wait_signal(const DeviceView& view, const Transport& transport, Operation operation,
                                            Phase phase, int peer, int id, uint64_t expected) {
  uint64_t landed = 0;
  return wait_signal_landed(view, transport, operation, phase, peer, id, *shadow_cell(view, id), expected, &landed);
}

// After every wait on `id` of this operation: the next operation expects from here.
__device__ __forceinline__ void advance_shadow(const DeviceView& view, int id, uint64_t consumed) {
  *shadow_cell(view, id) += consumed;
}

}  // namespace deep_ep::scaleout
