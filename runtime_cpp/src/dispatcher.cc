#include "dispatcher.h"

namespace switchyard::rt {

namespace {
// A parked response whose stream never registered (its RPC died first) is dropped after this.
constexpr auto kParkedTtl = std::chrono::seconds(10);
}  // namespace

Dispatcher::Dispatcher(Executor& executor, std::chrono::milliseconds poll)
    : executor_(executor), poll_(poll), thread_([this] { loop(); }) {}

Dispatcher::~Dispatcher() { stop(); }

void Dispatcher::stop() {
  stop_.store(true);
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

bool Dispatcher::reserve(const std::string& name) {
  if (name.empty()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return names_.emplace(name, kReserved).second;
}

void Dispatcher::release(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = names_.find(name);
  if (it != names_.end() && it->second == kReserved) names_.erase(it);
}

bool Dispatcher::add(RequestId id, const std::string& name, std::shared_ptr<StreamSink> sink) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!name.empty()) {
    auto taken = names_.find(name);
    if (taken != names_.end() && taken->second != kReserved) return false;
    if (taken != names_.end()) names_.erase(taken);  // our own reservation
  }
  bool finished = false;
  auto parked = parked_.find(id);
  if (parked != parked_.end()) {
    for (auto& r : parked->second.responses) {
      finished = finished || r.is_final;
      redeliver_.emplace_back(sink, std::move(r));
    }
    parked_.erase(parked);
  }
  if (finished) return true;  // everything it will ever get is already queued for it
  if (!name.empty()) names_.emplace(name, id);
  streams_[id] = Entry{std::move(sink), name};
  return true;
}

void Dispatcher::remove(RequestId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(id);
    if (it != streams_.end()) {
      if (!it->second.name.empty()) names_.erase(it->second.name);
      streams_.erase(it);
      dropped_.insert(id);  // its final has not come yet
    }
  }
  if (on_over_) on_over_(id);  // no lock held
}

std::optional<RequestId> Dispatcher::find(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = names_.find(name);
  if (it == names_.end() || it->second == kReserved) return std::nullopt;
  return it->second;
}

std::size_t Dispatcher::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_.size();
}

void Dispatcher::loop() {
  std::vector<std::pair<std::shared_ptr<StreamSink>, GenResponse>> work;
  while (!stop_.load()) {
    std::vector<GenResponse> responses;
    try {
      responses = executor_.await_responses(poll_);  // no lock held
    } catch (const std::exception&) {
      // A failing engine must not take this thread down; streams hear of it through
      // their own calls, or time out.
      std::this_thread::sleep_for(poll_);
      continue;
    }
    work.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Parked responses first: they are older than anything in this batch.
      work.swap(redeliver_);
      const auto now = std::chrono::steady_clock::now();
      for (auto& r : responses) {
        auto it = streams_.find(r.id);
        if (it == streams_.end() && dropped_.count(r.id)) {
          if (r.is_final) dropped_.erase(r.id);
          continue;
        }
        if (it == streams_.end()) {
          auto& p = parked_[r.id];
          if (p.responses.empty()) p.since = now;
          p.responses.push_back(std::move(r));
          continue;
        }
        std::shared_ptr<StreamSink> sink = it->second.sink;
        if (r.is_final) {
          if (!it->second.name.empty()) names_.erase(it->second.name);
          streams_.erase(it);
        }
        work.emplace_back(std::move(sink), std::move(r));
      }
      for (auto it = parked_.begin(); it != parked_.end();) {
        it = now - it->second.since > kParkedTtl ? parked_.erase(it) : std::next(it);
      }
    }
    for (auto& [sink, r] : work) {
      const RequestId id = r.id;
      const bool over = r.is_final;
      try {
        sink->on_response(std::move(r));  // no lock held
      } catch (const std::exception&) {
        // A stream that cannot take its response is lost; the others go on.
      }
      if (over && on_over_) on_over_(id);
    }
  }
}

}  // namespace switchyard::rt
