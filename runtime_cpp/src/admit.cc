#include "admit.h"

#include <algorithm>
#include <exception>

#include "wire.h"

namespace switchyard::rt {

namespace {
constexpr double kDeadlineMarginMs = 20.0;
}  // namespace

double engine_deadline_ms(double left_ms) {
  if (left_ms < 0) return -1;
  return std::max(0.0, left_ms - std::min(kDeadlineMarginMs, left_ms / 10));
}

std::optional<Refusal> admit(const ::switchyard::worker::v1::GenerateRequest& req,
                             const EngineInfo& info, double deadline_ms, Executor& executor,
                             AdapterRegistry& adapters, const Claim& claim, Admitted* out) {
  GenRequest gen;
  FieldError bad;
  if (!to_gen_request(req, info, deadline_ms, &gen, &bad)) {
    return Refusal{bad.unsupported ? grpc::StatusCode::FAILED_PRECONDITION
                                   : grpc::StatusCode::INVALID_ARGUMENT,
                   bad};
  }
  if (claim.take) {
    if (auto refused = claim.take()) return refused;
  }
  auto refuse = [&](grpc::StatusCode code, FieldError why) {
    if (gen.adapter) adapters.unacquire(req.adapter());
    if (claim.give_back) claim.give_back();
    return Refusal{code, std::move(why)};
  };
  const std::string& adapter = req.adapter();
  if (!adapter.empty()) {
    AdapterRefusal why;
    gen.adapter = adapters.acquire(adapter, &why);
    if (!gen.adapter) return refuse(adapter_code(why), {why.field, why.message});
  }
  try {
    out->id = executor.enqueue(gen);
  } catch (const InvalidRequest& e) {
    return refuse(grpc::StatusCode::INVALID_ARGUMENT, {e.field(), e.message()});
  } catch (const EngineFault& e) {
    return refuse(grpc::StatusCode::INTERNAL, {"", std::string("engine: ") + e.what()});
  } catch (const std::exception& e) {
    return refuse(grpc::StatusCode::UNAVAILABLE, {"", std::string("engine: ") + e.what()});
  }
  if (gen.adapter) adapters.bind(out->id, adapter);  // before the caller hands it a sink
  out->end_id = gen.end_id;
  return std::nullopt;
}

grpc::Status refusal_status(const Refusal& refusal) {
  if (refusal.why.field.empty()) return grpc::Status(refusal.code, refusal.why.message);
  return field_status(refusal.code, refusal.why.field, refusal.why.message);
}

}  // namespace switchyard::rt
