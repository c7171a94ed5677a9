#include "kv_events_stream.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <string>

namespace switchyard::rt {

namespace {

constexpr std::size_t kQueueBatches = 4096;  // per subscriber, before it counts as behind
constexpr auto kPumpWait = std::chrono::milliseconds(50);

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

wv1::KvEventBatch to_batch(const KvCacheEvents& events) {
  wv1::KvEventBatch batch;
  batch.set_reset(events.lost);
  for (const KvCacheEvent& e : events.events) {
    auto* out = batch.add_events();
    switch (e.kind) {
      case KvCacheEvent::Kind::kStored: {
        auto* s = out->mutable_stored();
        for (auto h : e.block_hashes) s->add_block_hashes(h);
        if (e.parent_hash) s->set_parent_block_hash(*e.parent_hash);
        for (auto t : e.tokens) s->add_token_ids(static_cast<std::uint32_t>(t));
        s->set_block_size(static_cast<std::uint32_t>(e.block_size));
        // The adapter's task id; the service's names for adapters are not the engine's.
        if (e.adapter) s->set_adapter("task-" + std::to_string(*e.adapter));
        break;
      }
      case KvCacheEvent::Kind::kRemoved:
        for (auto h : e.block_hashes) out->mutable_removed()->add_block_hashes(h);
        break;
      case KvCacheEvent::Kind::kCleared:
        out->mutable_cleared();
        break;
    }
  }
  return batch;
}

// One SubscribeKvEvents call: batches queue here and go out one write at a time.
class KvSubscriber final : public grpc::ServerWriteReactor<wv1::KvEventBatch> {
 public:
  KvSubscriber(KvEventHub* hub, wv1::KvEventBatch first) : hub_(hub) {
    queue_.push_back(std::move(first));
  }
  explicit KvSubscriber(grpc::Status refusal) : refusal_(std::move(refusal)) {}

  void attach(std::shared_ptr<KvSubscriber> self) { self_ = std::move(self); }

  // Starts the first write (or the refusal); called once, with no lock held.
  void start() {
    if (!refusal_.ok()) {
      Finish(refusal_);
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    next_locked(lock);
  }

  // Pump thread.
  void push(const wv1::KvEventBatch& batch) {
    std::unique_lock<std::mutex> lock(mu_);
    if (finished_ || cancelled_ || behind_) return;
    if (queue_.size() >= kQueueBatches) {
      behind_ = true;
      queue_.clear();
      maybe_finish(lock);
      return;
    }
    queue_.push_back(batch);
    next_locked(lock);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    write_pending_ = false;
    if (!ok) cancelled_ = true;
    if (cancelled_ || behind_) {
      maybe_finish(lock);
      return;
    }
    next_locked(lock);
  }

  void OnCancel() override {
    std::unique_lock<std::mutex> lock(mu_);
    cancelled_ = true;
    maybe_finish(lock);
  }

  void OnDone() override {
    if (hub_ != nullptr) hub_->remove(this);
    std::shared_ptr<KvSubscriber> keep;
    std::lock_guard<std::mutex> lock(mu_);
    keep.swap(self_);
  }

 private:
  // Starts the next write if none is pending; releases the lock before calling gRPC.
  void next_locked(std::unique_lock<std::mutex>& lock) {
    if (write_pending_ || finished_ || queue_.empty()) return;
    current_ = std::move(queue_.front());
    queue_.pop_front();
    write_pending_ = true;
    lock.unlock();
    StartWrite(&current_);
  }

  void maybe_finish(std::unique_lock<std::mutex>& lock) {
    if (finished_ || write_pending_) return;
    finished_ = true;
    const bool behind = behind_;
    lock.unlock();
    Finish(behind ? grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                 "the KV-event stream was read too slowly; subscribe again")
                  : grpc::Status(grpc::StatusCode::CANCELLED, "kv events stream cancelled"));
  }

  KvEventHub* hub_ = nullptr;
  const grpc::Status refusal_ = grpc::Status::OK;
  std::shared_ptr<KvSubscriber> self_;  // held until OnDone
  std::mutex mu_;
  std::deque<wv1::KvEventBatch> queue_;
  wv1::KvEventBatch current_;  // the write in flight
  bool write_pending_ = false;
  bool cancelled_ = false;
  bool behind_ = false;
  bool finished_ = false;
};

KvEventHub::KvEventHub(Executor& executor)
    : executor_(executor), enabled_(executor.kv_events()) {
  if (enabled_) thread_ = std::thread([this] { pump(); });
}

KvEventHub::~KvEventHub() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::uint64_t KvEventHub::sequence() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequence_;
}

grpc::ServerWriteReactor<wv1::KvEventBatch>* KvEventHub::subscribe() {
  std::shared_ptr<KvSubscriber> s;
  if (!enabled_) {
    s = std::make_shared<KvSubscriber>(grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        "this worker's engine reports no KV-cache events (its prefix cache is off)"));
    s->attach(s);
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    wv1::KvEventBatch first;
    first.set_sequence(sequence_);
    first.set_reset(true);
    first.set_timestamp_s(now_s());
    s = std::make_shared<KvSubscriber>(this, std::move(first));
    s->attach(s);
    subscribers_.push_back(s);
  }
  s->start();  // no lock held
  return s.get();
}

void KvEventHub::remove(KvSubscriber* subscriber) {
  std::lock_guard<std::mutex> lock(mu_);
  subscribers_.erase(std::remove_if(subscribers_.begin(), subscribers_.end(),
                                    [&](const auto& s) { return s.get() == subscriber; }),
                     subscribers_.end());
}

void KvEventHub::pump() {
  std::vector<std::shared_ptr<KvSubscriber>> to;
  while (!stop_.load()) {
    KvCacheEvents events;
    const auto asked = std::chrono::steady_clock::now();
    try {
      events = executor_.take_kv_events(kPumpWait);  // no lock held
    } catch (const std::exception&) {
      events.lost = true;  // what the engine could not say, subscribers must forget
    }
    if (events.events.empty() && !events.lost) {
      // An engine that answers at once with nothing (stopping, say) is not spun on.
      std::this_thread::sleep_until(asked + kPumpWait);
      continue;
    }
    wv1::KvEventBatch batch = to_batch(events);
    batch.set_timestamp_s(now_s());
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.set_sequence(++sequence_);
      to = subscribers_;
    }
    for (auto& s : to) s->push(batch);  // no hub lock held
    to.clear();
  }
}

}  // namespace switchyard::rt
