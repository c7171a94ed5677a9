// The control plane's native gRPC front: a grpc++ callback server on the public port
// that carries the bytes of every call, while the Python program that loads it decides
// everything (control/api/front.py).
//
// Every call, whatever its method, is one generic reactor. What happens on it becomes
// events (switchyard.front.v1.FrontEvents) that Python takes in batches: poll() returns
// all of them at once, and `event_fd()` becomes readable when there are some. Python
// answers with commands (FrontCommands), also in batches: writes, reads, finishes.
// Python's per-message cost is then a few bytes appended to a batch, not a trip through
// a gRPC stack per message.
//
// Threads: grpc's callback threads run the reactors and append events; poll() and
// apply() run on Python's thread (without the GIL). No lock is held across a gRPC call.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <thread>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "front/direct.h"
#include "switchyard/front/v1/front.pb.h"

namespace switchyard::front {

struct FrontOptions {
  std::string address;  // host:port; port 0 picks one
  bool reuse_port = false;
  int max_message_bytes = 64 * 1024 * 1024;
  // grpc core's own limit on a call's metadata (what it refuses before any handler).
  int max_metadata_bytes = 32 * 1024;
  // TLS when cert_pem is set; with client_ca_pem, clients must show a certificate it signed.
  std::string cert_pem;
  std::string key_pem;
  std::string client_ca_pem;
};

// Messages a call may have waiting to be sent before it tells Python it is full.
inline constexpr std::size_t FULL_WRITES = 64;

class Front {
 public:
  // Starts serving; throws std::runtime_error when the address cannot be served.
  explicit Front(const FrontOptions& options);
  ~Front();
  Front(const Front&) = delete;
  Front& operator=(const Front&) = delete;

  int port() const { return port_; }
  int event_fd() const { return event_fd_; }
  // Every event since the last poll, serialized (empty when there are none).
  std::string poll();
  // Queues serialized FrontCommands for the front's own thread, which applies them in
  // order (so Python's thread spends no time in grpc's write path). Commands that do not
  // parse are counted and dropped (`bad_batches()`); those for a call that has ended are
  // ignored.
  void apply(std::string serialized);
  std::uint64_t bad_batches() const { return bad_batches_.load(); }
  // Stops accepting calls; calls still open after `grace_s` are cancelled.
  void shutdown(double grace_s);
  std::size_t open_calls() const;

  // The direct path (direct.h), from Python's thread. A vocabulary table in ByteVocab's
  // format: its handle (throws std::invalid_argument on a table cut short).
  int add_vocab(std::string_view table);
  bool direct_start(std::uint64_t stream, std::uint64_t attempt, std::uint64_t call, int vocab,
                    std::string pending, double last_token_at);
  // A serialized Handback; empty when the attempt was not handed over.
  std::string direct_stop(std::uint64_t stream, std::uint64_t attempt);
  // One worker message of `stream`: its chunks for handed-over attempts are queued as
  // writes (for the command thread, in order with Python's commands); returns the
  // serialized FeedResult. Throws std::invalid_argument when `raw` does not parse.
  std::string feed(std::uint64_t stream, std::string_view raw);

  class Call;

 private:
  class Service;
  friend class Call;

  void post(v1::FrontEvent&& event);
  void run_commands();
  // A batch for the command thread: Python's serialized commands, or the direct path's writes.
  struct Batch {
    std::string serialized;
    Writes writes;
  };
  void enqueue(Batch batch);
  void execute(const std::string& serialized);
  void forget(std::uint64_t id);
  grpc::ServerGenericBidiReactor* open(grpc::GenericCallbackServerContext* context);
  std::shared_ptr<Call> find(std::uint64_t id) const;

  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  int event_fd_ = -1;
  std::atomic<std::uint64_t> next_id_{1};

  std::mutex events_mu_;
  v1::FrontEvents events_;

  std::mutex commands_mu_;
  std::condition_variable commands_cv_;
  std::deque<Batch> commands_;
  bool stopping_ = false;
  std::atomic<std::uint64_t> bad_batches_{0};
  std::thread commands_thread_;

  mutable std::mutex calls_mu_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Call>> calls_;
  std::once_flag shutdown_once_;

  DirectTable direct_;
};

}  // namespace switchyard::front
