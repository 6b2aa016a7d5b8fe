#include "common/error_record.hpp"

namespace deep_ep {

const char* operation_name(int32_t operation) {
  switch (static_cast<Operation>(operation)) {
    case Operation::kNone:
      return "none";
    case Operation::kBarrier:
      return "barrier";
    case Operation::kHtNotify:
      return "dispatch count exchange";
    case Operation::kHtDispatch:
      return "dispatch";
    case Operation::kHtCombine:
      return "combine";
    case Operation::kLlDispatch:
      return "low-latency dispatch";
    case Operation::kLlCombine:
      return "low-latency combine";
  }
  return "unknown operation";
}

const char* phase_name(int32_t phase) {
  switch (static_cast<Phase>(phase)) {
    case Phase::kNone:
      return "none";
    case Phase::kBarrierArrive:
      return "barrier arrival";
    case Phase::kCountsArrive:
      return "token counts arrival";
    case Phase::kDataArrive:
      return "data arrival";
    case Phase::kGridSync:
      return "grid synchronisation";
    case Phase::kScaleoutCountsArrive:
      return "scale-out counts arrival";
    case Phase::kScaleoutRowsArrive:
      return "scale-out row arrival (forwarder)";
    case Phase::kPartialsArrive:
      return "node partial arrival";
    case Phase::kScaleoutBarrier:
      return "scale-out barrier";
    case Phase::kSendBaseArrive:
      return "zero-copy row offset arrival";
  }
  return "unknown phase";
}

}  // namespace deep_ep
