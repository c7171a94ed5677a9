// The engine seam of the C++ worker: an interface with TensorRT-LLM executor semantics
// (enqueue, await responses with a timeout, cancel, iteration stats, shutdown).
//
// Implementations: TrtllmExecutor (tensorrt_llm::executor::Executor, built only with
// TensorRT-LLM) and SimExecutor (a deterministic simulator for tests and scale runs).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace switchyard::rt {

using TokenId = std::int32_t;
using RequestId = std::uint64_t;
using Tokens = std::vector<TokenId>;
using AdapterId = std::uint64_t;  // a LoRA adapter's task id in the engine

struct SamplingOptions {
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<std::int32_t> top_k;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
  std::optional<float> presence_penalty;
  std::optional<float> frequency_penalty;
  std::optional<std::uint64_t> seed;
  std::int32_t min_tokens = 0;
};

// Structured output, as TensorRT-LLM's GuidedDecodingParams takes it (a choice among
// strings arrives as a regex that matches exactly those strings).
struct Guide {
  enum class Kind : std::uint8_t { kJsonObject, kJsonSchema, kRegex, kGrammar };
  Kind kind = Kind::kJsonObject;
  std::string text;  // the schema, regex or EBNF grammar; "" for kJsonObject
};

// One generation, in token ids. Mirrors what tensorrt_llm::executor::Request takes.
struct GenRequest {
  Tokens prompt;
  std::int32_t max_tokens = 16;
  SamplingOptions sampling;
  std::vector<Tokens> stop_words;  // each a token sequence; single ids are stop tokens
  std::vector<Tokens> bad_words;
  std::optional<TokenId> end_id;   // unset: the EOS is ignored
  std::optional<TokenId> pad_id;
  bool streaming = true;
  bool return_logprobs = false;
  std::optional<std::chrono::milliseconds> allotted_time;  // then kTimedOut
  std::int32_t priority = 0;
  std::optional<Guide> guide;
  std::optional<AdapterId> adapter;  // a LoRA adapter loaded with load_adapter()
  // Beam search with this many beams when > 1 (engines whose info says max_beam_width);
  // then the request is not streamed and its final response carries `beams`.
  std::int32_t beam_width = 1;
  // A resumed request: the last `resumed_tokens` of `prompt` are output that another
  // worker generated before it failed. Usage counts them neither as prompt nor as new.
  std::int32_t resumed_tokens = 0;
};

enum class FinishReason : std::uint8_t {
  kNotFinished = 0,
  kEndId,
  kStopWords,
  kLength,
  kTimedOut,
  kCancelled,
};

// One beam of a finished beam search.
struct BeamResult {
  Tokens tokens;
  float cumulative_logprob = 0;
  FinishReason finish = FinishReason::kLength;  // kEndId or kLength
};

const char* to_string(FinishReason r);

// One engine response: new tokens of one request (streaming), possibly final.
struct GenResponse {
  RequestId id = 0;
  Tokens tokens;
  std::vector<float> logprobs;  // one per token when asked
  bool is_final = false;
  FinishReason finish = FinishReason::kNotFinished;
  std::string error;            // non-empty: the request failed (is_final is true)
  std::int32_t prompt_tokens = 0;
  std::int32_t cached_prompt_tokens = 0;
  double queue_ms = 0;          // enqueue until first scheduled, when known
  std::vector<BeamResult> beams;  // beam search: every beam, on the final response
};

struct IterationStats {
  std::uint64_t iteration = 0;
  std::int32_t active_requests = 0;
  std::int32_t queued_requests = 0;
  std::int32_t kv_blocks_used = 0;
  std::int32_t kv_blocks_free = 0;
  std::int32_t kv_blocks_max = 0;
  std::int32_t tokens_per_block = 0;
  double iteration_ms = 0;
  std::uint64_t generated_tokens_total = 0;
};

struct EngineInfo {
  std::string engine;          // "trtllm", "sim"
  std::string engine_version;
  std::string model;
  std::int32_t max_context = 0;
  std::int32_t vocab_size = 0;
  std::vector<TokenId> eos_token_ids;
  std::int32_t tokens_per_block = 0;
  // What the engine is and holds (GetInfo). 0 or "" where the engine does not say.
  std::int32_t tensor_parallel_size = 1;
  std::int32_t pipeline_parallel_size = 1;
  std::string quantization;     // "" for none
  std::string weight_dtype;
  std::string kv_cache_dtype;
  std::int32_t kv_blocks_total = 0;  // 0: known only once the engine has run (latest_stats)
  std::int32_t max_input_len = 0;    // longest prompt; max_context where not separate
  std::int32_t max_batch_size = 0;
  std::int32_t max_num_tokens = 0;
  // The OutputConstraint kinds the engine takes (GetInfo capabilities); none by default.
  std::vector<std::string> structured_output;
  // LoRA: adapters in one batch, their largest rank, and how many it holds at once (0 and
  // false: no LoRA).
  bool lora = false;
  std::int32_t max_loras = 0;
  std::int32_t max_lora_rank = 0;
  std::int32_t max_adapters = 0;
  std::int32_t max_beam_width = 0;  // beam search up to this many beams (0 or 1: none)
};

// One change to the engine's cache of prompt blocks (a KV-cache event).
struct KvCacheEvent {
  enum class Kind : std::uint8_t { kStored, kRemoved, kCleared };
  Kind kind = Kind::kStored;
  // kStored: each stored block's hash, in order (each follows the one before); kRemoved:
  // the blocks gone.
  std::vector<std::uint64_t> block_hashes;
  std::optional<std::uint64_t> parent_hash;  // kStored: the block before the first
  Tokens tokens;                             // kStored: every block's tokens
  std::int32_t block_size = 0;
  std::optional<AdapterId> adapter;          // kStored: the LoRA adapter they were for
};

// What take_kv_events found: the events in order, and whether some were lost before them
// (a subscriber must then forget what it knew of this engine's cache).
struct KvCacheEvents {
  std::vector<KvCacheEvent> events;
  bool lost = false;
};

// Memory on the GPUs an executor uses, at the time of the call; zeros without GPUs.
struct GpuMemory {
  std::uint64_t used_bytes = 0;
  std::uint64_t total_bytes = 0;
};

// A request the engine refuses; the message names the field.
class InvalidRequest : public std::invalid_argument {
 public:
  InvalidRequest(std::string field, const std::string& message)
      : std::invalid_argument(field + ": " + message), field_(std::move(field)),
        message_(message) {}
  const std::string& field() const { return field_; }
  const std::string& message() const { return message_; }  // what() without the field

 private:
  std::string field_;
  std::string message_;
};

// The engine failed a request that was valid (INTERNAL: the control plane tries another
// worker once). Any other exception from enqueue means the engine is unavailable.
class EngineFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The engine has no LoRA (load_adapter on an executor started without it).
class NoLora : public std::logic_error {
 public:
  NoLora() : std::logic_error("this engine was started without LoRA") {}
};

class Executor {
 public:
  virtual ~Executor() = default;
  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues a request; throws InvalidRequest when it cannot be served.
  virtual RequestId enqueue(const GenRequest& request) = 0;
  // Waits up to `timeout` for responses of any request; empty on timeout or shutdown.
  virtual std::vector<GenResponse> await_responses(std::chrono::milliseconds timeout) = 0;
  // Cancels a request; its final response carries kCancelled. Unknown ids are ignored.
  virtual void cancel(RequestId id) = 0;
  // The most recent iteration's statistics, if any iteration ran.
  virtual std::optional<IterationStats> latest_stats() = 0;
  virtual bool can_enqueue() const = 0;
  virtual EngineInfo info() const = 0;
  virtual GpuMemory gpu_memory() const { return {}; }
  // Reads the LoRA adapter at `path` as task `id` and returns its rank; later requests
  // name it by `id`. Throws InvalidRequest("path", ...) for one it cannot use, NoLora
  // where the engine has none.
  virtual std::int32_t load_adapter(AdapterId /*id*/, const std::string& /*path*/) {
    throw NoLora();
  }
  // Forgets task `id` (no request uses it any more).
  virtual void unload_adapter(AdapterId /*id*/) {}
  // Whether the engine reports its KV-cache events (take_kv_events).
  virtual bool kv_events() const { return false; }
  // The events since the last call, waiting up to `timeout` while there are none.
  virtual KvCacheEvents take_kv_events(std::chrono::milliseconds /*timeout*/) { return {}; }
  // Stops the engine; pending requests are dropped. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace switchyard::rt
