#include "adapters.h"

#include <regex>

namespace switchyard::rt {

namespace {
const std::regex kName("[A-Za-z0-9._-]{1,64}");

AdapterRefusal refusal(AdapterRefusal::Kind kind, std::string field, std::string message) {
  return AdapterRefusal{kind, std::move(field), std::move(message)};
}
}  // namespace

grpc::StatusCode adapter_code(const AdapterRefusal& why) {
  switch (why.kind) {
    case AdapterRefusal::Kind::kInvalid: return grpc::StatusCode::INVALID_ARGUMENT;
    case AdapterRefusal::Kind::kNotFound: return grpc::StatusCode::NOT_FOUND;
    case AdapterRefusal::Kind::kNoLora: return grpc::StatusCode::FAILED_PRECONDITION;
    case AdapterRefusal::Kind::kExists: return grpc::StatusCode::ALREADY_EXISTS;
    case AdapterRefusal::Kind::kFull: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case AdapterRefusal::Kind::kEngine: return grpc::StatusCode::INVALID_ARGUMENT;
    case AdapterRefusal::Kind::kNone: break;
  }
  return grpc::StatusCode::OK;
}

AdapterRegistry::AdapterRegistry(Executor& executor) : executor_(executor), info_(executor.info()) {}

std::optional<AdapterInfo> AdapterRegistry::load(const std::string& name, const std::string& path,
                                                 AdapterRefusal* why) {
  using K = AdapterRefusal::Kind;
  if (!info_.lora) {
    *why = refusal(K::kNoLora, "adapter", "this engine was started without LoRA");
    return std::nullopt;
  }
  if (!std::regex_match(name, kName)) {
    *why = refusal(K::kInvalid, "name", "must be 1 to 64 of A-Z a-z 0-9 . _ -");
    return std::nullopt;
  }
  AdapterId task = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(name);
    if (it != held_.end()) {
      if (it->second.path == path && !it->second.unloading) {
        return AdapterInfo{name, path, it->second.rank, it->second.in_flight};
      }
      *why = refusal(K::kExists, "name",
                     "adapter " + name + " is already " +
                         (it->second.unloading ? "being unloaded" : "loaded from " + it->second.path));
      return std::nullopt;
    }
    if (loading_.count(name) != 0) {
      *why = refusal(K::kExists, "name", "adapter " + name + " is being loaded");
      return std::nullopt;
    }
    if (info_.max_adapters > 0 &&
        static_cast<std::int32_t>(held_.size() + loading_.size()) >= info_.max_adapters) {
      *why = refusal(K::kFull, "name",
                     "this engine holds at most " + std::to_string(info_.max_adapters) +
                         " adapters; unload one first");
      return std::nullopt;
    }
    loading_.insert(name);
    task = next_task_++;
  }
  std::int32_t rank = 0;
  try {
    rank = executor_.load_adapter(task, path);  // no lock held
  } catch (const InvalidRequest& e) {
    *why = refusal(K::kInvalid, e.field(), e.message());
  } catch (const NoLora& e) {
    *why = refusal(K::kNoLora, "adapter", e.what());
  } catch (const std::exception& e) {
    *why = refusal(K::kEngine, "path", std::string("the engine could not load it: ") + e.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  loading_.erase(name);
  if (why->kind != K::kNone) return std::nullopt;
  Held& h = held_[name];
  h.task = task;
  h.path = path;
  h.rank = rank;
  return AdapterInfo{name, path, rank, 0};
}

std::optional<AdapterId> AdapterRegistry::acquire(const std::string& name, AdapterRefusal* why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!info_.lora) {
    *why = refusal(AdapterRefusal::Kind::kNoLora, "adapter",
                   "this engine was started without LoRA; it holds no adapters");
    return std::nullopt;
  }
  auto it = held_.find(name);
  if (it == held_.end() || it->second.unloading) {
    std::string known;
    for (const auto& [n, h] : held_) {
      if (!h.unloading) known += (known.empty() ? "" : ", ") + n;
    }
    *why = refusal(AdapterRefusal::Kind::kNotFound, "adapter",
                   "adapter " + name + (it == held_.end() ? " is not loaded" : " is being unloaded") +
                       " (loaded: " + (known.empty() ? "none" : known) + ")");
    return std::nullopt;
  }
  ++it->second.in_flight;
  return it->second.task;
}

void AdapterRegistry::unacquire(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(name);
  if (it != held_.end() && it->second.in_flight > 0 && --it->second.in_flight == 0) {
    idle_cv_.notify_all();
  }
}

void AdapterRegistry::bind(RequestId id, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(name);
  if (it == held_.end()) return;
  bound_[id] = name;
  it->second.requests.insert(id);
}

void AdapterRegistry::release(RequestId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto b = bound_.find(id);
  if (b == bound_.end()) return;
  auto it = held_.find(b->second);
  bound_.erase(b);
  if (it == held_.end()) return;
  it->second.requests.erase(id);
  if (it->second.in_flight > 0 && --it->second.in_flight == 0) idle_cv_.notify_all();
}

std::optional<std::pair<std::uint32_t, std::uint32_t>> AdapterRegistry::unload(
    const std::string& name, std::chrono::milliseconds grace) {
  std::vector<RequestId> left;
  std::uint32_t at_start = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = held_.find(name);
    if (it == held_.end() || it->second.unloading) return std::nullopt;
    it->second.unloading = true;
    at_start = static_cast<std::uint32_t>(it->second.in_flight);
    idle_cv_.wait_for(lock, grace, [&] { return held_[name].in_flight == 0; });
    left.assign(held_[name].requests.begin(), held_[name].requests.end());
  }
  for (RequestId id : left) {
    try {
      executor_.cancel(id);  // no lock held
    } catch (const std::exception&) {
    }
  }
  AdapterId task = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Cancelled requests end promptly; do not hold the engine's adapter under them.
    idle_cv_.wait_for(lock, std::chrono::seconds(10), [&] { return held_[name].in_flight == 0; });
    task = held_[name].task;
    for (RequestId id : held_[name].requests) bound_.erase(id);
    held_.erase(name);
  }
  try {
    executor_.unload_adapter(task);
  } catch (const std::exception&) {
  }
  const auto cancelled = static_cast<std::uint32_t>(left.size());
  return std::make_pair(at_start - std::min(at_start, cancelled), cancelled);
}

std::vector<AdapterInfo> AdapterRegistry::list() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<AdapterInfo> out;
  for (const auto& [name, h] : held_) {
    if (!h.unloading) out.push_back(AdapterInfo{name, h.path, h.rank, h.in_flight});
  }
  return out;
}

std::optional<std::string> AdapterRegistry::name_of(AdapterId task) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, h] : held_) {
    if (h.task == task) return name;
  }
  return std::nullopt;
}

}  // namespace switchyard::rt
