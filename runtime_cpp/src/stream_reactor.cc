#include "stream_reactor.h"

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "admit.h"
#include "translate.h"
#include "wire.h"

namespace switchyard::rt {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMethod[] = "/switchyard.worker.v1.Worker/GenerateStream";

class StreamSession;

using AttemptId = std::uint64_t;

// What the dispatcher holds for one request: a weak link to its session.
class SessionSink final : public StreamSink {
 public:
  SessionSink(std::weak_ptr<StreamSession> session, AttemptId attempt)
      : session_(std::move(session)), attempt_(attempt) {}
  void on_response(GenResponse&& response) override;

 private:
  std::weak_ptr<StreamSession> session_;
  const AttemptId attempt_;
};

class StreamSession final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public std::enable_shared_from_this<StreamSession> {
 public:
  StreamSession(grpc::CallbackServerContext* context, Executor& executor, Dispatcher& dispatcher,
                AdapterRegistry& adapters, const EngineInfo& info, std::atomic<int>& live,
                const std::atomic<bool>& draining)
      : context_(context), executor_(executor), dispatcher_(dispatcher), adapters_(adapters),
        info_(info), live_(live), draining_(draining) {}

  void begin() {
    self_ = shared_from_this();
    StartRead(&in_bytes_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the caller closed its side (or the call is over)
      std::unique_lock<std::mutex> lock(mu_);
      reads_done_ = true;
      if (!write_in_flight_) write_next_locked(lock);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;  // cancelled meanwhile: start nothing, read no more
    }
    if (auto parsed = parse_request(context_, kMethod, in_bytes_, &in_); !parsed.ok()) {
      return fail(std::move(parsed));  // read no more
    }
    // Cancels first: a start that the same message cancels is never started.
    const std::unordered_set<AttemptId> cancels(in_.cancel().begin(), in_.cancel().end());
    for (AttemptId attempt : cancels) cancel_request(attempt);
    for (const auto& request : in_.start()) {
      if (!cancels.count(request.attempt_id())) start_request(request);
    }
    {
      std::unique_lock<std::mutex> lock(mu_);  // send the error events, if any
      if (!write_in_flight_) write_next_locked(lock);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;  // cancelled while handling this message: Finish is called
    }
    StartRead(&in_bytes_);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    write_in_flight_ = false;
    if (!ok) cancelled_ = true;
    write_next_locked(lock);
  }

  void OnCancel() override {
    std::vector<RequestId> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      ids = take_all_locked();
    }
    abandon(ids);  // no lock held
    std::unique_lock<std::mutex> lock(mu_);
    if (!write_in_flight_) write_next_locked(lock);
  }

  void OnDone() override {
    std::vector<RequestId> ids;
    std::shared_ptr<StreamSession> keep;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ids = take_all_locked();
      keep.swap(self_);  // sinks hold weak links only
    }
    abandon(ids);
  }

  // Dispatcher thread.
  void on_response(AttemptId attempt, GenResponse&& r) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = requests_.find(attempt);
    if (it == requests_.end() || it->second.id != r.id) return;  // cancelled meanwhile
    Request& req = it->second;
    normalize_end_id(&r, req.end_id, req.last_token);
    if (!r.tokens.empty()) {
      if (req.first_token_ms < 0) {
        req.first_token_ms = std::chrono::duration<double, std::milli>(Clock::now() - req.started)
                                 .count();
      }
      req.last_token = r.tokens.back();
      req.completion_tokens += static_cast<std::int32_t>(r.tokens.size());
    }
    if (req.cadence.add(r)) req.cadence.take(open_chunk_locked(attempt));
    if (r.is_final) {
      auto* event = pending_.add_events();
      event->set_attempt_id(attempt);
      auto* final = event->mutable_final();
      fill_final(r, req.completion_tokens, req.last_token, info_.eos_token_ids, final);
      final->set_time_to_first_token_ms(req.first_token_ms < 0 ? 0 : req.first_token_ms);
      open_chunks_.erase(attempt);
      requests_.erase(it);
      live_.fetch_sub(1);
    }
    if (!write_in_flight_) write_next_locked(lock);
  }

 private:
  struct Request {
    RequestId id = 0;  // the executor's; 0 while the enqueue is under way
    Clock::time_point started;
    std::int32_t completion_tokens = 0;
    std::optional<TokenId> last_token;
    std::optional<TokenId> end_id;  // the request's, for normalize_end_id
    double first_token_ms = -1;
    ChunkCadence cadence;  // its tokens held back to its stream_interval
  };

  // The attempt's chunk event in pending_, opened at the end when it has none: an
  // attempt's consecutive chunks merge until the message is written.
  wv1::Chunk* open_chunk_locked(AttemptId attempt) {
    auto open = open_chunks_.find(attempt);
    if (open != open_chunks_.end()) return pending_.mutable_events(open->second)->mutable_chunk();
    open_chunks_.emplace(attempt, pending_.events_size());
    auto* event = pending_.add_events();
    event->set_attempt_id(attempt);
    return event->mutable_chunk();
  }

  // Read side only (one OnReadDone at a time), so an attempt is started by one thread.
  void start_request(const wv1::GenerateRequest& request) {
    const AttemptId attempt = request.attempt_id();
    if (attempt == 0) {
      return error(attempt, grpc::StatusCode::INVALID_ARGUMENT,
                   {"attempt_id", "required (nonzero) on GenerateStream"});
    }
    {
      // The attempt's slot, taken before the engine sees anything: a duplicate is refused
      // without touching the engine or the attempt already open.
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, fresh] = requests_.try_emplace(attempt);
      if (!fresh) {
        return error_locked(
            attempt, grpc::StatusCode::ALREADY_EXISTS,
            {"attempt_id", std::to_string(attempt) + " is already open on this stream"});
      }
      it->second.started = Clock::now();
      it->second.cadence = ChunkCadence(request.stream_interval());
      live_.fetch_add(1);
    }
    if (draining_.load()) {
      return refuse(attempt, grpc::StatusCode::UNAVAILABLE, {"", "the worker is draining"});
    }
    const double left_ms = request.timeout_ms() > 0 ? request.timeout_ms() : -1;
    Admitted admitted;
    if (auto refused = admit(request, info_, engine_deadline_ms(left_ms), executor_, adapters_,
                             Claim{}, &admitted)) {
      return refuse(attempt, refused->code, refused->why);
    }
    const RequestId id = admitted.id;
    bool gone = false;
    {
      // Known before the dispatcher can deliver: its responses wait (parked) until add().
      std::lock_guard<std::mutex> lock(mu_);
      auto it = requests_.find(attempt);
      gone = it == requests_.end();  // the call was cancelled during the enqueue
      if (!gone) {
        it->second.id = id;
        it->second.end_id = admitted.end_id;
      }
    }
    if (gone) {
      cancel_quietly(id);
      adapters_.release(id);
      return;
    }
    // No name: on this stream request_id is for logs only and need not be unique, so the
    // attempt is cancelled through the stream, not through Abort.
    dispatcher_.add(id, std::string(), std::make_shared<SessionSink>(weak_from_this(), attempt));
  }

  // Gives up the slot taken by start_request and sends the error event.
  void refuse(AttemptId attempt, grpc::StatusCode code, const FieldError& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (requests_.erase(attempt)) live_.fetch_sub(1);
    error_locked(attempt, code, why);
  }

  void cancel_request(AttemptId attempt) {
    RequestId id = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = requests_.find(attempt);
      if (it == requests_.end()) return;  // unknown or over: nothing to do
      id = it->second.id;
      requests_.erase(it);
      drop_pending_locked(attempt);
      live_.fetch_sub(1);
    }
    abandon({id});
  }

  // Drops what is queued for a cancelled attempt: its caller listens no more. A live
  // attempt can only have its open chunk pending (a final or error ends it).
  void drop_pending_locked(AttemptId attempt) {
    if (open_chunks_.erase(attempt) == 0) return;
    wv1::StreamResponse kept;
    open_chunks_.clear();
    for (auto& event : *pending_.mutable_events()) {
      if (event.attempt_id() == attempt) continue;
      if (event.has_chunk() && requests_.count(event.attempt_id()) != 0) {
        open_chunks_[event.attempt_id()] = kept.events_size();
      }
      *kept.add_events() = std::move(event);
    }
    pending_.Swap(&kept);
  }

  // Ends the call with `status` (once the write in flight is done), cancelling its
  // requests as OnCancel does.
  void fail(grpc::Status status) {
    std::vector<RequestId> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.ok()) failure_ = std::move(status);
      ids = take_all_locked();
    }
    abandon(ids);  // no lock held
    std::unique_lock<std::mutex> lock(mu_);
    if (!write_in_flight_) write_next_locked(lock);
  }

  std::vector<RequestId> take_all_locked() {
    std::vector<RequestId> ids;
    for (const auto& [attempt, req] : requests_) {
      if (req.id != 0) ids.push_back(req.id);  // 0: its start cancels it when enqueue returns
    }
    live_.fetch_sub(static_cast<int>(requests_.size()));
    requests_.clear();
    open_chunks_.clear();
    return ids;
  }

  void abandon(const std::vector<RequestId>& ids) {
    for (auto id : ids) {
      cancel_quietly(id);
      dispatcher_.remove(id);
    }
  }

  void cancel_quietly(RequestId id) {
    try {
      executor_.cancel(id);
    } catch (const std::exception&) {
      // The engine is going away; its requests go with it.
    }
  }

  void error(AttemptId attempt, grpc::StatusCode code, const FieldError& why) {
    std::lock_guard<std::mutex> lock(mu_);
    error_locked(attempt, code, why);
  }

  // An error event; `why.field` (when set) names the field, as a BadRequest violation.
  void error_locked(AttemptId attempt, grpc::StatusCode code, const FieldError& why) {
    auto* event = pending_.add_events();
    event->set_attempt_id(attempt);
    auto* error = event->mutable_error();
    error->set_code(static_cast<std::uint32_t>(code));
    if (why.field.empty()) {
      error->set_message(why.message);
      return;
    }
    error->set_message(why.field + ": " + why.message);
    auto* violation = error->add_field_violations();
    violation->set_field(why.field);
    violation->set_description(why.message);
  }

  // Chooses the next action with `mu_` held, then releases it before calling gRPC.
  void write_next_locked(std::unique_lock<std::mutex>& lock) {
    if (finished_) return;
    if (cancelled_ || !failure_.ok()) {
      finished_ = true;
      const grpc::Status status =
          failure_.ok() ? grpc::Status(grpc::StatusCode::CANCELLED, "cancelled") : failure_;
      lock.unlock();
      Finish(status);
      return;
    }
    if (pending_.events_size() > 0) {
      out_.Swap(&pending_);
      pending_.Clear();
      open_chunks_.clear();
      write_in_flight_ = true;
      lock.unlock();
      if (auto s = serialize(out_, &out_bytes_); !s.ok()) {
        lock.lock();
        write_in_flight_ = false;  // none started
        lock.unlock();
        return fail(std::move(s));
      }
      StartWrite(&out_bytes_);
      return;
    }
    if (reads_done_ && requests_.empty()) {
      finished_ = true;
      lock.unlock();
      Finish(grpc::Status::OK);
    }
  }

  grpc::CallbackServerContext* const context_;  // the call's: valid until OnDone
  Executor& executor_;
  Dispatcher& dispatcher_;
  AdapterRegistry& adapters_;
  const EngineInfo& info_;
  std::atomic<int>& live_;
  const std::atomic<bool>& draining_;
  std::shared_ptr<StreamSession> self_;  // held until OnDone
  grpc::ByteBuffer in_bytes_;            // the read side's: the message as read
  wv1::StreamRequest in_;                // and parsed

  std::mutex mu_;
  std::unordered_map<AttemptId, Request> requests_;
  std::unordered_map<AttemptId, int> open_chunks_;  // attempt -> its event in pending_
  wv1::StreamResponse pending_;
  wv1::StreamResponse out_;     // the message being written
  grpc::ByteBuffer out_bytes_;  // out_, serialized: kept until OnWriteDone
  grpc::Status failure_;        // what ends the call, once not OK
  bool write_in_flight_ = false;
  bool reads_done_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
};

void SessionSink::on_response(GenResponse&& response) {
  if (auto session = session_.lock()) session->on_response(attempt_, std::move(response));
}

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* start_generate_stream(
    grpc::CallbackServerContext* context, Executor& executor, Dispatcher& dispatcher,
    AdapterRegistry& adapters, const EngineInfo& info, std::atomic<int>& live,
    const std::atomic<bool>& draining) {
  auto session = std::make_shared<StreamSession>(context, executor, dispatcher, adapters, info,
                                                 live, draining);
  session->begin();
  return session.get();
}

}  // namespace switchyard::rt
