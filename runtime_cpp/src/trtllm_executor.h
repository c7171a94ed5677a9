// TrtllmExecutor: the Executor interface over TensorRT-LLM's engine-based C++ executor
// (tensorrt_llm::executor::Executor, releases 1.0 to 1.2). Built only when CMake is given
// TensorRT-LLM (-DTRTLLM_ROOT=...); checked here with -fsyntax-only against the real
// headers (see runtime_cpp/README.md).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine_config.h"
#include "executor.h"

namespace tensorrt_llm::executor {
class Executor;
}

namespace switchyard::rt {

struct TrtllmOptions {
  std::string engine_dir;                 // a built TensorRT-LLM engine directory
  // The engine's config.json, checked (engine_config.h): limits, vocabulary, EOS ids, block
  // size, parallel sizes and whether chunked context is allowed come from here.
  ResolvedEngine engine;
  float free_gpu_memory_fraction = 0.9f;  // of what is free after the weights load
  std::optional<std::int32_t> max_tokens_in_kv_cache;
  bool enable_block_reuse = true;         // prefix caching
  // KV-cache events kept for take_kv_events (KvCacheConfig's event buffer; 0: none).
  std::size_t kv_event_buffer = 16384;
  std::string scheduler_policy = "guaranteed_no_evict";  // or max_utilization
  // Orchestrator mode (world size > 1): the executorWorker binary TensorRT-LLM spawns for
  // every rank; "" leaves TensorRT-LLM's default.
  std::string worker_executable;
  // Structured output (GuidedDecodingConfig, xgrammar): the tokenizer's vocabulary, from
  // --tokenizer; without it the worker declares no structured output and refuses a constraint.
  std::optional<GuideVocabulary> guide_vocabulary;
  // LoRA (PeftCacheConfig): adapters in one batch and their largest rank; 0: no LoRA.
  std::int32_t max_loras = 0;
  std::int32_t max_lora_rank = 64;
  // Beam search up to this many beams (1: none); at most the engine's built max_beam_width.
  std::int32_t max_beam_width = 1;
};

// TensorRT-LLM's version as the library reports it ("1.0.0").
std::string trtllm_runtime_version();
// GPUs the CUDA runtime sees (after CUDA_VISIBLE_DEVICES); 0 when CUDA reports an error.
std::int32_t cuda_device_count();

class TrtllmExecutor final : public Executor {
 public:
  explicit TrtllmExecutor(TrtllmOptions options);
  ~TrtllmExecutor() override;

  RequestId enqueue(const GenRequest& request) override;
  std::vector<GenResponse> await_responses(std::chrono::milliseconds timeout) override;
  void cancel(RequestId id) override;
  std::optional<IterationStats> latest_stats() override;
  bool can_enqueue() const override;
  EngineInfo info() const override;
  GpuMemory gpu_memory() const override;
  void shutdown() override;
  std::int32_t load_adapter(AdapterId id, const std::string& path) override;
  void unload_adapter(AdapterId id) override;
  bool kv_events() const override;
  KvCacheEvents take_kv_events(std::chrono::milliseconds timeout) override;

 private:
  struct LoraStore;  // the adapters' weights, sent with the first request that uses each
  struct BeamSearch {
    std::int32_t max_tokens = 0;
    bool end_id = false;  // the request stops at the EOS (not ignore_eos)
  };
  // A beam search's facts (forgotten with its final response); nullopt for others.
  std::optional<BeamSearch> beam_search_of(RequestId id);
  const TrtllmOptions options_;
  std::unique_ptr<tensorrt_llm::executor::Executor> executor_;
  std::mutex stats_mu_;
  std::optional<IterationStats> stats_;
  std::mutex prompt_mu_;
  std::unordered_map<RequestId, std::int32_t> prompt_tokens_;  // until the final
  std::unordered_map<RequestId, BeamSearch> beam_searches_;  // until the final
  std::optional<std::uint64_t> last_kv_event_id_;  // take_kv_events' only (one caller)
  std::atomic<bool> shut_down_{false};
  std::unique_ptr<LoraStore> loras_;
};

}  // namespace switchyard::rt
