// The callback server in-process, with the simulator behind it, over real gRPC.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "dispatcher.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "sim_executor.h"
#include "worker_service.h"

namespace switchyard::rt {
namespace {

using wv1::Worker;

class WorkerServiceTest : public ::testing::Test {
 protected:
  void start(SimConfig c) {
    sim_ = std::make_unique<SimExecutor>(c);
    dispatcher_ = std::make_unique<Dispatcher>(*sim_);
    service_ = std::make_unique<WorkerService>(*sim_, *dispatcher_);
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
  int running() {
    wv1::LoadReport r;
    service_->fill_load(&r);
    return static_cast<int>(r.running());
  }

  std::unique_ptr<SimExecutor> sim_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Worker::Stub> stub_;
  int port_ = 0;
};

TEST_F(WorkerServiceTest, StreamsTokensThenExactlyOneFinal) {
  start(config());
  grpc::ClientContext ctx;
  auto s = read_all(&ctx, gen(40));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.finals, 1);
  ASSERT_EQ(s.tokens.size(), 40u);
  EXPECT_EQ(s.final.finish_reason(), ::switchyard::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(s.final.usage().completion_tokens(), 40u);
  EXPECT_EQ(s.final.usage().prompt_tokens(), 3u);
  EXPECT_GT(s.final.time_to_first_token_ms(), 0);
  const auto h = SimExecutor::hash_tokens({11, 12, 13});
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(s.tokens[i], static_cast<std::uint32_t>(SimExecutor::token_at(h, 0, i, 1000)));
  }
}

TEST_F(WorkerServiceTest, SlowClientGetsCoalescedMessagesAndBlocksNobody) {
  start(config(50));
  // A tiny HTTP/2 window, so the server's writes stall while the client does not read.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto slow_channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                                grpc::InsecureChannelCredentials(), args);
  auto slow_stub = Worker::NewStub(slow_channel);
  Stream slow;
  std::thread slow_reader([&] {
    grpc::ClientContext ctx;
    slow = read_all(&ctx, gen(3000, "slow"), std::chrono::milliseconds(800), slow_stub.get());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Meanwhile another stream runs at full speed.
  auto t0 = std::chrono::steady_clock::now();
  grpc::ClientContext ctx;
  auto fast = read_all(&ctx, gen(200, "fast"));
  auto fast_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  slow_reader.join();
  ASSERT_TRUE(fast.status.ok());
  EXPECT_EQ(fast.tokens.size(), 200u);
  EXPECT_LT(fast_ms, 700) << "the fast stream waited for the slow one";
  ASSERT_TRUE(slow.status.ok()) << slow.status.error_message();
  EXPECT_EQ(slow.tokens.size(), 3000u);
  EXPECT_EQ(slow.final.usage().completion_tokens(), 3000u);
  EXPECT_LT(slow.chunks, 1500) << "tokens were not coalesced while the write was pending";
}

TEST_F(WorkerServiceTest, ClientCancelCancelsTheEngineRequest) {
  start(config(1000));
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, gen(5000));
  wv1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  EXPECT_EQ(running(), 1);
  ctx.TryCancel();
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (running() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(running(), 0);
  EXPECT_EQ(sim_->latest_stats()->active_requests, 0);
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(WorkerServiceTest, AbortByIdEndsWithCancelled) {
  start(config(1000));
  Stream s;
  std::thread t([&] {
    grpc::ClientContext ctx;
    s = read_all(&ctx, gen(5000, "to-abort"));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  grpc::ClientContext actx;
  wv1::AbortRequest areq;
  areq.add_request_ids("to-abort");
  areq.add_request_ids("unknown");
  wv1::AbortResponse aresp;
  ASSERT_TRUE(stub_->Abort(&actx, areq, &aresp).ok());
  EXPECT_EQ(aresp.aborted(), 1u);
  t.join();
  EXPECT_TRUE(s.status.ok());
  EXPECT_EQ(s.finals, 1);
  EXPECT_EQ(s.final.finish_reason(), ::switchyard::v1::FINISH_REASON_CANCELLED);
  EXPECT_LT(s.tokens.size(), 5000u);
}

TEST_F(WorkerServiceTest, DeadlineEndsWithTimeLimitBeforeItExpires) {
  start(config(2000));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  auto s = read_all(&ctx, gen(5000));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.final.finish_reason(), ::switchyard::v1::FINISH_REASON_TIME_LIMIT);
  EXPECT_GT(s.tokens.size(), 0u);
  EXPECT_EQ(running(), 0);
}

TEST_F(WorkerServiceTest, InvalidInputIsInvalidArgumentNamingTheField) {
  start(config());
  grpc::ClientContext ctx;
  auto req = gen(10);
  req.add_prompt_token_ids(5000);
  auto s = read_all(&ctx, req);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.status.error_message().find("prompt_token_ids[3]"), std::string::npos);
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(s.status.error_details()));
  google::rpc::BadRequest bad;
  ASSERT_TRUE(details.details(0).UnpackTo(&bad));
  EXPECT_EQ(bad.field_violations(0).field(), "prompt_token_ids[3]");
  // Still serving.
  grpc::ClientContext ok_ctx;
  EXPECT_TRUE(read_all(&ok_ctx, gen(3)).status.ok());
}

TEST_F(WorkerServiceTest, GetInfoAndStreamLoad) {
  start(config(1000));
  grpc::ClientContext ictx;
  wv1::GetInfoResponse info;
  ASSERT_TRUE(stub_->GetInfo(&ictx, wv1::GetInfoRequest(), &info).ok());
  EXPECT_EQ(info.engine(), "sim");
  EXPECT_EQ(info.vocab_size(), 1000u);
  EXPECT_EQ(info.max_context(), 8192u);
  ASSERT_EQ(info.eos_token_ids_size(), 1);

  grpc::ClientContext gctx;
  auto gen_reader = stub_->Generate(&gctx, gen(5000));
  wv1::GenerateResponse msg;
  ASSERT_TRUE(gen_reader->Read(&msg));

  grpc::ClientContext lctx;
  wv1::StreamLoadRequest lreq;
  lreq.set_interval_ms(20);
  auto load = stub_->StreamLoad(&lctx, lreq);
  wv1::LoadReport report;
  int reports = 0;
  bool saw_running = false;
  while (reports < 5 && load->Read(&report)) {
    ++reports;
    saw_running = saw_running || report.running() == 1;
  }
  EXPECT_EQ(reports, 5);
  EXPECT_TRUE(saw_running);
  EXPECT_GT(report.kv_blocks_used(), 0u);
  lctx.TryCancel();
  load->Finish();
  gctx.TryCancel();
  gen_reader->Finish();
}

// GenerateStream: several requests on one stream, their events batched into shared
// messages; a draining worker refuses new starts with an error event, not a dead stream.
TEST_F(WorkerServiceTest, GenerateStreamBatchesRequestsAndRefusesWhileDraining) {
  start(config(500));
  grpc::ClientContext ctx;
  auto stream = stub_->GenerateStream(&ctx);
  wv1::StreamRequest starts;
  for (int i = 0; i < 8; ++i) *starts.add_start() = gen(30, "s" + std::to_string(i));
  *starts.add_start() = gen(0, "bad");
  ASSERT_TRUE(stream->Write(starts));
  std::map<std::string, std::vector<std::uint32_t>> tokens;
  std::map<std::string, wv1::StreamEvent> ends;
  int messages = 0;
  wv1::StreamResponse msg;
  while (ends.size() < 9 && stream->Read(&msg)) {
    ++messages;
    for (const auto& e : msg.events()) {
      EXPECT_EQ(ends.count(e.request_id()), 0u) << "an event after the end";
      if (e.has_chunk()) {
        for (auto t : e.chunk().token_ids()) tokens[e.request_id()].push_back(t);
      } else {
        ends[e.request_id()] = e;
      }
    }
  }
  ASSERT_EQ(ends.size(), 9u);
  EXPECT_EQ(ends["bad"].error().code(), static_cast<std::uint32_t>(grpc::INVALID_ARGUMENT));
  EXPECT_NE(ends["bad"].error().message().find("max_tokens"), std::string::npos);
  const auto h = SimExecutor::hash_tokens({11, 12, 13});
  for (int i = 0; i < 8; ++i) {
    const auto name = "s" + std::to_string(i);
    ASSERT_TRUE(ends[name].has_final());
    EXPECT_EQ(ends[name].final().usage().completion_tokens(), 30u);
    ASSERT_EQ(tokens[name].size(), 30u);
    EXPECT_EQ(tokens[name][29], static_cast<std::uint32_t>(SimExecutor::token_at(h, 0, 29, 1000)));
  }
  EXPECT_LT(messages, 8 * 30 / 2);  // one message carries many requests' tokens
  EXPECT_EQ(running(), 0);

  service_->start_drain();
  wv1::StreamRequest late;
  *late.add_start() = gen(5, "late");
  ASSERT_TRUE(stream->Write(late));
  ASSERT_TRUE(stream->Read(&msg));
  ASSERT_EQ(msg.events_size(), 1);
  EXPECT_EQ(msg.events(0).error().code(), static_cast<std::uint32_t>(grpc::UNAVAILABLE));
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&msg));
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace switchyard::rt
