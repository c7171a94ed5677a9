// SubscribeKvEvents: the engine's KV-cache events (Executor::take_kv_events), read by one
// pump thread and written to every subscriber, each a ServerWriteReactor with one write in
// flight and a bounded queue. The hub keeps what the engine holds (the stored blocks less
// the removed), so a new subscriber's first batches are that, after a reset: it knows the
// cache as it is, not only what is stored from then on. A batch after the engine lost
// events has reset set (what was held is then forgotten). One that falls behind ends with
// RESOURCE_EXHAUSTED (it subscribes again, from a reset). No lock is held across a gRPC
// call.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "executor.h"
#include "switchyard/worker/v1/worker.grpc.pb.h"

namespace switchyard::rt {

namespace wv1 = ::switchyard::worker::v1;

// The service's name of an engine's LoRA task id (the name requests use).
using AdapterNamer = std::function<std::string(AdapterId)>;

// The wire form of what take_kv_events found (sequence and timestamp left to the caller);
// adapters named by `namer`, else as "task-N".
wv1::KvEventBatch to_batch(const KvCacheEvents& events, const AdapterNamer& namer = {});

// Blocks per batch when a new subscriber is told what the engine holds.
constexpr std::size_t kSnapshotBlocksPerBatch = 1024;

class KvSubscriber;

class KvEventHub {
 public:
  // Starts the pump where the engine has events.
  explicit KvEventHub(Executor& executor, AdapterNamer namer = {});
  ~KvEventHub();                            // stops and joins it
  KvEventHub(const KvEventHub&) = delete;
  KvEventHub& operator=(const KvEventHub&) = delete;

  bool enabled() const { return enabled_; }
  // A raw reactor: KvEventBatch messages, serialized.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* subscribe();
  void remove(KvSubscriber* subscriber);
  std::uint64_t sequence() const;
  std::size_t held_blocks() const;  // what the engine holds, as its events said

 private:
  struct HeldBlock {
    std::optional<std::uint64_t> parent;
    Tokens tokens;
    std::int32_t block_size = 0;
    std::optional<AdapterId> adapter;
  };
  void pump();
  void apply_locked(const KvCacheEvents& events);
  // A reset, then every held block, each after its parent, kSnapshotBlocksPerBatch a batch;
  // the last batch is marked snapshot_end.
  std::vector<wv1::KvEventBatch> snapshot_locked() const;

  Executor& executor_;
  const AdapterNamer namer_;
  const bool enabled_;
  std::unordered_map<std::uint64_t, HeldBlock> held_;  // engine hash -> block, under mu_
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<KvSubscriber>> subscribers_;
  std::uint64_t sequence_ = 0;  // one more per batch sent
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace switchyard::rt
