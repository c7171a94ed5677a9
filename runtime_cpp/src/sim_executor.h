// SimExecutor: a deterministic SIMULATOR of an LLM engine, for tests, load tests and
// fleet simulations. It is not TensorRT-LLM and never claims to be.
//
// - Output: token i of a request is a pure function of (prompt, seed, i), so tests can
//   predict it (see SimExecutor::token_at).
// - Latency: each iteration costs prefill_us_per_token for every uncached prompt token it
//   admits, plus decode_step_us + decode_us_per_request * running requests.
// - Memory: a KV-block budget. A request reserves the blocks for its prompt plus
//   max_tokens when admitted; requests that do not fit wait in the queue.
// - Prefix cache: full prompt blocks are remembered (LRU), and a later prompt that starts
//   with them skips their prefill; reported as cached prompt tokens.
// - EOS: end_id_in_output picks vLLM's convention or TensorRT-LLM's (end id left out).
// - Clock: real time (a thread runs iterations and sleeps their modeled cost, scaled by
//   time_scale), or virtual (no thread; the caller drives step()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "executor.h"

namespace switchyard::rt {

struct SimConfig {
  std::string model = "sim";
  std::int32_t vocab_size = 32000;
  std::int32_t max_context = 4096;
  TokenId eos_id = 2;
  std::int32_t tokens_per_block = 32;
  std::int32_t kv_blocks = 4096;
  std::int32_t max_batch = 256;
  double prefill_us_per_token = 20.0;
  double decode_step_us = 2000.0;
  double decode_us_per_request = 20.0;
  // When > 0 and a request has an end id, a position whose hash is divisible by
  // eos_every (after min_tokens) emits the end id instead.
  std::int32_t eos_every = 0;
  // vLLM's convention (true): a generation that ends on the end id has it as its last output
  // token. TensorRT-LLM's samplers leave it out (false); the worker puts it back
  // (normalize_end_id in translate.h), so both conventions look the same on the wire.
  bool end_id_in_output = true;
  double time_scale = 1.0;   // real-time mode: sleep modeled cost * time_scale
  bool virtual_clock = false;
  std::int32_t prefix_cache_blocks = 8192;
  // LoRA, as an engine with it would take it (0 adapters: no LoRA). An adapter is a PEFT
  // directory (its adapter_config.json's rank `r` is checked); a request naming one
  // gets a token stream of its own.
  std::int32_t max_loras = 8;
  std::int32_t max_lora_rank = 64;
  // Constraint kinds it declares and takes (json_schema, regex, ...), for tests of what
  // the control plane and worker do around guided decoding. A simulator cannot follow a
  // constraint: its tokens are the same hashes with one as without.
  std::vector<std::string> structured_output;
};

class SimExecutor final : public Executor {
 public:
  explicit SimExecutor(SimConfig config);
  ~SimExecutor() override;

  RequestId enqueue(const GenRequest& request) override;
  std::vector<GenResponse> await_responses(std::chrono::milliseconds timeout) override;
  void cancel(RequestId id) override;
  std::optional<IterationStats> latest_stats() override;
  bool can_enqueue() const override { return !stopped_.load(); }
  EngineInfo info() const override;
  void shutdown() override;
  std::int32_t load_adapter(AdapterId id, const std::string& path) override;
  bool kv_events() const override { return config_.prefix_cache_blocks > 0; }
  KvCacheEvents take_kv_events(std::chrono::milliseconds timeout) override;
  void unload_adapter(AdapterId id) override;

  // Virtual-clock mode only: run one iteration now; returns its modeled cost in
  // microseconds (0 when there was nothing to do). Throws std::logic_error in real time.
  double step();
  // Virtual time in microseconds (sum of the costs of all iterations so far).
  double now_us() const;
  const SimConfig& config() const { return config_; }

  // The token the simulator emits at `position` of a generation (before EOS handling).
  static TokenId token_at(std::uint64_t prompt_hash, std::uint64_t seed, std::int32_t position,
                          std::int32_t vocab_size);
  static std::uint64_t hash_tokens(const Tokens& tokens);

 private:
  struct Live {
    RequestId id;
    GenRequest req;
    std::uint64_t prompt_hash;
    std::int32_t generated = 0;
    std::int32_t blocks = 0;
    std::int32_t cached = 0;
    double enqueued_ms = 0;  // on the executor's clock (virtual or wall)
    double queue_ms = 0;
    Tokens tail;  // last tokens, for stop-word matching
    Tokens held;  // non-streaming requests: everything goes out with the final
    std::vector<float> held_logprobs;
  };

  double run_iteration_locked(std::vector<GenResponse>& out, std::unique_lock<std::mutex>& lock);
  void finish_locked(Live& live, FinishReason reason, std::vector<GenResponse>& out,
                     std::string error = {});
  std::int32_t lookup_prefix_locked(const Tokens& prompt);
  void remember_prefix_locked(const Tokens& prompt);
  std::int32_t blocks_for(const GenRequest& r) const;
  void publish(std::vector<GenResponse>&& out);
  void loop();
  double wall_ms() const;
  double clock_ms_locked() const;

  const SimConfig config_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<Live> queued_;
  std::vector<Live> active_;
  std::unordered_set<RequestId> cancelled_;
  std::unordered_map<AdapterId, std::uint64_t> adapter_salt_;  // changes the token stream
  std::int32_t free_blocks_;
  RequestId next_id_ = 1;
  double virtual_us_ = 0;
  std::optional<IterationStats> stats_;
  std::uint64_t iteration_ = 0;
  std::uint64_t generated_total_ = 0;
  // LRU of prompt-block hashes.
  std::list<std::uint64_t> lru_;
  std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> lru_index_;

  std::mutex out_mu_;
  std::condition_variable out_cv_;
  std::vector<GenResponse> out_;

  // KV-cache events of the prefix cache, until take_kv_events (taken under mu_, then kv_mu_).
  void kv_event_locked(KvCacheEvent event);
  std::mutex kv_mu_;
  std::condition_variable kv_cv_;
  std::deque<KvCacheEvent> kv_events_;
  bool kv_lost_ = false;

  std::atomic<bool> stopped_{false};
  std::mutex join_mu_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::thread thread_;  // last: started after everything else is built
};

}  // namespace switchyard::rt
