#include "sim_executor.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

namespace switchyard::rt {
namespace {

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

constexpr TokenId kFirstOrdinaryToken = 4;  // ids below are left to special tokens

}  // namespace

const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::kNotFinished: return "NOT_FINISHED";
    case FinishReason::kEndId: return "END_ID";
    case FinishReason::kStopWords: return "STOP_WORDS";
    case FinishReason::kLength: return "LENGTH";
    case FinishReason::kTimedOut: return "TIMED_OUT";
    case FinishReason::kCancelled: return "CANCELLED";
  }
  return "UNKNOWN";
}

SimExecutor::SimExecutor(SimConfig config)
    : config_(std::move(config)), free_blocks_(config_.kv_blocks) {
  if (config_.vocab_size <= kFirstOrdinaryToken || config_.max_context < 2 ||
      config_.tokens_per_block < 1 || config_.kv_blocks < 1 || config_.max_batch < 1) {
    throw std::invalid_argument("SimConfig: vocab_size > 4, max_context >= 2 and positive "
                                "tokens_per_block, kv_blocks, max_batch are required");
  }
  if (!config_.virtual_clock) thread_ = std::thread([this] { loop(); });
}

SimExecutor::~SimExecutor() { shutdown(); }

std::uint64_t SimExecutor::hash_tokens(const Tokens& tokens) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (TokenId t : tokens) h = mix(h ^ static_cast<std::uint32_t>(t));
  return h;
}

TokenId SimExecutor::token_at(std::uint64_t prompt_hash, std::uint64_t seed, std::int32_t position,
                              std::int32_t vocab_size) {
  std::uint64_t h = mix(prompt_hash ^ mix(seed) ^ (static_cast<std::uint64_t>(position) << 32));
  return kFirstOrdinaryToken +
         static_cast<TokenId>(h % static_cast<std::uint64_t>(vocab_size - kFirstOrdinaryToken));
}

std::int32_t SimExecutor::blocks_for(const GenRequest& r) const {
  auto tokens = static_cast<std::int64_t>(r.prompt.size()) + r.max_tokens;
  return static_cast<std::int32_t>((tokens + config_.tokens_per_block - 1) /
                                   config_.tokens_per_block);
}

double SimExecutor::wall_ms() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started_)
      .count();
}

RequestId SimExecutor::enqueue(const GenRequest& r) {
  if (stopped_.load()) throw std::runtime_error("the executor is shut down");
  if (r.prompt.empty()) throw InvalidRequest("prompt_token_ids", "must not be empty");
  for (std::size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= config_.vocab_size) {
      throw InvalidRequest("prompt_token_ids[" + std::to_string(i) + "]",
                           "token id " + std::to_string(r.prompt[i]) +
                               " is outside the vocabulary (size " +
                               std::to_string(config_.vocab_size) + ")");
    }
  }
  if (r.max_tokens < 1) throw InvalidRequest("max_tokens", "must be at least 1");
  auto total = static_cast<std::int64_t>(r.prompt.size()) + r.max_tokens;
  if (total > config_.max_context) {
    throw InvalidRequest("max_tokens", "prompt (" + std::to_string(r.prompt.size()) +
                                           ") plus max_tokens (" + std::to_string(r.max_tokens) +
                                           ") exceed the context of " +
                                           std::to_string(config_.max_context));
  }
  if (r.sampling.min_tokens > r.max_tokens) {
    throw InvalidRequest("min_tokens", "more than max_tokens");
  }
  Live live{};
  live.req = r;
  live.prompt_hash = hash_tokens(r.prompt);
  if (r.adapter) {
    std::lock_guard<std::mutex> lock(mu_);
    auto salt = adapter_salt_.find(*r.adapter);
    if (salt == adapter_salt_.end()) {
      throw InvalidRequest("adapter", "no adapter with task id " + std::to_string(*r.adapter));
    }
    live.prompt_hash = mix(live.prompt_hash ^ salt->second);
  }
  live.blocks = blocks_for(r);
  if (live.blocks > config_.kv_blocks) {
    throw InvalidRequest("max_tokens", "needs " + std::to_string(live.blocks) +
                                           " KV blocks; the cache has " +
                                           std::to_string(config_.kv_blocks));
  }
  RequestId id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    live.id = id;
    live.enqueued_ms = clock_ms_locked();
    // Higher priority first; FIFO within a priority.
    auto pos = std::find_if(queued_.begin(), queued_.end(),
                            [&](const Live& q) { return q.req.priority < r.priority; });
    queued_.insert(pos, std::move(live));
  }
  work_cv_.notify_one();
  return id;
}

void SimExecutor::cancel(RequestId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool known = std::any_of(queued_.begin(), queued_.end(), [&](const Live& l) { return l.id == id; }) ||
                 std::any_of(active_.begin(), active_.end(), [&](const Live& l) { return l.id == id; });
    if (!known) return;
    cancelled_.insert(id);
  }
  work_cv_.notify_one();
}

std::vector<GenResponse> SimExecutor::await_responses(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(out_mu_);
  out_cv_.wait_for(lock, timeout, [&] { return !out_.empty() || stopped_.load(); });
  std::vector<GenResponse> got;
  got.swap(out_);
  return got;
}

void SimExecutor::publish(std::vector<GenResponse>&& out) {
  if (out.empty()) return;
  {
    std::lock_guard<std::mutex> lock(out_mu_);
    if (out_.empty()) {
      out_ = std::move(out);
    } else {
      out_.insert(out_.end(), std::make_move_iterator(out.begin()),
                  std::make_move_iterator(out.end()));
    }
  }
  out_cv_.notify_all();
}

std::optional<IterationStats> SimExecutor::latest_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

EngineInfo SimExecutor::info() const {
  EngineInfo i;
  i.engine = "sim";
  i.engine_version = "switchyard-sim 1";
  i.model = config_.model;
  i.max_context = config_.max_context;
  i.vocab_size = config_.vocab_size;
  i.eos_token_ids = {config_.eos_id};
  i.tokens_per_block = config_.tokens_per_block;
  // A simulator: one "GPU", no weights and no quantization to speak of.
  i.kv_blocks_total = config_.kv_blocks;
  i.max_input_len = config_.max_context - 1;  // a prompt leaves room for one token
  i.max_batch_size = config_.max_batch;
  i.lora = config_.max_loras > 0;
  i.max_loras = std::max(0, config_.max_loras);
  i.max_lora_rank = i.lora ? config_.max_lora_rank : 0;
  i.max_adapters = i.max_loras;
  i.structured_output = config_.structured_output;
  return i;
}

std::int32_t SimExecutor::load_adapter(AdapterId id, const std::string& path) {
  if (config_.max_loras <= 0) throw NoLora();
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw InvalidRequest("path", "'" + path + "' is not a directory on this worker");
  }
  std::ifstream in(fs::path(path) / "adapter_config.json");
  if (!in) throw InvalidRequest("path", "'" + path + "' has no adapter_config.json");
  std::int64_t rank = 0;
  try {
    const auto config = nlohmann::json::parse(in);
    rank = config.at("r").get<std::int64_t>();
  } catch (const std::exception& e) {
    throw InvalidRequest("path", "adapter_config.json has no integer rank 'r': " +
                                     std::string(e.what()));
  }
  if (rank < 1 || rank > config_.max_lora_rank) {
    throw InvalidRequest("path", "adapter rank " + std::to_string(rank) +
                                     " exceeds the engine's max_lora_rank " +
                                     std::to_string(config_.max_lora_rank));
  }
  std::uint64_t salt = 0xcbf29ce484222325ULL;  // FNV-1a of the path: its own stream
  for (unsigned char c : fs::weakly_canonical(path, ec).string()) salt = (salt ^ c) * 0x100000001b3ULL;
  std::lock_guard<std::mutex> lock(mu_);
  adapter_salt_[id] = mix(salt);
  return static_cast<std::int32_t>(rank);
}

void SimExecutor::unload_adapter(AdapterId id) {
  std::lock_guard<std::mutex> lock(mu_);
  adapter_salt_.erase(id);
}

void SimExecutor::shutdown() {
  bool was = stopped_.exchange(true);
  {
    // Taking the locks orders the flag before any waiter re-checks it.
    std::lock_guard<std::mutex> a(mu_);
    std::lock_guard<std::mutex> b(out_mu_);
    std::lock_guard<std::mutex> c(kv_mu_);
  }
  work_cv_.notify_all();
  out_cv_.notify_all();
  kv_cv_.notify_all();
  (void)was;
  std::lock_guard<std::mutex> join(join_mu_);  // concurrent callers all return after the join
  if (thread_.joinable()) thread_.join();
}

double SimExecutor::clock_ms_locked() const {
  return config_.virtual_clock ? virtual_us_ / 1000.0 : wall_ms();
}

double SimExecutor::now_us() const {
  std::lock_guard<std::mutex> lock(mu_);
  return virtual_us_;
}

double SimExecutor::step() {
  if (!config_.virtual_clock) {
    throw std::logic_error("step() drives a virtual-clock simulator; this one runs its own thread");
  }
  std::vector<GenResponse> out;
  double cost;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cost = run_iteration_locked(out, lock);
  }
  publish(std::move(out));
  return cost;
}

void SimExecutor::loop() {
  while (!stopped_.load()) {
    std::vector<GenResponse> out;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] {
        return stopped_.load() || !queued_.empty() || !active_.empty() || !cancelled_.empty();
      });
      if (stopped_.load()) break;
      run_iteration_locked(out, lock);
    }
    publish(std::move(out));
  }
}

void SimExecutor::finish_locked(Live& live, FinishReason reason, std::vector<GenResponse>& out,
                                std::string error) {
  GenResponse r;
  r.id = live.id;
  r.tokens = std::move(live.held);
  r.logprobs = std::move(live.held_logprobs);
  r.is_final = true;
  r.finish = reason;
  r.error = std::move(error);
  r.prompt_tokens = static_cast<std::int32_t>(live.req.prompt.size()) - live.req.resumed_tokens;
  r.cached_prompt_tokens = std::min(live.cached, r.prompt_tokens);
  r.queue_ms = live.queue_ms;
  out.push_back(std::move(r));
}

std::int32_t SimExecutor::lookup_prefix_locked(const Tokens& prompt) {
  const auto B = static_cast<std::size_t>(config_.tokens_per_block);
  std::uint64_t h = 0;
  std::int32_t cached = 0;
  for (std::size_t start = 0; start + B <= prompt.size(); start += B) {
    for (std::size_t i = start; i < start + B; ++i) h = mix(h ^ static_cast<std::uint32_t>(prompt[i]));
    auto it = lru_index_.find(h);
    if (it == lru_index_.end()) break;
    lru_.splice(lru_.begin(), lru_, it->second);
    cached += config_.tokens_per_block;
  }
  // At least one prompt token is always computed.
  return std::min<std::int32_t>(cached, static_cast<std::int32_t>(prompt.size()) - 1);
}

void SimExecutor::remember_prefix_locked(const Tokens& prompt) {
  if (config_.prefix_cache_blocks <= 0) return;
  const auto B = static_cast<std::size_t>(config_.tokens_per_block);
  std::uint64_t h = 0;
  std::optional<std::uint64_t> parent;  // the block before this one, if any
  KvCacheEvent stored;                  // the new blocks, a run at a time
  KvCacheEvent removed;
  removed.kind = KvCacheEvent::Kind::kRemoved;
  auto flush = [&] {
    if (!stored.block_hashes.empty()) kv_event_locked(std::move(stored));
    stored = KvCacheEvent{};
  };
  std::vector<std::uint64_t> blocks;  // the prompt's, in order
  for (std::size_t start = 0; start + B <= prompt.size(); start += B) {
    for (std::size_t i = start; i < start + B; ++i) h = mix(h ^ static_cast<std::uint32_t>(prompt[i]));
    blocks.push_back(h);
    auto it = lru_index_.find(h);
    if (it != lru_index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      flush();
      parent = h;
      continue;
    }
    if (stored.block_hashes.empty()) {
      stored.parent_hash = parent;
      stored.block_size = config_.tokens_per_block;
    }
    stored.block_hashes.push_back(h);
    stored.tokens.insert(stored.tokens.end(), prompt.begin() + static_cast<std::ptrdiff_t>(start),
                         prompt.begin() + static_cast<std::ptrdiff_t>(start + B));
    lru_.push_front(h);
    lru_index_[h] = lru_.begin();
    if (static_cast<std::int32_t>(lru_.size()) > config_.prefix_cache_blocks) {
      removed.block_hashes.push_back(lru_.back());
      lru_index_.erase(lru_.back());
      lru_.pop_back();
    }
    parent = h;
  }
  flush();
  // The prompt's first block most recently used, its last least: a prefix is evicted from
  // its end, as vLLM frees a request's blocks last first and TensorRT-LLM evicts leaves.
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {
    auto it = lru_index_.find(*b);
    if (it != lru_index_.end()) lru_.splice(lru_.begin(), lru_, it->second);
  }
  // After the stores, so that a block stored and evicted by the same prompt ends removed.
  if (!removed.block_hashes.empty()) kv_event_locked(std::move(removed));
}

void SimExecutor::kv_event_locked(KvCacheEvent event) {
  constexpr std::size_t kMaxEvents = 65536;  // beyond: the oldest go, and the loss is said
  {
    std::lock_guard<std::mutex> lock(kv_mu_);
    if (kv_events_.size() >= kMaxEvents) {
      kv_events_.pop_front();
      kv_lost_ = true;
    }
    kv_events_.push_back(std::move(event));
  }
  kv_cv_.notify_all();
}

KvCacheEvents SimExecutor::take_kv_events(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(kv_mu_);
  kv_cv_.wait_for(lock, timeout, [&] { return !kv_events_.empty() || kv_lost_ || stopped_.load(); });
  KvCacheEvents out;
  out.events.assign(std::make_move_iterator(kv_events_.begin()),
                    std::make_move_iterator(kv_events_.end()));
  kv_events_.clear();
  out.lost = kv_lost_;
  kv_lost_ = false;
  return out;
}

double SimExecutor::run_iteration_locked(std::vector<GenResponse>& out,
                                         std::unique_lock<std::mutex>& lock) {
  const bool real_time = !config_.virtual_clock;
  const double now = clock_ms_locked();

  // 1. Cancellations and expired requests leave first.
  auto expired = [&](const Live& l) {
    return l.req.allotted_time &&
           now - l.enqueued_ms > static_cast<double>(l.req.allotted_time->count());
  };
  auto drop = [&](auto& container, bool holds_blocks) {
    for (auto it = container.begin(); it != container.end();) {
      FinishReason why = FinishReason::kNotFinished;
      if (cancelled_.count(it->id)) why = FinishReason::kCancelled;
      else if (expired(*it)) why = FinishReason::kTimedOut;
      if (why == FinishReason::kNotFinished) { ++it; continue; }
      if (holds_blocks) free_blocks_ += it->blocks;
      finish_locked(*it, why, out);
      it = container.erase(it);
    }
  };
  drop(queued_, false);
  drop(active_, true);
  cancelled_.clear();

  // 2. Admit what fits, in queue order (head-of-line waits for blocks).
  double prefill_tokens = 0;
  while (!queued_.empty() && static_cast<std::int32_t>(active_.size()) < config_.max_batch &&
         queued_.front().blocks <= free_blocks_) {
    Live live = std::move(queued_.front());
    queued_.pop_front();
    free_blocks_ -= live.blocks;
    live.cached = lookup_prefix_locked(live.req.prompt);
    remember_prefix_locked(live.req.prompt);
    prefill_tokens += static_cast<double>(live.req.prompt.size()) - live.cached;
    live.queue_ms = now - live.enqueued_ms;
    active_.push_back(std::move(live));
  }

  double cost_us = 0;
  if (!active_.empty()) {
    cost_us = prefill_tokens * config_.prefill_us_per_token + config_.decode_step_us +
              config_.decode_us_per_request * static_cast<double>(active_.size());
    if (real_time && config_.time_scale > 0) {
      // Only this thread touches active_; enqueue and cancel only add to the queue and the
      // cancel set, so the lock need not be held while the step "runs".
      lock.unlock();
      std::this_thread::sleep_for(
          std::chrono::duration<double, std::micro>(cost_us * config_.time_scale));
      lock.lock();
    }
  }

  // 3. Every running request gains one token.
  for (auto it = active_.begin(); it != active_.end();) {
    Live& l = *it;
    const auto& rq = l.req;
    std::uint64_t seed = rq.sampling.seed.value_or(0);
    TokenId tok = token_at(l.prompt_hash, seed, l.generated, config_.vocab_size);
    FinishReason why = FinishReason::kNotFinished;
    if (rq.end_id && config_.eos_every > 0 && l.generated >= rq.sampling.min_tokens &&
        static_cast<std::uint64_t>(tok) % static_cast<std::uint64_t>(config_.eos_every) == 0) {
      tok = *rq.end_id;
      why = FinishReason::kEndId;
    }
    ++l.generated;
    ++generated_total_;
    l.tail.push_back(tok);
    if (l.tail.size() > 16) l.tail.erase(l.tail.begin());
    if (why == FinishReason::kNotFinished && l.generated > rq.sampling.min_tokens) {
      for (const auto& word : rq.stop_words) {
        if (!word.empty() && word.size() <= l.tail.size() &&
            std::equal(word.rbegin(), word.rend(), l.tail.rbegin())) {
          why = FinishReason::kStopWords;
          break;
        }
      }
    }
    const auto used = static_cast<std::int64_t>(rq.prompt.size()) + l.generated;
    if (why == FinishReason::kNotFinished &&
        (l.generated >= rq.max_tokens || used >= config_.max_context)) {
      why = FinishReason::kLength;
    }
    const float logprob =
        -static_cast<float>(mix(static_cast<std::uint64_t>(tok) ^ l.prompt_hash) % 1000) / 100.0f;
    if (!rq.streaming && why == FinishReason::kNotFinished) {
      l.held.push_back(tok);
      if (rq.return_logprobs) l.held_logprobs.push_back(logprob);
      ++it;
      continue;
    }
    GenResponse r;
    r.id = l.id;
    r.tokens = std::move(l.held);
    r.logprobs = std::move(l.held_logprobs);
    // TensorRT-LLM's convention: the end id that ended the generation is not an output token.
    if (why != FinishReason::kEndId || config_.end_id_in_output) {
      r.tokens.push_back(tok);
      if (rq.return_logprobs) r.logprobs.push_back(logprob);
    }
    if (why != FinishReason::kNotFinished) {
      r.is_final = true;
      r.finish = why;
      r.prompt_tokens = static_cast<std::int32_t>(rq.prompt.size()) - rq.resumed_tokens;
      r.cached_prompt_tokens = std::min(l.cached, r.prompt_tokens);
      r.queue_ms = l.queue_ms;
      free_blocks_ += l.blocks;
      out.push_back(std::move(r));
      it = active_.erase(it);
    } else {
      out.push_back(std::move(r));
      ++it;
    }
  }

  virtual_us_ += cost_us;
  IterationStats s;
  s.iteration = ++iteration_;
  s.active_requests = static_cast<std::int32_t>(active_.size());
  s.queued_requests = static_cast<std::int32_t>(queued_.size());
  s.kv_blocks_free = free_blocks_;
  s.kv_blocks_max = config_.kv_blocks;
  s.kv_blocks_used = config_.kv_blocks - free_blocks_;
  s.tokens_per_block = config_.tokens_per_block;
  s.iteration_ms = cost_us / 1000.0;
  s.generated_tokens_total = generated_total_;
  stats_ = s;
  return cost_us;
}

}  // namespace switchyard::rt
