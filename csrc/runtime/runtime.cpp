#include "runtime/runtime.hpp"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_check.hpp"
#include "common/phase_clock.hpp"
#include "kernels/preload.hpp"
#include "kernels/runtime_kernels.hpp"

namespace deep_ep {

ScaleoutKind parse_scaleout_kind(const std::string& name) {
  if (name == "lsa") return ScaleoutKind::kLsa;
  if (name == "lsa-deferred") return ScaleoutKind::kLsaDeferred;
  if (name == "gin") return ScaleoutKind::kGin;
  throw std::invalid_argument("scale-out transport must be 'lsa', 'lsa-deferred' or 'gin', got '" + name + "'");
}

Runtime::Runtime(const RuntimeConfig& config) : config_(config) {
  if (config.num_ranks < 1 || config.num_ranks > kMaxRanks) {
    throw std::invalid_argument("num_ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                                std::to_string(config.num_ranks));
  }
  if (config.rank < 0 || config.rank >= config.num_ranks) {
    throw std::invalid_argument("rank must be in [0, " + std::to_string(config.num_ranks) + "), got " +
                                std::to_string(config.rank));
  }
  if (config.window.total_bytes % kWindowAlignBytes != 0 || config.window.total_bytes < WorkspaceLayout::bytes) {
    throw std::invalid_argument("window bytes must be a multiple of 2 MiB holding at least the workspace, got " +
                                std::to_string(config.window.total_bytes));
  }
  if (config.max_num_sms < 1) {
    throw std::invalid_argument("max_num_sms must be >= 1, got " + std::to_string(config.max_num_sms));
  }
  if (config.max_ht_num_sms < 0 || config.max_ht_num_sms > config.max_num_sms) {
    throw std::invalid_argument("max_ht_num_sms must be in [0, max_num_sms=" + std::to_string(config.max_num_sms) +
                                "] (0: max_num_sms), got " + std::to_string(config.max_ht_num_sms));
  }
  if (config.scaleout == ScaleoutKind::kGin && config.backend != BackendKind::kNccl) {
    throw std::invalid_argument("the 'gin' scale-out transport needs backend 'nccl' (GIN works on an NCCL window)");
  }
  if (config.num_scaleup_ranks < 1 || config.num_ranks % config.num_scaleup_ranks != 0) {
    throw std::invalid_argument("num_scaleup_ranks must divide num_ranks " + std::to_string(config.num_ranks) +
                                ", got " + std::to_string(config.num_scaleup_ranks));
  }
  if (!(config.gpu_timeout_secs > 0.0) || !(config.cpu_timeout_secs > 0.0)) {
    throw std::invalid_argument("timeouts must be positive, got gpu " + std::to_string(config.gpu_timeout_secs) +
                                " s, cpu " + std::to_string(config.cpu_timeout_secs) + " s");
  }
  EP_CUDA_CHECK(cudaSetDevice(config.device));
  // Into this device's context, before any rank can launch a kernel that waits for its peers
  // (kernels/preload.hpp says why).
  preload_kernels();
  // A constructor that throws runs no destructor: free what was allocated before the failure.
  try {
    create_resources();
  } catch (...) {
    destroy();
    throw;
  }
}

void Runtime::create_resources() {
  void* mapped = nullptr;
  EP_CUDA_CHECK(cudaHostAlloc(&mapped, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  error_host_ = static_cast<ErrorRecord*>(mapped);
  *error_host_ = ErrorRecord{};
  EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), mapped, 0));

  EP_CUDA_CHECK(
      cudaHostAlloc(&mapped, sizeof(int32_t) * kNumMappedCounters, cudaHostAllocMapped | cudaHostAllocPortable));
  mapped_counters_host_ = static_cast<volatile int32_t*>(mapped);
  for (int i = 0; i < kNumMappedCounters; ++i) mapped_counters_host_[i] = 0;
  EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_counters_device_), mapped, 0));
  EP_CUDA_CHECK(cudaEventCreateWithFlags(&join_event_, cudaEventDisableTiming));
  if (config_.phase_clock) {
    // Device memory, not host-mapped: a stamp is an L2 write, and the system-scope fences that
    // follow stamps in the kernels (count releases, the host-mapped ready flag) cannot wait for
    // stamps crossing PCIe (host-mapped stamps measured no slower in the notify).
    EP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&view_.phase_clock), sizeof(uint64_t) * kPhaseClockEntries));
    EP_CUDA_CHECK(cudaMemset(view_.phase_clock, 0, sizeof(uint64_t) * kPhaseClockEntries));
  }

  if (config_.backend == BackendKind::kIpc) {
    memory_ = std::make_unique<CudaIpcMemory>(config_.rank, config_.num_ranks, config_.window.total_bytes);
  } else {
    memory_ = std::make_unique<NcclWindowMemory>(config_.rank, config_.num_ranks, config_.window.total_bytes,
                                                 config_.scaleout == ScaleoutKind::kGin);
  }
}

Runtime::~Runtime() {
  try {
    destroy();
  } catch (...) {
    // Destructors must not throw; destroy() frees what it can.
  }
}

std::string Runtime::ipc_handle() const {
  auto* ipc = dynamic_cast<CudaIpcMemory*>(memory_.get());
  if (ipc == nullptr) throw std::logic_error("ipc_handle() needs the ipc backend");
  return ipc->handle();
}

void Runtime::connect_ipc(const std::vector<std::string>& handles) {
  auto* ipc = dynamic_cast<CudaIpcMemory*>(memory_.get());
  if (ipc == nullptr) throw std::logic_error("connect_ipc() needs the ipc backend");
  EP_CUDA_CHECK(cudaSetDevice(config_.device));
  ipc->connect(handles);
  finish_connect(ipc->peer_bases());
}

std::string Runtime::create_nccl_unique_id() { return NcclWindowMemory::create_unique_id(); }

NcclWindowMemory& Runtime::nccl_memory() {
  auto* nccl = dynamic_cast<NcclWindowMemory*>(memory_.get());
  if (nccl == nullptr) throw std::logic_error("the nccl bootstrap steps need the nccl backend");
  EP_CUDA_CHECK(cudaSetDevice(config_.device));
  return *nccl;
}

void Runtime::connect_nccl(const std::string& unique_id) { nccl_memory().connect(unique_id); }

void Runtime::allocate_nccl_window() { nccl_memory().allocate(); }

void Runtime::register_nccl_window() {
  NcclWindowMemory& nccl = nccl_memory();
  nccl.register_window();
  const std::vector<uint8_t*>& bases = nccl.peer_bases();
  if (config_.scaleout == ScaleoutKind::kGin) {
    // Ranks of other hosts have no peer pointer (kernels reach them through the transport only);
    // the ranks of this rank's node must all be load/store reachable.
    const int first = config_.rank / config_.num_scaleup_ranks * config_.num_scaleup_ranks;
    for (int peer = first; peer < first + config_.num_scaleup_ranks; ++peer) {
      if (bases[peer] == nullptr) {
        throw std::runtime_error("rank " + std::to_string(peer) + " is in this rank's node of " +
                                 std::to_string(config_.num_scaleup_ranks) +
                                 " ranks but not in its load/store (LSA) team of " + std::to_string(nccl.lsa_size()) +
                                 " ranks: a node must not span hosts");
      }
    }
    view_.scaleout.gin_dev_comm = nccl.gin_dev_comm();
    view_.scaleout.gin_window = nccl.gin_window();
  }
  finish_connect(bases);
}

void Runtime::finish_connect(const std::vector<uint8_t*>& peer_bases) {
  EP_CUDA_CHECK(cudaMalloc(&peer_table_device_, sizeof(uint8_t*) * config_.num_ranks));
  EP_CUDA_CHECK(
      cudaMemcpy(peer_table_device_, peer_bases.data(), sizeof(uint8_t*) * config_.num_ranks, cudaMemcpyHostToDevice));
  view_.rank = config_.rank;
  view_.num_ranks = config_.num_ranks;
  view_.num_scaleup_ranks = config_.num_scaleup_ranks;
  view_.max_num_sms = config_.max_num_sms;
  view_.max_ht_num_sms = config_.max_ht_num_sms > 0 ? config_.max_ht_num_sms : config_.max_num_sms;
  view_.ll_ranks_per_node = config_.ll_scaleout ? config_.num_scaleup_ranks : 0;
  view_.peer_bases = peer_table_device_;
  view_.error = error_device_;
  view_.timeout_ns = static_cast<uint64_t>(config_.gpu_timeout_secs * 1e9);
  view_.scaleout.kind = config_.scaleout;
  connected_ = true;
}

const DeviceView& Runtime::device_view() const {
  if (destroyed_) throw std::logic_error("the buffer was destroyed");
  if (!connected_) throw std::logic_error("the runtime is not connected to its peers yet");
  return view_;
}

uint8_t* Runtime::local_base() const {
  device_view();
  return memory_->local_base();
}

uint8_t* Runtime::peer_base(int rank) const {
  device_view();
  if (rank < 0 || rank >= config_.num_ranks) {
    throw std::invalid_argument("rank must be in [0, " + std::to_string(config_.num_ranks) + "), got " +
                                std::to_string(rank));
  }
  return memory_->peer_bases()[rank];
}

void Runtime::copy_into_window(int rank, int64_t offset, const void* src, int64_t num_bytes,
                               cudaStream_t stream) const {
  uint8_t* base = peer_base(rank);
  if (base == nullptr) {
    throw std::invalid_argument("copy into window: rank " + std::to_string(rank) +
                                " is not load/store reachable from this rank (another host, gin transport)");
  }
  const int64_t total = config_.window.total_bytes;
  if (offset < 0 || num_bytes < 0 || offset > total || num_bytes > total - offset) {
    throw std::invalid_argument("copy into window: [offset, offset + num_bytes) = [" + std::to_string(offset) + ", " +
                                std::to_string(offset + num_bytes) + ") must lie in the window [0, " +
                                std::to_string(total) + ")");
  }
  if (num_bytes == 0) return;
  EP_CUDA_CHECK(cudaMemcpyAsync(base + offset, src, static_cast<size_t>(num_bytes), cudaMemcpyDefault, stream));
}

ErrorRecord Runtime::error_record() const {
  ErrorRecord copy;
  // The device writes the fields before release-storing the status word; read status first.
  const volatile ErrorRecord* record = error_host_;
  copy.status = record->status;
  copy.invalid_status = record->invalid_status;
  copy.peer_failed_status = record->peer_failed_status;
  std::atomic_thread_fence(std::memory_order_acquire);
  copy.operation = record->operation;
  copy.phase = record->phase;
  copy.rank = record->rank;
  copy.peer = record->peer;
  copy.call_serial = record->call_serial;
  copy.expected = record->expected;
  copy.seen = record->seen;
  copy.invalid_operation = record->invalid_operation;
  copy.invalid_expert = record->invalid_expert;
  copy.num_experts = record->num_experts;
  copy.invalid_kind = record->invalid_kind;
  copy.invalid_token = record->invalid_token;
  copy.peer_failed_operation = record->peer_failed_operation;
  copy.peer_failed_rank = record->peer_failed_rank;
  copy.reserved2 = 0;
  copy.peer_progress = record->peer_progress;
  return copy;
}

void Runtime::clear_invalid_input() {
  volatile ErrorRecord* record = error_host_;
  record->invalid_operation = 0;
  record->invalid_expert = 0;
  record->num_experts = 0;
  record->invalid_kind = 0;
  record->invalid_token = 0;
  std::atomic_thread_fence(std::memory_order_release);
  record->invalid_status = 0;
}

void Runtime::clear_peer_failed() {
  volatile ErrorRecord* record = error_host_;
  record->peer_failed_operation = 0;
  record->peer_failed_rank = 0;
  std::atomic_thread_fence(std::memory_order_release);
  record->peer_failed_status = 0;
}

void Runtime::check_mapped_index(int index) const {
  if (index < 0 || index >= kNumMappedCounters) {
    throw std::invalid_argument("mapped counter index must be in [0, " + std::to_string(kNumMappedCounters) +
                                "), got " + std::to_string(index));
  }
}

void Runtime::reset_mapped_counter(int index) {
  check_mapped_index(index);
  mapped_counters_host_[index] = 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

std::vector<int32_t> Runtime::read_mapped_counters(int begin, int count) const {
  check_mapped_index(begin);
  if (count < 0 || begin + count > kNumMappedCounters) {
    throw std::invalid_argument("mapped counter range [" + std::to_string(begin) + ", " +
                                std::to_string(begin + count) + ") exceeds " + std::to_string(kNumMappedCounters));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  std::vector<int32_t> values(count);
  for (int i = 0; i < count; ++i) values[i] = mapped_counters_host_[begin + i];
  return values;
}

int32_t Runtime::wait_mapped_counter(int index) const {
  check_mapped_index(index);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(config_.cpu_timeout_secs);
  for (uint64_t spin = 0;; ++spin) {
    const int32_t value = mapped_counters_host_[index];
    if (value != 0) {
      std::atomic_thread_fence(std::memory_order_acquire);
      return value;
    }
    if ((spin & 1023) == 0) {
      // Only a complete record (status > 0): -1 means a kernel is still writing it, and the caller
      // raises from the record's fields (peer, phase), which are valid only once status is set.
      if (static_cast<volatile ErrorRecord*>(error_host_)->status > 0) return kMappedWaitDeviceError;
      if (std::chrono::steady_clock::now() > deadline) return kMappedWaitTimeout;
      if (spin > (1u << 20)) std::this_thread::yield();
    }
  }
}

std::vector<uint64_t> Runtime::read_phase_clock(bool reset) {
  if (view_.phase_clock == nullptr) {
    throw std::logic_error("this buffer has no phase clock (construct it with EP_PHASE_CLOCK=1 in the environment)");
  }
  std::vector<uint64_t> stamps(static_cast<size_t>(kPhaseClockEntries));
  // Synchronous copy after the whole device is idle: the caller's streams need not be the legacy
  // default stream's dependants.
  EP_CUDA_CHECK(cudaDeviceSynchronize());
  EP_CUDA_CHECK(cudaMemcpy(stamps.data(), view_.phase_clock, sizeof(uint64_t) * stamps.size(), cudaMemcpyDeviceToHost));
  if (reset) {
    EP_CUDA_CHECK(cudaMemset(view_.phase_clock, 0, sizeof(uint64_t) * stamps.size()));
    EP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return stamps;
}

void Runtime::launch_barrier(cudaStream_t stream) const { launch_rank_barrier(device_view(), stream); }

int64_t Runtime::count_dirty_workspace_bytes(cudaStream_t stream) const {
  device_view();
  const int64_t begin = WorkspaceLayout::zero_invariant_begin;
  const int64_t size = WorkspaceLayout::zero_invariant_end - begin;
  std::vector<uint8_t> host(static_cast<size_t>(size));
  EP_CUDA_CHECK(cudaMemcpyAsync(host.data(), memory_->local_base() + begin, static_cast<size_t>(size),
                                cudaMemcpyDeviceToHost, stream));
  EP_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t dirty = 0;
  for (uint8_t byte : host) dirty += byte != 0;
  return dirty;
}

void Runtime::destroy() {
  if (destroyed_) return;
  destroyed_ = true;
  connected_ = false;
  cudaSetDevice(config_.device);
  view_.scaleout.gin_dev_comm = nullptr;  // freed with the NCCL window's state
  view_.scaleout.gin_window = nullptr;
  if (memory_) memory_->release();
  memory_.reset();
  if (peer_table_device_ != nullptr) cudaFree(peer_table_device_);
  peer_table_device_ = nullptr;
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  error_host_ = nullptr;
  error_device_ = nullptr;
  if (mapped_counters_host_ != nullptr) cudaFreeHost(const_cast<int32_t*>(mapped_counters_host_));
  mapped_counters_host_ = nullptr;
  mapped_counters_device_ = nullptr;
  if (view_.phase_clock != nullptr) cudaFree(view_.phase_clock);
  view_.phase_clock = nullptr;
  if (join_event_ != nullptr) cudaEventDestroy(join_event_);
  join_event_ = nullptr;
}

void Runtime::join_streams(cudaStream_t waiting, cudaStream_t signalling) const {
  if (join_event_ == nullptr) throw std::logic_error("join_streams after destroy()");
  EP_CUDA_CHECK(cudaEventRecord(join_event_, signalling));
  EP_CUDA_CHECK(cudaStreamWaitEvent(waiting, join_event_, 0));
}

}  // namespace deep_ep
