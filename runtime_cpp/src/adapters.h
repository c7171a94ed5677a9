// The LoRA adapters a C++ worker holds: loaded at run time (LoadAdapter), named by
// requests, unloaded once the requests using them are done (UnloadAdapter).
//
// The engine knows an adapter by a task id (TensorRT-LLM's LoraConfig taskId); this keeps
// the names, which request uses which, and refuses any other name, so that an adapter
// being unloaded takes no new requests. No lock is held while calling the executor.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <grpcpp/support/status.h>

#include "executor.h"

namespace switchyard::rt {

struct AdapterInfo {
  std::string name;
  std::string path;
  std::int32_t rank = 0;
  std::size_t in_flight = 0;
};

// Why a call was refused: a gRPC code's meaning, and the words (naming the field).
struct AdapterRefusal {
  enum class Kind : std::uint8_t {
    kNone, kInvalid, kNotFound, kNoLora, kExists, kFull, kEngine
  };
  Kind kind = Kind::kNone;
  std::string field;
  std::string message;
};

// The gRPC code of a refusal.
grpc::StatusCode adapter_code(const AdapterRefusal& why);

class AdapterRegistry {
 public:
  explicit AdapterRegistry(Executor& executor);

  // Loads `path` under `name` (the engine checks and reads it); loading the same name and
  // path again is a no-op. On refusal returns nullopt and fills `why`.
  std::optional<AdapterInfo> load(const std::string& name, const std::string& path,
                                  AdapterRefusal* why);
  // The task id of a request naming `name`, counted in use until release(id) or
  // unacquire(name); nullopt (and `why`) when it is not held or is being unloaded.
  std::optional<AdapterId> acquire(const std::string& name, AdapterRefusal* why);
  void unacquire(const std::string& name);           // the enqueue failed
  // The enqueue gave it `id`: call before the stream registers with the dispatcher, so
  // that its final (and release) cannot come first.
  void bind(RequestId id, const std::string& name);
  // The request is over (its final came, or its stream went away); idempotent, and a
  // no-op for a request without an adapter.
  void release(RequestId id);
  // Stops new requests for `name`, waits up to `grace` for those in flight, cancels the
  // rest, then drops it from the engine. {drained, cancelled}; nullopt if not held.
  std::optional<std::pair<std::uint32_t, std::uint32_t>> unload(
      const std::string& name, std::chrono::milliseconds grace);
  std::vector<AdapterInfo> list() const;
  // The name an engine task id was loaded under; nullopt once it is no longer held.
  std::optional<std::string> name_of(AdapterId task) const;

 private:
  struct Held {
    AdapterId task = 0;
    std::string path;
    std::int32_t rank = 0;
    std::size_t in_flight = 0;
    bool unloading = false;
    std::set<RequestId> requests;
  };
  Executor& executor_;
  const EngineInfo info_;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::map<std::string, Held> held_;
  std::unordered_set<std::string> loading_;
  std::unordered_map<RequestId, std::string> bound_;
  AdapterId next_task_ = 1;
};

}  // namespace switchyard::rt
