#include "worker_service.h"

#include <functional>

#include <grpcpp/alarm.h>

#include <chrono>
#include <mutex>

#include "admit.h"
#include "stream_reactor.h"
#include "translate.h"

namespace switchyard::rt {
namespace {

using Clock = std::chrono::steady_clock;
// Part of the client's deadline kept back, so TIME_LIMIT reaches the client in time.

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// The stream of one Generate call. The reactor lives until OnDone; the dispatcher may
// hold this object longer, so everything it touches after Finish is guarded by `done_`.
class GenerateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                              public StreamSink {
 public:
  GenerateReactor(Executor& executor, Dispatcher& dispatcher, AdapterRegistry& adapters,
                  std::atomic<int>& live)
      : executor_(executor), dispatcher_(dispatcher), adapters_(adapters), live_(live) {
    live_.fetch_add(1);
  }

  // Enqueues the request, or finishes the RPC with the error.
  void start(grpc::CallbackServerContext* ctx, const wv1::GenerateRequest& req,
             const EngineInfo& info, std::shared_ptr<GenerateReactor> self) {
    self_ = std::move(self);
    cadence_ = ChunkCadence(req.stream_interval());  // before the dispatcher can deliver
    double left_ms = -1;
    auto deadline = ctx->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      left_ms = std::max(0.0, std::chrono::duration<double, std::milli>(
                                  deadline - std::chrono::system_clock::now())
                                  .count());
    }
    name_ = req.request_id();
    eos_ids_ = info.eos_token_ids;
    // Claim the id before the engine sees anything: a duplicate costs it nothing.
    const Claim claim{[this]() -> std::optional<Refusal> {
                        if (dispatcher_.reserve(name_)) return std::nullopt;
                        return Refusal{grpc::StatusCode::ALREADY_EXISTS,
                                       {"", "request_id " + name_ + " is already in flight"}};
                      },
                      [this] { dispatcher_.release(name_); }};
    Admitted admitted;
    if (auto refused = admit(req, info, engine_deadline_ms(left_ms), executor_, adapters_, claim,
                             &admitted)) {
      finish_now(refusal_status(*refused));
      return;
    }
    id_ = admitted.id;
    end_id_ = admitted.end_id;
    dispatcher_.add(id_, name_, self_);  // cannot fail: the name is ours
    enqueued_.store(true);
  }

  void refuse(std::shared_ptr<GenerateReactor> self, const grpc::Status& status) {
    self_ = std::move(self);
    finish_now(status);
  }

  // Dispatcher thread: coalesce, and start a write if none is in flight.
  void on_response(GenResponse&& r) override {
    if (r.is_final) request_over_.store(true);
    std::unique_lock<std::mutex> lock(mu_);
    if (finished_) return;
    normalize_end_id(&r, end_id_, last_token_);
    if (first_token_ms_ < 0 && !r.tokens.empty()) first_token_ms_ = ms_since(started_);
    if (!r.tokens.empty()) last_token_ = r.tokens.back();
    completion_tokens_ += static_cast<std::int32_t>(r.tokens.size());
    if (cadence_.add(r)) cadence_.take(pending_.mutable_chunk());
    if (r.is_final) {
      final_ = std::make_unique<GenResponse>(std::move(r));  // its tokens are in pending_
    }
    if (!write_in_flight_) write_next_locked(lock);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) cancel_engine_request();  // the client is gone; no lock held
    std::unique_lock<std::mutex> lock(mu_);
    write_in_flight_ = false;
    if (!ok) cancelled_ = true;
    write_next_locked(lock);
  }

  void OnCancel() override {
    cancel_engine_request();  // at once; no lock held
    std::unique_lock<std::mutex> lock(mu_);
    cancelled_ = true;
    if (!write_in_flight_) write_next_locked(lock);
  }

  void OnDone() override {
    cancel_engine_request();  // the stream ended before its request did
    if (enqueued_.load()) dispatcher_.remove(id_);
    live_.fetch_sub(1);
    std::shared_ptr<GenerateReactor> keep;
    {
      std::lock_guard<std::mutex> lock(mu_);
      keep.swap(self_);  // the dispatcher may still hold a reference; fine
    }
  }

 private:
  // Chooses the next action with `mu_` held, then releases it before calling gRPC.
  void write_next_locked(std::unique_lock<std::mutex>& lock) {
    if (finished_) return;
    if (cancelled_) {
      finished_ = true;
      lock.unlock();
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      return;
    }
    if (pending_.chunk().token_ids_size() > 0) {
      out_.Swap(&pending_);
      pending_.Clear();
    } else if (final_) {
      out_.Clear();
      fill_final(*final_, completion_tokens_, last_token_, eos_ids_, out_.mutable_final());
      out_.mutable_final()->set_time_to_first_token_ms(first_token_ms_ < 0 ? 0 : first_token_ms_);
      final_.reset();
      final_sent_ = true;
    } else if (final_sent_) {
      finished_ = true;
      lock.unlock();
      Finish(grpc::Status::OK);
      return;
    } else {
      return;  // nothing to send yet
    }
    write_in_flight_ = true;
    lock.unlock();
    if (auto s = serialize(out_, &out_bytes_); !s.ok()) {
      cancel_engine_request();
      finish_now(s);
      return;
    }
    StartWrite(&out_bytes_);
  }

  // Cancels the engine request unless it finished (or was cancelled) already: once, from
  // whichever of OnCancel, OnWriteDone(!ok) and OnDone comes first.
  void cancel_engine_request() {
    if (!enqueued_.load() || request_over_.load() || cancel_sent_.exchange(true)) return;
    try {
      executor_.cancel(id_);
    } catch (const std::exception&) {
      // The engine is going away; its requests go with it.
    }
  }

  void finish_now(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ = true;
    }
    Finish(status);
  }

  Executor& executor_;
  Dispatcher& dispatcher_;
  AdapterRegistry& adapters_;
  std::atomic<int>& live_;
  std::shared_ptr<GenerateReactor> self_;  // held until OnDone
  const Clock::time_point started_ = Clock::now();
  RequestId id_ = 0;
  std::string name_;
  std::atomic<bool> enqueued_{false};
  std::atomic<bool> request_over_{false};  // its final reached this stream
  std::atomic<bool> cancel_sent_{false};

  std::mutex mu_;
  ChunkCadence cadence_;           // tokens held back to the request's stream_interval
  wv1::GenerateResponse pending_;  // coalesced tokens not yet written
  wv1::GenerateResponse out_;      // the message being written
  grpc::ByteBuffer out_bytes_;     // out_, serialized: kept until OnWriteDone
  std::unique_ptr<GenResponse> final_;
  std::int32_t completion_tokens_ = 0;
  std::optional<TokenId> last_token_;
  std::vector<TokenId> eos_ids_;
  std::optional<TokenId> end_id_;  // the request's, for normalize_end_id
  double first_token_ms_ = -1;
  bool write_in_flight_ = false;
  bool final_sent_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
};

// One StreamLoad call. The service's ticker thread starts each write when the report is
// due; like GenerateReactor, the decision is made under `mu_` and gRPC is called after.
class LoadReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>, public LoadStream {
 public:
  LoadReactor(WorkerService& service, std::chrono::milliseconds interval)
      : service_(service), interval_(interval) {}

  void attach(std::shared_ptr<LoadReactor> self) { self_ = std::move(self); }

  // Ticker thread.
  void tick(std::chrono::steady_clock::time_point now) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || cancelled_ || write_pending_ || now < due_) return;
      write_pending_ = true;
      due_ = now + interval_;
    }
    try {
      service_.fill_load(&report_);
    } catch (const std::exception&) {
      report_.Clear();  // an empty report beats a dead stream
    }
    if (auto s = serialize(report_, &report_bytes_); !s.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        finished_ = true;
      }
      Finish(s);
      return;
    }
    StartWrite(&report_bytes_);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    write_pending_ = false;
    if (!ok) cancelled_ = true;
    maybe_finish(lock);
  }

  void OnCancel() override {
    std::unique_lock<std::mutex> lock(mu_);
    cancelled_ = true;
    maybe_finish(lock);
  }

  void OnDone() override {
    service_.remove_load_stream(this);
    std::shared_ptr<LoadReactor> keep;
    std::lock_guard<std::mutex> lock(mu_);
    keep.swap(self_);
  }

 private:
  void maybe_finish(std::unique_lock<std::mutex>& lock) {
    if (finished_ || write_pending_ || !cancelled_) return;
    finished_ = true;
    lock.unlock();
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "load stream cancelled"));
  }

  WorkerService& service_;
  const std::chrono::milliseconds interval_;
  std::shared_ptr<LoadReactor> self_;  // held until OnDone
  wv1::LoadReport report_;             // touched only while a write is being started
  grpc::ByteBuffer report_bytes_;      // report_, serialized: kept until OnWriteDone
  std::mutex mu_;
  std::chrono::steady_clock::time_point due_{};
  bool write_pending_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
};

}  // namespace

WorkerService::WorkerService(Executor& executor, Dispatcher& dispatcher)
    : executor_(executor), dispatcher_(dispatcher), info_(executor.info()), adapters_(executor),
      kv_hub_(executor,
              [this](AdapterId task) {
                // The name requests use; an adapter unloaded since is known by its task.
                return adapters_.name_of(task).value_or("task-" + std::to_string(task));
              }),
      ticker_([this] { ticker(); }) {
  dispatcher_.set_on_over([this](RequestId id) { adapters_.release(id); });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WorkerService::Generate(
    grpc::CallbackServerContext* context, const Bytes* body) {
  wv1::GenerateRequest request;
  auto parsed = parse_request(context, "/switchyard.worker.v1.Worker/Generate", *body, &request);
  if (!parsed.ok()) return finished_writer(std::move(parsed));
  auto reactor =
      std::make_shared<GenerateReactor>(executor_, dispatcher_, adapters_, live_streams_);
  GenerateReactor* raw = reactor.get();
  if (draining_.load()) {
    raw->refuse(std::move(reactor),
                grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is draining"));
  } else {
    raw->start(context, request, info_, std::move(reactor));
  }
  return raw;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* WorkerService::GenerateStream(
    grpc::CallbackServerContext* context) {
  return start_generate_stream(context, executor_, dispatcher_, adapters_, info_, live_streams_,
                               draining_);
}

grpc::ServerUnaryReactor* WorkerService::Abort(grpc::CallbackServerContext* context,
                                               const Bytes* body, Bytes* response) {
  auto* reactor = context->DefaultReactor();
  wv1::AbortRequest request;
  const char* method = "/switchyard.worker.v1.Worker/Abort";
  if (!parse_unary(context, method, *body, &request, reactor)) return reactor;
  std::uint32_t aborted = 0;
  for (const auto& name : request.request_ids()) {
    if (auto id = dispatcher_.find(name)) {
      try {
        executor_.cancel(*id);
        ++aborted;
      } catch (const std::exception&) {
      }
    }
  }
  wv1::AbortResponse reply;
  reply.set_aborted(aborted);
  finish_unary(reactor, reply, response);
  return reactor;
}

void fill_adapter(const AdapterInfo& a, wv1::AdapterInfo* out);

grpc::ServerUnaryReactor* WorkerService::GetInfo(grpc::CallbackServerContext* context,
                                                 const Bytes* body, Bytes* response) {
  auto* reactor = context->DefaultReactor();
  wv1::GetInfoRequest request;
  const char* method = "/switchyard.worker.v1.Worker/GetInfo";
  if (!parse_unary(context, method, *body, &request, reactor)) return reactor;
  wv1::GetInfoResponse reply;
  reply.set_engine(info_.engine);
  reply.set_engine_version(info_.engine_version);
  reply.set_model(info_.model);
  reply.set_max_context(static_cast<std::uint32_t>(info_.max_context));
  reply.set_vocab_size(static_cast<std::uint32_t>(info_.vocab_size));
  for (auto id : info_.eos_token_ids) reply.add_eos_token_ids(static_cast<std::uint32_t>(id));
  reply.set_kv_block_size(static_cast<std::uint32_t>(info_.tokens_per_block));
  reply.set_generate_stream(true);
  reply.set_tensor_parallel_size(static_cast<std::uint32_t>(info_.tensor_parallel_size));
  reply.set_pipeline_parallel_size(static_cast<std::uint32_t>(info_.pipeline_parallel_size));
  reply.set_quantization(info_.quantization);
  reply.set_weight_dtype(info_.weight_dtype);
  reply.set_kv_cache_dtype(info_.kv_cache_dtype);
  reply.set_max_input_len(static_cast<std::uint32_t>(info_.max_input_len));
  reply.set_max_batch_size(static_cast<std::uint32_t>(info_.max_batch_size));
  reply.set_max_num_tokens(static_cast<std::uint32_t>(info_.max_num_tokens));
  // What this worker passes on to its engine: the sampled token's log probability (no
  // top-n alternatives), one sample per request, and the structured output the engine
  // was configured for.
  auto* caps = reply.mutable_capabilities();
  caps->set_max_logprobs(0);
  caps->set_max_n(1);
  for (const auto& kind : info_.structured_output) caps->add_structured_output(kind);
  // It takes resume_token_ids; no constraint kind resumes (see translate.cc).
  caps->set_resume_tokens(true);
  // Chunks at GenerateRequest.stream_interval's cadence, whatever the engine (ChunkCadence).
  caps->set_stream_interval(true);
  caps->set_lora(info_.lora);
  caps->set_max_loras(static_cast<std::uint32_t>(info_.max_loras));
  caps->set_max_lora_rank(static_cast<std::uint32_t>(info_.max_lora_rank));
  caps->set_beam_search(info_.max_beam_width > 1);
  caps->set_max_beam_width(static_cast<std::uint32_t>(info_.max_beam_width > 1 ? info_.max_beam_width : 0));
  for (const auto& a : adapters_.list()) fill_adapter(a, reply.add_adapters());
  reply.set_kv_events(kv_hub_.enabled());
  // Known only once the engine has run where the engine sizes its cache at start-up.
  std::int32_t blocks = info_.kv_blocks_total;
  try {
    if (blocks == 0) {
      if (auto s = executor_.latest_stats()) blocks = s->kv_blocks_max;  // no lock held
    }
    const GpuMemory memory = executor_.gpu_memory();
    reply.set_gpu_memory_used_bytes(memory.used_bytes);
    reply.set_gpu_memory_total_bytes(memory.total_bytes);
  } catch (const std::exception&) {
    // The engine is going away; the static facts still answer.
  }
  reply.set_kv_blocks_total(static_cast<std::uint32_t>(std::max(0, blocks)));
  finish_unary(reactor, reply, response);
  return reactor;
}

void fill_adapter(const AdapterInfo& a, wv1::AdapterInfo* out) {
  out->set_name(a.name);
  out->set_path(a.path);
  out->set_rank(static_cast<std::uint32_t>(a.rank));
  out->set_in_flight(static_cast<std::uint32_t>(a.in_flight));
}

grpc::ServerUnaryReactor* WorkerService::LoadAdapter(grpc::CallbackServerContext* context,
                                                     const Bytes* body, Bytes* response) {
  auto* reactor = context->DefaultReactor();
  wv1::LoadAdapterRequest request;
  const char* method = "/switchyard.worker.v1.Worker/LoadAdapter";
  if (!parse_unary(context, method, *body, &request, reactor)) return reactor;
  // Reading the adapter takes a while; off the gRPC thread, like UnloadAdapter's wait.
  run_off_thread([this, request = std::move(request), response, reactor] {
    AdapterRefusal why;
    auto loaded = adapters_.load(request.name(), request.path(), &why);
    if (!loaded) {
      reactor->Finish(field_status(adapter_code(why), why.field, why.message));
      return;
    }
    wv1::LoadAdapterResponse reply;
    fill_adapter(*loaded, reply.mutable_adapter());
    finish_unary(reactor, reply, response);
  });
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::UnloadAdapter(grpc::CallbackServerContext* context,
                                                       const Bytes* body, Bytes* response) {
  auto* reactor = context->DefaultReactor();
  wv1::UnloadAdapterRequest request;
  const char* method = "/switchyard.worker.v1.Worker/UnloadAdapter";
  if (!parse_unary(context, method, *body, &request, reactor)) return reactor;
  if (!info_.lora) {
    reactor->Finish(field_status(grpc::StatusCode::FAILED_PRECONDITION, "name",
                                 "this engine was started without LoRA; it holds no adapters"));
    return reactor;
  }
  run_off_thread([this, request = std::move(request), response, reactor] {
    auto done = adapters_.unload(request.name(), std::chrono::milliseconds(request.grace_ms()));
    if (!done) {
      reactor->Finish(field_status(grpc::StatusCode::NOT_FOUND, "name",
                                   "adapter " + request.name() + " is not loaded"));
      return;
    }
    wv1::UnloadAdapterResponse reply;
    reply.set_waited_requests(done->first);
    reply.set_cancelled_requests(done->second);
    finish_unary(reactor, reply, response);
  });
  return reactor;
}

void WorkerService::run_off_thread(std::function<void()> work) {
  std::vector<std::thread> finished;
  {
    std::lock_guard<std::mutex> lock(admin_mu_);
    for (auto it = admin_threads_.begin(); it != admin_threads_.end();) {
      if (it->done->load()) {
        finished.push_back(std::move(it->thread));
        it = admin_threads_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    admin_threads_.push_back(AdminThread{std::thread([work = std::move(work), done] {
                                           work();
                                           done->store(true);
                                         }),
                                         done});
  }
  for (auto& t : finished) t.join();  // no lock held; each has returned already
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WorkerService::SubscribeKvEvents(
    grpc::CallbackServerContext* context, const Bytes* body) {
  wv1::SubscribeKvEventsRequest request;
  auto parsed =
      parse_request(context, "/switchyard.worker.v1.Worker/SubscribeKvEvents", *body, &request);
  if (!parsed.ok()) return finished_writer(std::move(parsed));
  return kv_hub_.subscribe();
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WorkerService::StreamLoad(
    grpc::CallbackServerContext* context, const Bytes* body) {
  wv1::StreamLoadRequest request;
  auto parsed = parse_request(context, "/switchyard.worker.v1.Worker/StreamLoad", *body, &request);
  if (!parsed.ok()) return finished_writer(std::move(parsed));
  const std::uint32_t ms = request.interval_ms() ? request.interval_ms() : 500;
  auto interval = std::chrono::milliseconds(std::clamp<std::uint32_t>(ms, 10, 60000));
  auto reactor = std::make_shared<LoadReactor>(*this, interval);
  reactor->attach(reactor);
  {
    std::lock_guard<std::mutex> lock(load_mu_);
    load_streams_.push_back(reactor);
  }
  return reactor.get();
}

void WorkerService::remove_load_stream(LoadStream* stream) {
  std::lock_guard<std::mutex> lock(load_mu_);
  load_streams_.erase(std::remove_if(load_streams_.begin(), load_streams_.end(),
                                     [&](const auto& s) { return s.get() == stream; }),
                      load_streams_.end());
}

void WorkerService::ticker() {
  std::vector<std::shared_ptr<LoadStream>> streams;
  while (!stop_ticker_.load()) {
    {
      std::lock_guard<std::mutex> lock(load_mu_);
      streams = load_streams_;
    }
    const auto now = std::chrono::steady_clock::now();
    for (auto& s : streams) s->tick(now);  // no lock held
    streams.clear();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

WorkerService::~WorkerService() {
  stop_ticker_.store(true);
  if (ticker_.joinable()) ticker_.join();
  std::vector<AdminThread> threads;
  {
    std::lock_guard<std::mutex> lock(admin_mu_);
    threads.swap(admin_threads_);
  }
  for (auto& t : threads) {
    if (t.thread.joinable()) t.thread.join();
  }
}

void WorkerService::fill_load(wv1::LoadReport* report) {
  report->Clear();
  const auto in_flight = static_cast<std::int32_t>(dispatcher_.in_flight());
  report->set_in_flight(static_cast<std::uint32_t>(in_flight));
  if (auto s = executor_.latest_stats()) {
    // Iteration stats lag a request that just ended; never report more than is in flight.
    const auto running = std::min(s->active_requests, in_flight);
    report->set_running(static_cast<std::uint32_t>(running));
    report->set_waiting(static_cast<std::uint32_t>(
        std::max(0, std::min(s->queued_requests, in_flight - running))));
    report->set_kv_blocks_used(static_cast<std::uint32_t>(s->kv_blocks_used));
    report->set_kv_blocks_free(static_cast<std::uint32_t>(s->kv_blocks_free));
    if (s->kv_blocks_max > 0) {
      report->set_kv_cache_usage(static_cast<float>(s->kv_blocks_used) /
                                 static_cast<float>(s->kv_blocks_max));
    }
    std::lock_guard<std::mutex> lock(rate_mu_);
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - rate_at_).count();
    if (dt >= 0.5 || rate_at_ == Clock::time_point{}) {
      if (rate_at_ != Clock::time_point{} && dt > 0) {
        rate_ = static_cast<double>(s->generated_tokens_total - rate_tokens_) / dt;
      }
      rate_at_ = now;
      rate_tokens_ = s->generated_tokens_total;
    }
    report->set_generation_tokens_per_s(rate_);
  } else if (info_.kv_blocks_total > 0) {
    // No engine step yet: every block is free (not "0 free", which reads as full).
    report->set_kv_blocks_free(static_cast<std::uint32_t>(info_.kv_blocks_total));
  }
  try {
    report->set_gpu_memory_used_bytes(executor_.gpu_memory().used_bytes);
  } catch (const std::exception&) {
    // No reading this time (a CUDA error, say); the report goes out without it.
  }
  report->set_timestamp_s(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
}

}  // namespace switchyard::rt
