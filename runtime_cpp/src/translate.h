// Wire <-> engine: switchyard.worker.v1 messages to executor requests, and executor
// responses to wire messages. Pure functions, unit-tested without a server.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "executor.h"
#include "switchyard/worker/v1/worker.pb.h"

namespace switchyard::rt {

namespace wv1 = ::switchyard::worker::v1;
namespace v1 = ::switchyard::v1;

struct FieldError {
  std::string field;
  std::string message;
  // Not a bad value but something this engine cannot do (FAILED_PRECONDITION).
  bool unsupported = false;
};

// Builds the executor request; on bad input returns false and fills `error` naming the
// field. `deadline_ms` (< 0: none) becomes the allotted time.
bool to_gen_request(const wv1::GenerateRequest& in, const EngineInfo& info, double deadline_ms,
                    GenRequest* out, FieldError* error);

// A regular expression that matches exactly one of `choices` (each taken literally): how a
// choice constraint reaches an engine whose guides have no choice of their own.
std::string choice_regex(const google::protobuf::RepeatedPtrField<std::string>& choices);

// One EOS convention on the wire, vLLM's: a generation that ends on its end id streams the
// end id as its last token, and it counts as a completion token. TensorRT-LLM's samplers
// leave the end id out of the output; this puts it back on the final response of a request
// that ended with kEndId, unless the engine already included it (`last_streamed` is the last
// token the request's earlier responses carried). `end_id` is the request's.
void normalize_end_id(GenResponse* r, std::optional<TokenId> end_id,
                      std::optional<TokenId> last_streamed);

// Appends tokens (and logprobs) of one engine response to a chunk being coalesced.
void append_chunk(const GenResponse& r, wv1::Chunk* chunk);

// One request's chunks at the cadence of GenerateRequest.stream_interval, whatever the
// engine: the tokens of the first response with any go out at once; after that tokens
// (and their logprobs) are held until at least `interval` are unsent, then all go out as
// one chunk; the final response (an error too) releases whatever is held, so it goes out
// before the Final. 0 or 1: every response's tokens as they come. Not thread-safe: used
// under its stream's lock; a cancelled request's held tokens are simply dropped with it.
class ChunkCadence {
 public:
  explicit ChunkCadence(std::uint32_t interval = 0) : interval_(interval) {}
  // Takes one engine response's tokens (after normalize_end_id); true when tokens are due
  // now, to be moved out with take().
  bool add(const GenResponse& r);
  // Appends the tokens held to `chunk` (the chunk being coalesced) and forgets them.
  void take(wv1::Chunk* chunk);

 private:
  std::uint32_t interval_;
  wv1::Chunk held_;
  bool sent_any_ = false;
};

// Fills the final message of a request from its last engine response; `last_token` is the
// last token the stream carried, `eos_ids` the model's end-of-sequence ids.
void fill_final(const GenResponse& r, std::int32_t completion_tokens,
                std::optional<TokenId> last_token, const std::vector<TokenId>& eos_ids,
                wv1::Final* out);

::switchyard::v1::FinishReason to_wire(FinishReason reason);

}  // namespace switchyard::rt
