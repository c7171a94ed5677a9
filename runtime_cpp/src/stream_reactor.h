// GenerateStream: many requests over one bidirectional stream.
//
// Starts and cancels arrive on the read side, each attempt keyed by the attempt id the
// caller assigns (unique on the stream; request_id is for logs only). A message's cancels
// are handled before its starts, and a start the same message cancels is never started.
// The dispatcher thread hands each engine response to the session, which folds it into
// the pending StreamResponse (an attempt's consecutive chunks merge into one event), its
// tokens first held back to the attempt's own stream_interval (ChunkCadence, translate.h).
// Exactly one write is in flight; everything that arrives meanwhile goes out in the next
// message, so one message carries the news of every request that has some. Cancelling
// the call cancels every request on it; so does a message that is not a valid
// StreamRequest, which ends that call INVALID_ARGUMENT.
#pragma once

#include <atomic>
#include <memory>

#include "adapters.h"
#include "dispatcher.h"
#include "executor.h"
#include "switchyard/worker/v1/worker.grpc.pb.h"

namespace switchyard::rt {

namespace wv1 = ::switchyard::worker::v1;

// Creates the raw reactor for one GenerateStream call (StreamRequest in, StreamResponse
// out). `live` counts the requests in flight on all sessions (a drain waits for them);
// `draining` refuses new starts.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* start_generate_stream(
    grpc::CallbackServerContext* context, Executor& executor, Dispatcher& dispatcher,
    AdapterRegistry& adapters, const EngineInfo& info, std::atomic<int>& live,
    const std::atomic<bool>& draining);

}  // namespace switchyard::rt
