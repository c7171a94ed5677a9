// SubscribeKvEvents: the engine's KV-cache events (Executor::take_kv_events), read by one
// pump thread and written to every subscriber, each a ServerWriteReactor with one write in
// flight and a bounded queue. A subscriber's first batch has reset set; so does a batch
// after the engine lost events. One that falls behind ends with RESOURCE_EXHAUSTED (it
// subscribes again, from a reset). No lock is held across a gRPC call.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "executor.h"
#include "switchyard/worker/v1/worker.grpc.pb.h"

namespace switchyard::rt {

namespace wv1 = ::switchyard::worker::v1;

// The wire form of what take_kv_events found (sequence and timestamp left to the caller).
wv1::KvEventBatch to_batch(const KvCacheEvents& events);

class KvSubscriber;

class KvEventHub {
 public:
  explicit KvEventHub(Executor& executor);  // starts the pump where the engine has events
  ~KvEventHub();                            // stops and joins it
  KvEventHub(const KvEventHub&) = delete;
  KvEventHub& operator=(const KvEventHub&) = delete;

  bool enabled() const { return enabled_; }
  grpc::ServerWriteReactor<wv1::KvEventBatch>* subscribe();
  void remove(KvSubscriber* subscriber);
  std::uint64_t sequence() const;

 private:
  void pump();

  Executor& executor_;
  const bool enabled_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<KvSubscriber>> subscribers_;
  std::uint64_t sequence_ = 0;  // one more per batch sent
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace switchyard::rt
