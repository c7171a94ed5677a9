// The one thread that awaits executor responses and hands each to its stream.
//
// Streams register after enqueue() returned their id, so a response can arrive first: it
// is parked and handed over, in order, by this same thread once the stream registers.
// No lock is held while calling the executor or a stream.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "executor.h"

namespace switchyard::rt {

class StreamSink {
 public:
  virtual ~StreamSink() = default;
  // Called on the dispatcher thread, in order, for every response of the request.
  virtual void on_response(GenResponse&& response) = 0;
};

class Dispatcher {
 public:
  explicit Dispatcher(Executor& executor,
                      std::chrono::milliseconds poll = std::chrono::milliseconds(5));
  ~Dispatcher();  // stops and joins the thread
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // Claims the client's request id `name` for a request about to be enqueued, so that a
  // second request with it is refused before it reaches the engine. Returns false when
  // `name` is reserved or in flight. The claim ends with add() (or release() when the
  // enqueue failed). Empty names are not tracked.
  bool reserve(const std::string& name);
  void release(const std::string& name);
  // Registers the stream of `id`; `name` is the client's request id (for Abort), empty for
  // none. Returns false when `name` is in flight for another request (a name reserved
  // with reserve() is taken over).
  bool add(RequestId id, const std::string& name, std::shared_ptr<StreamSink> sink);
  void remove(RequestId id);
  // Called (no lock held) once a request is over for its stream: its final was handed to
  // the stream, or the stream went away (remove). Set once, before any stream is added.
  void set_on_over(std::function<void(RequestId)> on_over) { on_over_ = std::move(on_over); }
  // The executor id of an in-flight request by its client name.
  std::optional<RequestId> find(const std::string& name) const;
  std::size_t in_flight() const;
  void stop();

 private:
  static constexpr RequestId kReserved = 0;
  struct Entry {
    std::shared_ptr<StreamSink> sink;
    std::string name;
  };
  struct Parked {
    std::vector<GenResponse> responses;
    std::chrono::steady_clock::time_point since;
  };
  void loop();

  Executor& executor_;
  const std::chrono::milliseconds poll_;
  mutable std::mutex mu_;
  std::unordered_map<RequestId, Entry> streams_;
  std::unordered_map<std::string, RequestId> names_;  // kReserved: enqueue in progress
  std::unordered_map<RequestId, Parked> parked_;
  // Streams that went away before their final: their later responses are dropped.
  std::unordered_set<RequestId> dropped_;
  std::vector<std::pair<std::shared_ptr<StreamSink>, GenResponse>> redeliver_;
  std::function<void(RequestId)> on_over_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last member: starts after the others exist
};

}  // namespace switchyard::rt
