// The callback server in-process with the simulator behind it, over real gRPC: the fixture
// the worker service tests share.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "dispatcher.h"
#include "sim_executor.h"
#include "worker_service.h"

namespace switchyard::rt::test_support {

using wv1::Worker;

// The simulator behind a counter of the calls the server makes, so a test can tell that a
// request never reached the engine, or was cancelled exactly once.
class CountingExecutor final : public Executor {
 public:
  explicit CountingExecutor(Executor& inner) : inner_(inner) {}
  RequestId enqueue(const GenRequest& request) override {
    enqueues.fetch_add(1);
    return inner_.enqueue(request);
  }
  std::vector<GenResponse> await_responses(std::chrono::milliseconds timeout) override {
    return inner_.await_responses(timeout);
  }
  void cancel(RequestId id) override {
    cancels.fetch_add(1);
    inner_.cancel(id);
  }
  std::optional<IterationStats> latest_stats() override { return inner_.latest_stats(); }
  bool can_enqueue() const override { return inner_.can_enqueue(); }
  EngineInfo info() const override { return inner_.info(); }
  void shutdown() override { inner_.shutdown(); }

  std::atomic<int> enqueues{0};
  std::atomic<int> cancels{0};

 private:
  Executor& inner_;
};

// Polls `done` until it holds or `within` has passed; returns its last value.
inline bool eventually(const std::function<bool()>& done,
                std::chrono::milliseconds within = std::chrono::milliseconds(2000)) {
  const auto until = std::chrono::steady_clock::now() + within;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return done();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Every event of a GenerateStream call, by attempt, read until the server ends the call.
struct StreamLog {
  std::map<std::uint64_t, std::vector<wv1::StreamEvent>> events;
  bool ended(std::uint64_t a) const {
    auto it = events.find(a);
    return it != events.end() && !it->second.back().has_chunk();
  }
  std::size_t tokens(std::uint64_t a) const {
    std::size_t n = 0;
    if (auto it = events.find(a); it != events.end()) {
      for (const auto& e : it->second) n += static_cast<std::size_t>(e.chunk().token_ids_size());
    }
    return n;
  }
  void add(const wv1::StreamResponse& msg) {
    for (const auto& e : msg.events()) events[e.attempt_id()].push_back(e);
  }
};

using BidiStream = grpc::ClientReaderWriter<wv1::StreamRequest, wv1::StreamResponse>;

// Reads until `done` holds (true) or the stream ends (false).
inline bool read_until(BidiStream* stream, StreamLog* log, const std::function<bool()>& done) {
  wv1::StreamResponse msg;
  while (!done()) {
    if (!stream->Read(&msg)) return false;
    log->add(msg);
  }
  return true;
}

class WorkerServiceTest : public ::testing::Test {
 protected:
  void start(SimConfig c) {
    sim_ = std::make_unique<SimExecutor>(c);
    engine_ = std::make_unique<CountingExecutor>(*sim_);
    dispatcher_ = std::make_unique<Dispatcher>(*engine_);
    service_ = std::make_unique<WorkerService>(*engine_, *dispatcher_);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_GT(port_, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = Worker::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (dispatcher_) dispatcher_->stop();
    if (sim_) sim_->shutdown();
  }
  static SimConfig config(double step_us = 200) {
    SimConfig c;
    c.vocab_size = 1000;
    c.max_context = 8192;
    c.decode_step_us = step_us;
    c.decode_us_per_request = 0;
    c.prefill_us_per_token = 0;
    return c;
  }
  static wv1::GenerateRequest gen(int max_tokens, const std::string& id = "") {
    wv1::GenerateRequest r;
    r.set_request_id(id);
    for (int t : {11, 12, 13}) r.add_prompt_token_ids(t);
    r.set_max_tokens(max_tokens);
    r.set_ignore_eos(true);
    return r;
  }
  struct Stream {
    std::vector<std::uint32_t> tokens;
    int chunks = 0;
    int finals = 0;
    wv1::Final final;
    grpc::Status status;
  };
  Stream read_all(grpc::ClientContext* ctx, const wv1::GenerateRequest& req,
                  std::chrono::milliseconds pause_after_first = std::chrono::milliseconds(0),
                  Worker::Stub* stub = nullptr) {
    Stream s;
    auto reader = (stub ? stub : stub_.get())->Generate(ctx, req);
    wv1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      EXPECT_EQ(s.finals, 0) << "message after the final";
      if (msg.has_chunk()) {
        ++s.chunks;
        for (auto t : msg.chunk().token_ids()) s.tokens.push_back(t);
        if (s.chunks == 1) std::this_thread::sleep_for(pause_after_first);
      } else {
        ++s.finals;
        s.final = msg.final();
      }
    }
    s.status = reader->Finish();
    return s;
  }
  static wv1::GenerateRequest attempt(std::uint64_t attempt_id, int max_tokens,
                                      const std::string& request_id = "") {
    auto r = gen(max_tokens, request_id);
    r.set_attempt_id(attempt_id);
    return r;
  }
  // A GenerateStream call with `first` started on it, read into `log` until that attempt
  // has tokens (false: the stream ended first).
  bool stream_with_tokens(grpc::ClientContext* ctx, const wv1::GenerateRequest& first,
                          StreamLog* log, std::unique_ptr<BidiStream>* stream) {
    *stream = stub_->GenerateStream(ctx);
    wv1::StreamRequest start;
    *start.add_start() = first;
    return (*stream)->Write(start) &&
           read_until(stream->get(), log, [&] { return log->tokens(first.attempt_id()) > 0; });
  }
  int running() {
    wv1::LoadReport r;
    service_->fill_load(&r);
    return static_cast<int>(r.running());
  }
  // Nothing left anywhere: no stream or attempt open, nothing in the dispatcher or engine.
  bool idle() {
    auto s = sim_->latest_stats();
    return service_->live_streams() == 0 && dispatcher_->in_flight() == 0 &&
           (!s || (s->active_requests == 0 && s->queued_requests == 0));
  }

  std::unique_ptr<SimExecutor> sim_;
  std::unique_ptr<CountingExecutor> engine_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Worker::Stub> stub_;
  int port_ = 0;
};

}  // namespace switchyard::rt::test_support
