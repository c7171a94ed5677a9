#include "kv_events_stream.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <string>
#include <unordered_set>

#include "wire.h"

namespace switchyard::rt {

namespace {

constexpr std::size_t kQueueBatches = 4096;  // per subscriber, before it counts as behind
constexpr auto kPumpWait = std::chrono::milliseconds(50);

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string adapter_name(AdapterId task, const AdapterNamer& namer) {
  return namer ? namer(task) : "task-" + std::to_string(task);
}

void add_stored(wv1::KvEventBatch& batch, const std::vector<std::uint64_t>& hashes,
                const std::optional<std::uint64_t>& parent, const Tokens& tokens,
                std::int32_t block_size, const std::optional<AdapterId>& adapter,
                const AdapterNamer& namer) {
  auto* s = batch.add_events()->mutable_stored();
  for (auto h : hashes) s->add_block_hashes(h);
  if (parent) s->set_parent_block_hash(*parent);
  for (auto t : tokens) s->add_token_ids(static_cast<std::uint32_t>(t));
  s->set_block_size(static_cast<std::uint32_t>(block_size));
  if (adapter) s->set_adapter(adapter_name(*adapter, namer));
}

}  // namespace

wv1::KvEventBatch to_batch(const KvCacheEvents& events, const AdapterNamer& namer) {
  wv1::KvEventBatch batch;
  batch.set_reset(events.lost);
  for (const KvCacheEvent& e : events.events) {
    if (e.kind == KvCacheEvent::Kind::kStored) {
      add_stored(batch, e.block_hashes, e.parent_hash, e.tokens, e.block_size, e.adapter, namer);
    } else if (e.kind == KvCacheEvent::Kind::kRemoved) {
      auto* removed = batch.add_events()->mutable_removed();
      for (auto h : e.block_hashes) removed->add_block_hashes(h);
    } else {
      batch.add_events()->mutable_cleared();
    }
  }
  return batch;
}

// One SubscribeKvEvents call: batches queue here and go out one write at a time.
class KvSubscriber final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  KvSubscriber(KvEventHub* hub, std::vector<wv1::KvEventBatch> first) : hub_(hub) {
    for (auto& batch : first) queue_.push_back(std::move(batch));
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
    if (auto s = serialize(current_, &current_bytes_); !s.ok()) {
      lock.lock();
      finished_ = true;
      queue_.clear();
      lock.unlock();
      Finish(s);
      return;
    }
    StartWrite(&current_bytes_);
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
  wv1::KvEventBatch current_;        // the write in flight
  grpc::ByteBuffer current_bytes_;  // current_, serialized: kept until OnWriteDone
  bool write_pending_ = false;
  bool cancelled_ = false;
  bool behind_ = false;
  bool finished_ = false;
};

KvEventHub::KvEventHub(Executor& executor, AdapterNamer namer)
    : executor_(executor), namer_(std::move(namer)), enabled_(executor.kv_events()) {
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

std::size_t KvEventHub::held_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size();
}

void KvEventHub::apply_locked(const KvCacheEvents& events) {
  if (events.lost) held_.clear();  // what it holds now is not known: nothing is claimed
  for (const KvCacheEvent& e : events.events) {
    switch (e.kind) {
      case KvCacheEvent::Kind::kStored: {
        const auto size = static_cast<std::size_t>(std::max(e.block_size, 0));
        if (size == 0 || e.tokens.size() != e.block_hashes.size() * size) break;
        std::optional<std::uint64_t> parent = e.parent_hash;
        for (std::size_t i = 0; i < e.block_hashes.size(); ++i) {
          const auto first = e.tokens.begin() + static_cast<std::ptrdiff_t>(i * size);
          held_[e.block_hashes[i]] =
              HeldBlock{parent, Tokens(first, first + static_cast<std::ptrdiff_t>(size)),
                        e.block_size, e.adapter};
          parent = e.block_hashes[i];
        }
        break;
      }
      case KvCacheEvent::Kind::kRemoved:
        for (auto h : e.block_hashes) held_.erase(h);
        break;
      case KvCacheEvent::Kind::kCleared:
        held_.clear();
        break;
    }
  }
}

std::vector<wv1::KvEventBatch> KvEventHub::snapshot_locked() const {
  std::vector<wv1::KvEventBatch> out(1);
  out.front().set_reset(true);
  std::unordered_set<std::uint64_t> sent;
  std::vector<std::uint64_t> chain;
  for (const auto& entry : held_) {
    // This block's ancestors not yet sent, nearest first; then sent root first. A block
    // whose parent is gone is sent too (a subscriber refuses it, as the engine cannot
    // reuse it without its parent).
    chain.clear();
    for (auto it = held_.find(entry.first); it != held_.end() && !sent.count(it->first);) {
      chain.push_back(it->first);
      sent.insert(it->first);
      if (!it->second.parent) break;
      it = held_.find(*it->second.parent);
    }
    for (auto h = chain.rbegin(); h != chain.rend(); ++h) {
      if (static_cast<std::size_t>(out.back().events_size()) >= kSnapshotBlocksPerBatch) {
        out.emplace_back();
      }
      const HeldBlock& b = held_.at(*h);
      add_stored(out.back(), {*h}, b.parent, b.tokens, b.block_size, b.adapter, namer_);
    }
  }
  const double now = now_s();
  for (auto& batch : out) {
    batch.set_sequence(sequence_);
    batch.set_timestamp_s(now);
  }
  out.back().set_snapshot_end(true);
  return out;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvEventHub::subscribe() {
  std::shared_ptr<KvSubscriber> s;
  if (!enabled_) {
    s = std::make_shared<KvSubscriber>(grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        "this worker's engine reports no KV-cache events (its prefix cache is off)"));
    s->attach(s);
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    s = std::make_shared<KvSubscriber>(this, snapshot_locked());
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
    wv1::KvEventBatch batch = to_batch(events, namer_);
    batch.set_timestamp_s(now_s());
    {
      std::lock_guard<std::mutex> lock(mu_);
      apply_locked(events);  // with the batch, under one lock: a snapshot is never torn
      batch.set_sequence(++sequence_);
      to = subscribers_;
    }
    for (auto& s : to) s->push(batch);  // no hub lock held
    to.clear();
  }
}

}  // namespace switchyard::rt
