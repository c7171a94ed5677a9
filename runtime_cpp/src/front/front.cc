#include "front/front.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace switchyard::front {
namespace {

std::string to_string(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  out.reserve(buffer.Length());
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer to_buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::optional<double> deadline_ms(std::chrono::system_clock::time_point deadline) {
  auto now = std::chrono::system_clock::now();
  // grpc's "no deadline" is the far future: anything beyond a year is none.
  if (deadline - now > std::chrono::hours(24 * 365)) return std::nullopt;
  return std::chrono::duration<double, std::milli>(deadline - now).count();
}

}  // namespace

// One call, whatever its method: reads, writes and the finish that Python asks for.
class Front::Call : public grpc::ServerGenericBidiReactor {
 public:
  Call(Front* front, std::uint64_t id, grpc::GenericCallbackServerContext* context)
      : front_(front), id_(id), context_(context) {}

  void start(std::shared_ptr<Call> self) {
    self_ = std::move(self);
    v1::FrontEvent event;
    event.set_call(id_);
    auto* started = event.mutable_started();
    started->set_method(context_->method());
    started->set_peer(context_->peer());
    for (const auto& [key, value] : context_->client_metadata()) {
      auto* entry = started->add_metadata();
      entry->set_key(key.data(), key.size());
      entry->set_value(value.data(), value.size());
    }
    if (auto left = deadline_ms(context_->deadline())) started->set_deadline_ms(*left);
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = true;
    }
    // Before Python hears of the call (and can end it): grpc holds the read until this
    // reactor is bound, and its result comes after the `started` event.
    StartRead(&in_);
    front_->post(std::move(event));
  }

  // ---- Python's commands (the front's command thread) ----------------------------------

  void write(const std::string& message) {
    bool start = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_ || dead_) return;
      pending_.push_back(to_buffer(message));
      if (!writing_) {
        take_next_locked();
        start = true;
      } else if (!full_ && pending_.size() + 1 >= FULL_WRITES) {
        full_ = true;
        // Told under the lock, so that `drained` (also told under it) cannot overtake it.
        tell(&v1::FrontEvent::set_full);
      }
    }
    if (start) StartWrite(&out_);
  }

  // Whether a message written now goes out without the call saying `full` (and it is
  // still open): the direct path's test before it writes.
  bool ready() {
    std::lock_guard<std::mutex> lock(mu_);
    return !finish_ && !dead_ && !full_ && pending_.size() + 1 < FULL_WRITES;
  }

  void read() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reading_ || read_closed_ || finish_ || finished_) return;
      reading_ = true;
      starting_read_ = true;  // no Finish until StartRead has been called
    }
    StartRead(&in_);
    bool end_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      starting_read_ = false;
      end_now = may_end_locked();
    }
    if (end_now) end();
  }

  void finish(grpc::Status status, std::vector<std::pair<std::string, std::string>> trailers) {
    bool end_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finish_ || finished_) return;
      finish_ = std::move(status);
      trailers_ = std::move(trailers);
      end_now = may_end_locked();  // else after the last write goes out
    }
    if (end_now) end();
  }

  // ---- grpc's callbacks ----------------------------------------------------------------

  void OnReadDone(bool ok) override {
    v1::FrontEvent event;
    event.set_call(id_);
    if (ok) {
      event.set_message(to_string(in_));
    } else {
      event.set_half_closed(true);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      if (!ok) read_closed_ = true;
    }
    front_->post(std::move(event));
  }

  void OnWriteDone(bool ok) override {
    bool write_next = false;
    bool end_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ok) {  // the client is gone: nothing more goes out
        dead_ = true;
        pending_.clear();
        if (!finish_) finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "the call ended");
      }
      if (!pending_.empty()) {
        take_next_locked();
        write_next = true;
      } else {
        writing_ = false;
        if (full_ && ok) tell(&v1::FrontEvent::set_drained);
        full_ = false;
        end_now = may_end_locked();
      }
    }
    if (write_next) StartWrite(&out_);
    if (end_now) end();
  }

  void OnCancel() override {
    v1::FrontEvent event;
    event.set_call(id_);
    if (context_->deadline() <= std::chrono::system_clock::now()) {
      event.set_deadline_exceeded(true);
    } else {
      event.set_cancelled(true);
    }
    front_->post(std::move(event));
    // Nobody hears a status now; finish at once, so the call ends even if Python never
    // answers (at shutdown, say).
    bool end_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead_ = true;
      pending_.clear();
      if (!finish_) finish_ = grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      end_now = may_end_locked();
    }
    if (end_now) end();
  }

  void OnDone() override {
    front_->forget(id_);
    self_.reset();  // may delete this
  }

 private:
  void take_next_locked() {
    out_ = std::move(pending_.front());
    pending_.pop_front();
    writing_ = true;
  }

  // Whether the call may Finish now (a finish is asked for, none has been made, and no
  // write or read start is under way); if so, marks it finished: the caller ends it.
  bool may_end_locked() {
    if (!finish_ || finished_ || writing_ || starting_read_) return false;
    finished_ = true;
    return true;
  }

  void tell(void (v1::FrontEvent::*set)(bool)) {
    v1::FrontEvent event;
    event.set_call(id_);
    (event.*set)(true);
    front_->post(std::move(event));
  }

  // Called once, with no write in flight.
  void end() {
    for (const auto& [key, value] : trailers_) context_->AddTrailingMetadata(key, value);
    Finish(*finish_);
  }

  Front* front_;
  const std::uint64_t id_;
  grpc::GenericCallbackServerContext* context_;
  std::shared_ptr<Call> self_;  // alive until OnDone

  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;

  std::mutex mu_;
  std::deque<grpc::ByteBuffer> pending_;
  bool writing_ = false;
  bool full_ = false;  // said `full`, not yet `drained`
  bool reading_ = false;
  bool starting_read_ = false;  // read() is between its check and StartRead
  bool read_closed_ = false;
  bool dead_ = false;
  bool finished_ = false;  // Finish called (or about to be)
  std::optional<grpc::Status> finish_;
  std::vector<std::pair<std::string, std::string>> trailers_;
};

class Front::Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Front* front) : front_(front) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    return front_->open(context);
  }

 private:
  Front* front_;
};

Front::Front(const FrontOptions& options) : service_(std::make_unique<Service>(this)) {
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (event_fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!options.cert_pem.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        options.client_ca_pem.empty()
            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = options.client_ca_pem;
    ssl.pem_key_cert_pairs.push_back({options.key_pem, options.cert_pem});
    credentials = grpc::SslServerCredentials(ssl);
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, credentials, &port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, options.reuse_port ? 1 : 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, options.max_metadata_bytes);
  builder.RegisterCallbackGenericService(service_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    server_.reset();
    close(event_fd_);
    throw std::runtime_error("cannot serve " + options.address);
  }
  commands_thread_ = std::thread([this] { run_commands(); });
}

Front::~Front() {
  shutdown(0);
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    stopping_ = true;
  }
  commands_cv_.notify_one();
  if (commands_thread_.joinable()) commands_thread_.join();
  close(event_fd_);
}

void Front::apply(std::string serialized) { enqueue(Batch{std::move(serialized), {}}); }

void Front::enqueue(Batch batch) {
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    commands_.push_back(std::move(batch));
  }
  commands_cv_.notify_one();
}

void Front::run_commands() {
  std::deque<Batch> batches;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(commands_mu_);
      commands_cv_.wait(lock, [this] { return stopping_ || !commands_.empty(); });
      if (commands_.empty()) return;  // stopping, and nothing left to do
      batches.swap(commands_);
    }
    for (const auto& batch : batches) {
      if (batch.writes.empty()) {
        execute(batch.serialized);
        continue;
      }
      std::shared_ptr<Call> call;
      std::uint64_t current = 0;
      for (const auto& [id, message] : batch.writes) {
        if (!call || id != current) {
          current = id;
          call = find(id);
        }
        if (call) call->write(message);
      }
    }
    batches.clear();
  }
}

int Front::add_vocab(std::string_view table) { return direct_.add_vocab(ByteVocab::parse(table)); }

bool Front::direct_start(std::uint64_t stream, std::uint64_t attempt, std::uint64_t call,
                         int vocab, std::string pending, double last_token_at) {
  return direct_.start(stream, attempt, call, vocab, std::move(pending), last_token_at);
}

std::string Front::direct_stop(std::uint64_t stream, std::uint64_t attempt) {
  v1::Handback handback;
  if (!direct_.stop(stream, attempt, &handback)) return {};
  return handback.SerializeAsString();
}

std::string Front::feed(std::uint64_t stream, std::string_view raw) {
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  Writes writes;
  v1::FeedResult result;
  auto ready = [this](std::uint64_t id) {
    auto call = find(id);
    return call != nullptr && call->ready();
  };
  if (!direct_.feed(stream, raw, now, ready, writes, &result)) {
    throw std::invalid_argument("a worker message that does not parse");
  }
  if (!writes.empty()) enqueue(Batch{{}, std::move(writes)});
  return result.SerializeAsString();
}

void Front::shutdown(double grace_s) {
  std::call_once(shutdown_once_, [&] {
    if (!server_) return;
    auto deadline = std::chrono::system_clock::now() +
                    std::chrono::microseconds(static_cast<std::int64_t>(grace_s * 1e6));
    server_->Shutdown(deadline);
    server_->Wait();
  });
}

grpc::ServerGenericBidiReactor* Front::open(grpc::GenericCallbackServerContext* context) {
  const std::uint64_t id = next_id_.fetch_add(1);
  auto call = std::make_shared<Call>(this, id, context);
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    calls_.emplace(id, call);
  }
  call->start(call);
  return call.get();
}

void Front::forget(std::uint64_t id) {
  std::shared_ptr<Call> gone;  // released after the lock
  std::lock_guard<std::mutex> lock(calls_mu_);
  auto it = calls_.find(id);
  if (it != calls_.end()) {
    gone = std::move(it->second);
    calls_.erase(it);
  }
}

std::shared_ptr<Front::Call> Front::find(std::uint64_t id) const {
  std::lock_guard<std::mutex> lock(calls_mu_);
  auto it = calls_.find(id);
  return it == calls_.end() ? nullptr : it->second;
}

std::size_t Front::open_calls() const {
  std::lock_guard<std::mutex> lock(calls_mu_);
  return calls_.size();
}

void Front::post(v1::FrontEvent&& event) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    wake = events_.events_size() == 0;
    *events_.add_events() = std::move(event);
  }
  if (wake) {
    std::uint64_t one = 1;
    // A full counter (never, in practice) still leaves the fd readable.
    [[maybe_unused]] auto n = ::write(event_fd_, &one, sizeof one);
  }
}

std::string Front::poll() {
  // Clear the fd first: an event posted after this wakes Python again.
  std::uint64_t count;
  [[maybe_unused]] auto n = ::read(event_fd_, &count, sizeof count);
  v1::FrontEvents taken;
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    taken.Swap(&events_);
  }
  if (taken.events_size() == 0) return {};
  return taken.SerializeAsString();
}

void Front::execute(const std::string& serialized) {
  v1::FrontCommands commands;
  if (!commands.ParseFromString(serialized)) {
    bad_batches_.fetch_add(1);
    return;
  }
  std::shared_ptr<Call> call;
  std::uint64_t current = 0;
  const int writes = std::min(commands.write_calls_size(), commands.write_messages_size());
  for (int i = 0; i < writes; ++i) {
    if (!call || commands.write_calls(i) != current) {
      current = commands.write_calls(i);
      call = find(current);
    }
    if (call) call->write(commands.write_messages(i));
  }
  call.reset();
  for (const auto& command : commands.commands()) {
    if (!call || command.call() != current) {
      current = command.call();
      call = find(current);
    }
    if (!call) continue;  // ended meanwhile
    switch (command.kind_case()) {
      case v1::FrontCommand::kRead:
        call->read();
        break;
      case v1::FrontCommand::kFinish: {
        const auto& f = command.finish();
        std::vector<std::pair<std::string, std::string>> trailers;
        for (const auto& t : f.trailers()) trailers.emplace_back(t.key(), t.value());
        call->finish(grpc::Status(static_cast<grpc::StatusCode>(f.code()), f.message(),
                                  f.details()),
                     std::move(trailers));
        break;
      }
      default:
        break;
    }
  }
}

}  // namespace switchyard::front
