// Runtime: owns one buffer's symmetric window, the device peer table, the host-mapped error record
// and counters, and launches the cross-rank barrier. Communication kernels get a DeviceView from it.
//
// Construction is in steps because the exchange of handles needs the torch process group, which
// lives in Python, and because every rank must learn whether every other rank's step succeeded
// before it enters the next collective step (a rank that failed alone would leave the others
// blocked in a collective):
//   Runtime(config)  (host-mapped records; ipc: the window allocation)
//   ipc:  ipc_handle() -> connect_ipc(all handles)
//   nccl: connect_nccl(unique id from rank 0)  [collective]  -> allocate_nccl_window()  [local]
//         -> register_nccl_window()  [collective]
// With the gin scale-out transport (RuntimeConfig::scaleout, nccl only) register_nccl_window() also
// sets up NCCL GIN and fills DeviceView::scaleout; ranks on other hosts then have no peer base
// (peer_base() returns nullptr): kernels reach them only through kernels/scaleout.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/device_view.hpp"
#include "common/error_record.hpp"
#include "common/geometry.hpp"
#include "memory/symmetric_memory.hpp"

namespace deep_ep {

struct RuntimeConfig {
  int rank = 0;
  int num_ranks = 1;
  int num_scaleup_ranks = 1;  // ranks per (possibly emulated) node
  int device = 0;
  WindowLayout window;
  double gpu_timeout_secs = 100.0;
  double cpu_timeout_secs = 300.0;
  BackendKind backend = BackendKind::kIpc;
  // CTAs a communication kernel of this rank may launch: every CTA of a grid must be resident at
  // once (grid syncs, cross-rank spins), so ranks sharing a GPU split its SMs. Launchers check it.
  int max_num_sms = 1;
  // CTAs an HT dispatch / combine kernel may launch (their grids synchronise as a whole): all of
  // max_num_sms with one rank per GPU, less when ranks share a GPU so that the sharing ranks'
  // spinning HT kernels leave room for compute (deep_ep.topology.ht_sm_cap). 0: max_num_sms.
  int max_ht_num_sms = 0;
  // How hybrid mode reaches the ranks of other nodes (gin: they are on other hosts).
  ScaleoutKind scaleout = ScaleoutKind::kLsa;
  // LL reaches the ranks of other nodes (groups of num_scaleup_ranks) through `scaleout` too.
  bool ll_scaleout = false;
  // Kernels stamp their phases into device memory the runtime owns (profiling; common/phase_clock.hpp).
  bool phase_clock = false;
};

// "lsa" | "lsa-deferred" | "gin"; std::invalid_argument otherwise.
ScaleoutKind parse_scaleout_kind(const std::string& name);

class Runtime {
 public:
  explicit Runtime(const RuntimeConfig& config);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // ipc bootstrap: this rank's serialized handle, then every rank's (index = rank).
  std::string ipc_handle() const;
  void connect_ipc(const std::vector<std::string>& handles);
  // nccl bootstrap: rank 0 creates the id, every rank connects with it (collective), allocates
  // its window (local) and registers it (collective).
  static std::string create_nccl_unique_id();
  void connect_nccl(const std::string& unique_id);
  void allocate_nccl_window();
  void register_nccl_window();

  bool connected() const { return connected_; }
  const RuntimeConfig& config() const { return config_; }
  const WindowLayout& window() const { return config_.window; }
  // Requires connected(); throws std::logic_error otherwise (or after destroy()).
  const DeviceView& device_view() const;
  // The start of every host call. Sets the serial of the call whose kernels launch next (every
  // launch's view carries it, and a timeout records it, so the report names the call: Python's call
  // log maps it to a name) and says whether a timeout was recorded; one binding call instead of
  // two on the per-call host path.
  bool begin_call(int32_t serial) {
    view_.call_serial = serial;
    return error_record().status != 0;
  }
  // `waiting` waits for the work queued on `signalling` so far: an event record and a stream
  // wait, with an event the runtime owns (reused: a wait takes the record it finds when it is
  // queued, so one event serves every join). Capturable like torch's Stream.wait_stream, without
  // creating and destroying a torch Event per call on the host path.
  void join_streams(cudaStream_t waiting, cudaStream_t signalling) const;

  // Window base of this rank / of `rank`, as device addresses valid in this process (nullptr for a
  // rank outside this rank's load/store team: another host, gin transport).
  uint8_t* local_base() const;
  uint8_t* peer_base(int rank) const;
  // Stream-ordered copy of `num_bytes` from device memory `src` into `rank`'s window at `offset`
  // (copy engine, cudaMemcpyDefault). A peer's window need not be a valid torch tensor in this
  // process (torch rejects NCCL-mapped peer memory), so tests and tools write through this.
  void copy_into_window(int rank, int64_t offset, const void* src, int64_t num_bytes, cudaStream_t stream) const;

  // Copy of the host-mapped error record (status 0 = no timeout, invalid_status 0 = no bad input).
  ErrorRecord error_record() const;
  // Forget a reported invalid input / peer input failure (timeouts are never cleared: the buffer is
  // out of step).
  void clear_invalid_input();
  void clear_peer_failed();

  // Host-mapped counters: the device pointer is for kernels; the host reads through these calls.
  int32_t* mapped_counters_device() const { return mapped_counters_device_; }
  void reset_mapped_counter(int index);
  std::vector<int32_t> read_mapped_counters(int begin, int count) const;
  // Spins (host) until counter `index` != 0 and returns it; kMappedWaitTimeout after
  // cpu_timeout_secs; kMappedWaitDeviceError as soon as a device timeout is recorded.
  static constexpr int32_t kMappedWaitTimeout = -1;
  static constexpr int32_t kMappedWaitDeviceError = -2;
  int32_t wait_mapped_counter(int index) const;

  // The phase clock's stamps ([kernel][CTA][stamp] ns, 0 = not reached; common/phase_clock.hpp),
  // copied after a device synchronisation; `reset` zeroes them for the next call. Throws
  // std::logic_error when the runtime was built without a phase clock.
  std::vector<uint64_t> read_phase_clock(bool reset);

  // One-CTA cross-rank barrier kernel on `stream`.
  void launch_barrier(cudaStream_t stream) const;
  // Debug check of the workspace invariant: synchronises `stream` and returns the number of
  // non-zero bytes in the zero-invariant range.
  int64_t count_dirty_workspace_bytes(cudaStream_t stream) const;

  // Quiesce-free teardown (the caller has synchronised and passed a barrier). Idempotent.
  void destroy();

 private:
  void create_resources();
  NcclWindowMemory& nccl_memory();
  void finish_connect(const std::vector<uint8_t*>& peer_bases);
  void check_mapped_index(int index) const;

  RuntimeConfig config_;
  std::unique_ptr<SymmetricMemory> memory_;
  bool connected_ = false;
  bool destroyed_ = false;
  DeviceView view_;
  uint8_t** peer_table_device_ = nullptr;
  ErrorRecord* error_host_ = nullptr;
  ErrorRecord* error_device_ = nullptr;
  volatile int32_t* mapped_counters_host_ = nullptr;
  int32_t* mapped_counters_device_ = nullptr;
  cudaEvent_t join_event_ = nullptr;
};

}  // namespace deep_ep
