#include "trtllm_executor.h"

#include <algorithm>
#include <filesystem>
#include <cstring>
#include <list>
#include <variant>

#include <cuda_runtime_api.h>

#include "npy.h"
#include "tensorrt_llm/executor/executor.h"

namespace switchyard::rt {
namespace tle = tensorrt_llm::executor;

namespace {

tle::SchedulerConfig scheduler_config(const std::string& policy) {
  if (policy == "max_utilization") {
    return tle::SchedulerConfig(tle::CapacitySchedulerPolicy::kMAX_UTILIZATION);
  }
  if (policy == "guaranteed_no_evict") {
    return tle::SchedulerConfig(tle::CapacitySchedulerPolicy::kGUARANTEED_NO_EVICT);
  }
  throw std::invalid_argument("scheduler_policy: expected guaranteed_no_evict or "
                              "max_utilization, got " + policy);
}

tle::ExecutorConfig executor_config(const TrtllmOptions& o) {
  const ResolvedEngine& e = o.engine;
  tle::KvCacheConfig kv;
  kv.setEnableBlockReuse(o.enable_block_reuse);
  kv.setFreeGpuMemoryFraction(o.free_gpu_memory_fraction);
  if (o.max_tokens_in_kv_cache) kv.setMaxTokens(*o.max_tokens_in_kv_cache);
  // The reuse tree's changes, for take_kv_events (cache-aware routing).
  if (o.enable_block_reuse && o.kv_event_buffer > 0 && e.config.world_size <= 1) {
    kv.setEventBufferMaxSize(o.kv_event_buffer);
  }
  tle::ExecutorConfig config;
  // Beam search only when asked for (max_beam_width), up to the width the engine was built
  // for: the executor sizes its buffers by it, for every request.
  if (o.max_beam_width > std::max(1, e.config.max_beam_width)) {
    throw std::invalid_argument("max_beam_width: the engine was built for at most " +
                                std::to_string(std::max(1, e.config.max_beam_width)) +
                                " beams, got " + std::to_string(o.max_beam_width));
  }
  config.setMaxBeamWidth(std::max(1, o.max_beam_width));
  config.setMaxBatchSize(e.max_batch_size);
  if (e.config.max_num_tokens > 0) config.setMaxNumTokens(e.config.max_num_tokens);
  config.setSchedulerConfig(scheduler_config(o.scheduler_policy));
  config.setKvCacheConfig(kv);
  // Only where the engine allows it (paged context FMHA into a paged KV cache).
  config.setEnableChunkedContext(e.enable_chunked_context);
  config.setIterStatsMaxIterations(1000);
  if (o.guide_vocabulary) {
    tle::GuidedDecodingConfig guided(tle::GuidedDecodingConfig::GuidedDecodingBackend::kXGRAMMAR,
                                     o.guide_vocabulary->encoded_vocab,
                                     o.guide_vocabulary->tokenizer_json,
                                     std::vector<tle::TokenIdType>(e.eos_token_ids.begin(),
                                                                   e.eos_token_ids.end()));
    config.setGuidedDecodingConfig(guided);
  }
  if (o.max_loras > 0) {
    // The PEFT cache holds the adapters' weights on the host and the GPU by task id.
    config.setPeftCacheConfig(tle::PeftCacheConfig(
        /*numHostModuleLayer=*/0, /*numDeviceModuleLayer=*/0,
        /*optimalAdapterSize=*/std::min(8, o.max_lora_rank), /*maxAdapterSize=*/o.max_lora_rank));
  }
  if (e.config.world_size > 1) {
    // Orchestrator mode: this process enqueues and awaits; TensorRT-LLM spawns one worker
    // process per rank (MPI), on devices 0..world-1 of those visible.
    std::vector<tle::SizeType32> devices(static_cast<std::size_t>(e.config.world_size));
    for (std::size_t i = 0; i < devices.size(); ++i) devices[i] = static_cast<tle::SizeType32>(i);
    tle::OrchestratorConfig orchestrator(/*isOrchestrator=*/true, o.worker_executable);
    tle::ParallelConfig parallel(tle::CommunicationType::kMPI,
                                 tle::CommunicationMode::kORCHESTRATOR, devices,
                                 /*participantIds=*/std::nullopt, orchestrator);
    config.setParallelConfig(parallel);
  }
  return config;
}

tle::SamplingConfig sampling_config(const SamplingOptions& s, std::int32_t beam_width) {
  tle::SamplingConfig c(std::max(1, beam_width));
  if (beam_width > 1) {
    // Beams ranked by log probability per generated token, as the control plane ranks
    // them; nothing else of sampling applies (to_gen_request refused it).
    c.setLengthPenalty(1.f);
    return c;
  }
  // Named setters, not the long positional constructor whose order moved between releases.
  if (s.temperature) c.setTemperature(*s.temperature);
  if (s.top_k) c.setTopK(*s.top_k);
  if (s.top_p) c.setTopP(*s.top_p);
  if (s.min_p) c.setMinP(*s.min_p);
  if (s.repetition_penalty) c.setRepetitionPenalty(*s.repetition_penalty);
  if (s.presence_penalty) c.setPresencePenalty(*s.presence_penalty);
  if (s.frequency_penalty) c.setFrequencyPenalty(*s.frequency_penalty);
  if (s.seed) c.setSeed(*s.seed);
  if (s.min_tokens > 0) c.setMinTokens(s.min_tokens);
  // TensorRT-LLM treats temperature 0 as invalid; greedy is top-k 1.
  if (s.temperature && *s.temperature == 0.f) {
    c.setTemperature(std::nullopt);
    c.setTopK(1);
  }
  return c;
}

std::list<tle::VecTokens> word_list(const std::vector<Tokens>& words) {
  std::list<tle::VecTokens> out;
  for (const auto& w : words) out.emplace_back(w.begin(), w.end());
  return out;
}

tle::GuidedDecodingParams guided_decoding(const Guide& g) {
  using Type = tle::GuidedDecodingParams::GuideType;
  switch (g.kind) {
    case Guide::Kind::kJsonObject: return tle::GuidedDecodingParams(Type::kJSON);
    case Guide::Kind::kJsonSchema: return tle::GuidedDecodingParams(Type::kJSON_SCHEMA, g.text);
    case Guide::Kind::kRegex: return tle::GuidedDecodingParams(Type::kREGEX, g.text);
    case Guide::Kind::kGrammar: break;
  }
  return tle::GuidedDecodingParams(Type::kEBNF_GRAMMAR, g.text);
}

FinishReason from_trtllm(tle::FinishReason r) {
  switch (r) {
    case tle::FinishReason::kEND_ID: return FinishReason::kEndId;
    case tle::FinishReason::kSTOP_WORDS: return FinishReason::kStopWords;
    case tle::FinishReason::kLENGTH: return FinishReason::kLength;
    case tle::FinishReason::kTIMED_OUT: return FinishReason::kTimedOut;
    case tle::FinishReason::kCANCELLED: return FinishReason::kCancelled;
    case tle::FinishReason::kNOT_FINISHED: break;
  }
  return FinishReason::kNotFinished;
}

}  // namespace

std::string trtllm_runtime_version() { return tle::version(); }

std::int32_t cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear it: no GPUs is an answer, not an error for later calls
    return 0;
  }
  return n;
}

// Each adapter's weights go to the executor once, with the first request that names its
// task id; later requests name the id only, and the executor's PEFT cache has the weights.
struct TrtllmExecutor::LoraStore {
  struct Lora {
    tle::Tensor weights;
    tle::Tensor config;
    bool sent = false;
  };
  std::mutex mu;
  std::unordered_map<AdapterId, Lora> loras;

  // The config for a request of task `id`: the weights until a request carrying them was
  // enqueued (sent()), the id alone after.
  tle::LoraConfig config_for(AdapterId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = loras.find(id);
    if (it == loras.end()) throw InvalidRequest("adapter", "no adapter with task id " + std::to_string(id));
    if (it->second.sent) return tle::LoraConfig(id);
    return tle::LoraConfig(id, it->second.weights, it->second.config);
  }
  void sent(AdapterId id) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = loras.find(id);
    if (it != loras.end()) it->second.sent = true;
  }
};

namespace {
tle::Tensor host_tensor(const NpyArray& a, tle::DataType type) {
  tle::Tensor t = tle::Tensor::cpu(type, tle::Shape{a.shape[0], a.shape[1]});
  std::memcpy(t.getData(), a.data.data(), a.data.size());
  return t;
}
}  // namespace

std::int32_t TrtllmExecutor::load_adapter(AdapterId id, const std::string& path) {
  if (options_.max_loras <= 0) throw NoLora();
  LoraFiles files = read_lora_dir(path, options_.max_lora_rank);  // throws InvalidRequest
  LoraStore::Lora lora{
      host_tensor(files.weights,
                  files.weights.dtype == "<f2" ? tle::DataType::kFP16 : tle::DataType::kFP32),
      host_tensor(files.config, tle::DataType::kINT32), false};
  std::lock_guard<std::mutex> lock(loras_->mu);
  loras_->loras.insert_or_assign(id, std::move(lora));
  return files.rank;
}

void TrtllmExecutor::unload_adapter(AdapterId id) {
  // The executor has no call to drop a task from its PEFT cache; it ages out of it.
  std::lock_guard<std::mutex> lock(loras_->mu);
  loras_->loras.erase(id);
}

TrtllmExecutor::TrtllmExecutor(TrtllmOptions options)
    : options_(std::move(options)), loras_(std::make_unique<LoraStore>()) {
  if (options_.engine_dir.empty()) {
    throw InvalidRequest("model", "the TensorRT-LLM engine directory is required");
  }
  executor_ = std::make_unique<tle::Executor>(std::filesystem::path(options_.engine_dir),
                                              tle::ModelType::kDECODER_ONLY,
                                              executor_config(options_));
}

TrtllmExecutor::~TrtllmExecutor() { shutdown(); }

RequestId TrtllmExecutor::enqueue(const GenRequest& r) {
  tle::OutputConfig output;
  output.returnLogProbs = r.return_logprobs;
  output.excludeInputFromOutput = true;
  output.returnPerfMetrics = true;  // for the queue time
  tle::Request request(tle::VecTokens(r.prompt.begin(), r.prompt.end()), r.max_tokens,
                       r.streaming, sampling_config(r.sampling, r.beam_width), output);
  if (r.end_id) {
    request.setEndId(*r.end_id);
  } else {
    // No end id: the executor never stops on EOS (ignore_eos). -1 matches no token.
    request.setEndId(-1);
  }
  if (r.pad_id) request.setPadId(*r.pad_id);
  if (!r.stop_words.empty()) request.setStopWords(word_list(r.stop_words));
  if (!r.bad_words.empty()) request.setBadWords(word_list(r.bad_words));
  if (r.allotted_time) request.setAllottedTimeMs(*r.allotted_time);
  if (r.guide) request.setGuidedDecodingParams(guided_decoding(*r.guide));
  if (r.adapter) request.setLoraConfig(loras_->config_for(*r.adapter));
  // Switchyard priorities are integers (higher first); TensorRT-LLM takes [0, 1].
  const float p = 0.5f + 0.05f * static_cast<float>(std::clamp(r.priority, -10, 10));
  request.setPriority(p);
  RequestId id;
  try {
    id = executor_->enqueueRequest(request);
  } catch (const std::exception& e) {
    if (!can_enqueue()) throw std::runtime_error(std::string("engine unavailable: ") + e.what());
    // The request was checked against the engine's limits (config.json) before this, so
    // what the executor still refuses is its fault, not the client's: INTERNAL, and the
    // control plane tries another worker once.
    throw EngineFault(std::string("the executor refused the request: ") + e.what());
  }
  if (r.adapter) loras_->sent(*r.adapter);  // enqueued with its weights (or after them)
  std::lock_guard<std::mutex> lock(prompt_mu_);
  prompt_tokens_[id] = static_cast<std::int32_t>(r.prompt.size()) - r.resumed_tokens;
  if (r.beam_width > 1) beam_searches_[id] = BeamSearch{r.max_tokens, r.end_id.has_value()};
  return id;
}

std::vector<GenResponse> TrtllmExecutor::await_responses(std::chrono::milliseconds timeout) {
  std::vector<GenResponse> out;
  if (shut_down_.load()) return out;
  std::vector<tle::Response> responses = executor_->awaitResponses(timeout);
  out.reserve(responses.size());
  for (const auto& resp : responses) {
    GenResponse g;
    g.id = resp.getRequestId();
    if (resp.hasError()) {
      g.is_final = true;
      g.error = resp.getErrorMsg();
    } else {
      const tle::Result& result = resp.getResult();
      if (!result.outputTokenIds.empty()) {
        const auto& beam = result.outputTokenIds.front();
        g.tokens.assign(beam.begin(), beam.end());
      }
      if (result.logProbs && !result.logProbs->empty()) {
        const auto& lp = result.logProbs->front();
        // Streaming results carry the log probs of the new tokens; keep those.
        auto n = std::min(lp.size(), g.tokens.size());
        g.logprobs.assign(lp.end() - static_cast<std::ptrdiff_t>(n), lp.end());
      }
      g.is_final = result.isFinal;
      if (std::optional<BeamSearch> search = beam_search_of(g.id)) {
        // Beam search (not streamed): every beam on the final response. The executor
        // gives no finish reason per beam: one shorter than max_tokens, of a request that
        // stops at the EOS, ended there. A request that timed out or was cancelled says so.
        g.tokens.clear();
        g.logprobs.clear();
        FinishReason ended = FinishReason::kNotFinished;
        for (tle::FinishReason f : result.finishReasons) {
          if (f == tle::FinishReason::kTIMED_OUT || f == tle::FinishReason::kCANCELLED) {
            ended = from_trtllm(f);
          }
        }
        for (std::size_t b = 0; g.is_final && b < result.outputTokenIds.size(); ++b) {
          const auto& ids = result.outputTokenIds[b];
          BeamResult beam;
          beam.tokens.assign(ids.begin(), ids.end());
          if (result.cumLogProbs && b < result.cumLogProbs->size()) {
            beam.cumulative_logprob = (*result.cumLogProbs)[b];
          }
          const bool short_of = static_cast<std::int32_t>(ids.size()) < search->max_tokens;
          beam.finish = search->end_id && short_of && ended == FinishReason::kNotFinished
                            ? FinishReason::kEndId
                            : FinishReason::kLength;
          g.beams.push_back(std::move(beam));
        }
        if (ended != FinishReason::kNotFinished) {
          g.finish = ended;
          g.beams.clear();  // cut short: not the search's answer
        } else if (!g.beams.empty()) {
          g.finish = g.beams.front().finish;
        }
      } else if (result.isFinal && !result.finishReasons.empty()) {
        // kEND_ID: the end id is not among outputTokenIds; the worker puts it back
        // (normalize_end_id), so stop reason and usage follow vLLM's convention.
        g.finish = from_trtllm(result.finishReasons.front());
      }
      if (result.requestPerfMetrics) {
        const auto& t = result.requestPerfMetrics->timingMetrics;
        g.queue_ms = std::chrono::duration<double, std::milli>(t.firstScheduledTime - t.arrivalTime)
                         .count();
        // Per request: the KV blocks its prompt found in the reuse tree.
        g.cached_prompt_tokens = result.requestPerfMetrics->kvCacheMetrics.numReusedBlocks *
                                 options_.engine.config.tokens_per_block;
      }
    }
    if (g.is_final) {
      std::lock_guard<std::mutex> lock(prompt_mu_);
      auto it = prompt_tokens_.find(g.id);
      if (it != prompt_tokens_.end()) {
        g.prompt_tokens = it->second;
        prompt_tokens_.erase(it);
      }
      beam_searches_.erase(g.id);  // a beam search's facts, however it ended
      // Reuse is counted in whole blocks; at least the last prompt token is computed.
      g.cached_prompt_tokens = std::max(0, std::min(g.cached_prompt_tokens, g.prompt_tokens - 1));
    }
    out.push_back(std::move(g));
  }
  return out;
}

std::optional<TrtllmExecutor::BeamSearch> TrtllmExecutor::beam_search_of(RequestId id) {
  std::lock_guard<std::mutex> lock(prompt_mu_);
  auto it = beam_searches_.find(id);
  if (it == beam_searches_.end()) return std::nullopt;
  return it->second;
}

bool TrtllmExecutor::kv_events() const {
  // In orchestrator mode the model (and its cache) lives in the ranks' processes.
  return options_.enable_block_reuse && options_.kv_event_buffer > 0 &&
         options_.engine.config.world_size <= 1;
}

KvCacheEvents TrtllmExecutor::take_kv_events(std::chrono::milliseconds timeout) {
  KvCacheEvents out;
  if (shut_down_.load() || !kv_events()) return out;
  auto manager = executor_->getKVCacheEventManager();
  if (!manager || !*manager) return out;
  std::deque<tle::KVCacheEvent> events = (*manager)->getLatestEvents(timeout);  // no lock held
  const std::int32_t block_size = options_.engine.config.tokens_per_block;
  for (const tle::KVCacheEvent& e : events) {
    // Ids run one by one; a jump means the buffer overflowed and events were dropped.
    if (last_kv_event_id_ && e.eventId != *last_kv_event_id_ + 1) out.lost = true;
    last_kv_event_id_ = e.eventId;
    KvCacheEvent k;
    if (const auto* stored = std::get_if<tle::KVCacheStoredData>(&e.data)) {
      k.kind = KvCacheEvent::Kind::kStored;
      k.parent_hash = stored->parentHash;
      k.block_size = block_size;
      for (const tle::KVCacheStoredBlockData& b : stored->blocks) {
        k.block_hashes.push_back(b.blockHash);
        for (const auto& t : b.tokens) k.tokens.push_back(t.tokenId);
        if (b.loraId) k.adapter = *b.loraId;
      }
    } else if (const auto* removed = std::get_if<tle::KVCacheRemovedData>(&e.data)) {
      k.kind = KvCacheEvent::Kind::kRemoved;
      k.block_hashes.assign(removed->blockHashes.begin(), removed->blockHashes.end());
    } else if (std::holds_alternative<tle::KVCacheCreatedData>(e.data)) {
      k.kind = KvCacheEvent::Kind::kCleared;  // a new, empty cache
    } else {
      continue;  // a block's priority or cache level changed: it is still held
    }
    out.events.push_back(std::move(k));
  }
  return out;
}

void TrtllmExecutor::cancel(RequestId id) {
  if (!shut_down_.load()) executor_->cancelRequest(id);
}

std::optional<IterationStats> TrtllmExecutor::latest_stats() {
  if (shut_down_.load()) return std::nullopt;
  // getLatestIterationStats drains what accumulated since the last call; keep the newest.
  std::deque<tle::IterationStats> fresh = executor_->getLatestIterationStats();  // no lock held
  std::lock_guard<std::mutex> lock(stats_mu_);
  if (!fresh.empty() && (!stats_ || static_cast<std::uint64_t>(fresh.back().iter) > stats_->iteration)) {
    const tle::IterationStats& s = fresh.back();
    IterationStats out;
    out.iteration = static_cast<std::uint64_t>(s.iter);
    out.active_requests = s.numActiveRequests;
    out.queued_requests = s.numQueuedRequests;
    out.iteration_ms = s.iterLatencyMS;
    if (s.kvCacheStats) {
      out.kv_blocks_used = s.kvCacheStats->usedNumBlocks;
      out.kv_blocks_free = s.kvCacheStats->freeNumBlocks;
      out.kv_blocks_max = s.kvCacheStats->maxNumBlocks;
      out.tokens_per_block = s.kvCacheStats->tokensPerBlock;
    }
    // One token per request in the generation phase per iteration (beam width 1, no
    // speculative decoding). Iterations beyond iterStatsMaxIterations between two polls
    // are not seen.
    std::uint64_t generated = stats_ ? stats_->generated_tokens_total : 0;
    for (const auto& it : fresh) {
      if (it.inflightBatchingStats) {
        generated += static_cast<std::uint64_t>(it.inflightBatchingStats->numGenRequests);
      }
    }
    out.generated_tokens_total = generated;
    stats_ = out;
  }
  return stats_;
}

bool TrtllmExecutor::can_enqueue() const {
  return !shut_down_.load() && executor_->canEnqueueRequests();
}

EngineInfo TrtllmExecutor::info() const {
  EngineInfo i;
  i.engine = "trtllm";
  i.engine_version = "TensorRT-LLM " + trtllm_runtime_version();
  i.model = options_.engine_dir;
  fill_engine_info(options_.engine, &i);
  if (options_.guide_vocabulary) {
    // TensorRT-LLM's guides: JSON, JSON schema, regex, EBNF; a choice goes as a regex.
    i.structured_output = {"choice", "grammar", "json_object", "json_schema", "regex"};
  }
  i.lora = options_.max_loras > 0;
  i.max_loras = std::max(0, options_.max_loras);
  i.max_lora_rank = i.lora ? options_.max_lora_rank : 0;
  i.max_adapters = 0;  // the PEFT cache evicts the least recently used
  i.max_beam_width = options_.max_beam_width > 1 ? options_.max_beam_width : 0;
  return i;
}

GpuMemory TrtllmExecutor::gpu_memory() const {
  // Device-wide figures of the GPUs the engine runs on (every rank's process included).
  GpuMemory m;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    cudaGetLastError();
    return m;
  }
  for (int d = 0; d < options_.engine.config.world_size; ++d) {
    std::size_t free = 0, total = 0;
    if (cudaSetDevice(d) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    m.used_bytes += total - free;
    m.total_bytes += total;
  }
  cudaSetDevice(previous);
  return m;
}

void TrtllmExecutor::shutdown() {
  if (!shut_down_.exchange(true) && executor_) executor_->shutdown();
}

}  // namespace switchyard::rt
