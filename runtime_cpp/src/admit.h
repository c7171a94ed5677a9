// Admitting one worker request to the executor, the same for Generate and for a start on
// GenerateStream: the deadline less its margin, the translation, the LoRA adapter, the
// enqueue, and what each failure means for the caller. Nothing here holds a lock.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include <grpcpp/support/status.h>

#include "adapters.h"
#include "executor.h"
#include "translate.h"
#include "switchyard/worker/v1/worker.pb.h"

namespace switchyard::rt {

// Why a request was not admitted: a status code, and the field to blame (empty: none).
struct Refusal {
  grpc::StatusCode code;
  FieldError why;
};

// The request's engine-side time limit in ms from what its caller has left (`left_ms`;
// negative: no deadline, -1): a margin (20 ms, at most a tenth) is kept back so that the
// TIME_LIMIT final reaches the caller before its own deadline fires.
double engine_deadline_ms(double left_ms);

// What the caller does between the translation and the engine: claim the request's name
// (a duplicate is refused there and costs the engine nothing), and give it back if the
// request is refused after that.
struct Claim {
  std::function<std::optional<Refusal>()> take;
  std::function<void()> give_back;
};

struct Admitted {
  RequestId id = 0;               // the executor's
  std::optional<TokenId> end_id;  // the request's, for normalize_end_id
};

// Translates `req`, runs `claim.take`, takes the request's adapter and enqueues it (its
// adapter bound to it). On a refusal, what was taken is given back: the adapter here,
// the claim through `claim.give_back`.
std::optional<Refusal> admit(const ::switchyard::worker::v1::GenerateRequest& req,
                             const EngineInfo& info, double deadline_ms, Executor& executor,
                             AdapterRegistry& adapters, const Claim& claim, Admitted* out);

// A refusal as the status of a call: with a BadRequest on its field, when it names one.
grpc::Status refusal_status(const Refusal& refusal);

}  // namespace switchyard::rt
