// The callback server in-process, with the simulator behind it, over real gRPC.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "worker_fixture.h"

namespace switchyard::rt {
namespace {

using namespace switchyard::rt::test_support;  // NOLINT: the shared fixture

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
  // The worker's count drops when the stream ends; the engine's own count at its next step.
  const auto engine_active = [&] { return sim_->latest_stats()->active_requests; };
  EXPECT_TRUE(eventually([&] { return running() == 0 && engine_active() == 0; }));
  EXPECT_EQ(running(), 0);
  EXPECT_EQ(engine_active(), 0);
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(WorkerServiceTest, AbortByIdEndsWithCancelled) {
  start(config(1000));
  Stream s;
  std::thread t([&] {
    grpc::ClientContext ctx;
    s = read_all(&ctx, gen(5000, "to-abort"));
  });
  EXPECT_TRUE(eventually([&] { return running() == 1; })) << "the stream never started";
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
  for (int i = 1; i <= 8; ++i) *starts.add_start() = attempt(i, 30, "s" + std::to_string(i));
  constexpr std::uint64_t kBad = 9;
  *starts.add_start() = attempt(kBad, 0, "bad");
  ASSERT_TRUE(stream->Write(starts));
  std::map<std::uint64_t, std::vector<std::uint32_t>> tokens;
  std::map<std::uint64_t, wv1::StreamEvent> ends;
  int messages = 0;
  wv1::StreamResponse msg;
  while (ends.size() < 9 && stream->Read(&msg)) {
    ++messages;
    for (const auto& e : msg.events()) {
      EXPECT_EQ(ends.count(e.attempt_id()), 0u) << "an event after the end";
      if (e.has_chunk()) {
        for (auto t : e.chunk().token_ids()) tokens[e.attempt_id()].push_back(t);
      } else {
        ends[e.attempt_id()] = e;
      }
    }
  }
  ASSERT_EQ(ends.size(), 9u);
  const auto& bad = ends[kBad].error();
  EXPECT_EQ(bad.code(), static_cast<std::uint32_t>(grpc::INVALID_ARGUMENT));
  EXPECT_NE(bad.message().find("max_tokens"), std::string::npos);
  ASSERT_EQ(bad.field_violations_size(), 1);
  EXPECT_EQ(bad.field_violations(0).field(), "max_tokens");
  const auto h = SimExecutor::hash_tokens({11, 12, 13});
  for (std::uint64_t a = 1; a <= 8; ++a) {
    ASSERT_TRUE(ends[a].has_final());
    EXPECT_EQ(ends[a].final().usage().completion_tokens(), 30u);
    ASSERT_EQ(tokens[a].size(), 30u);
    EXPECT_EQ(tokens[a][29], static_cast<std::uint32_t>(SimExecutor::token_at(h, 0, 29, 1000)));
  }
  EXPECT_LT(messages, 8 * 30 / 2);  // one message carries many requests' tokens
  EXPECT_EQ(running(), 0);

  service_->start_drain();
  wv1::StreamRequest late;
  *late.add_start() = attempt(10, 5, "late");
  ASSERT_TRUE(stream->Write(late));
  ASSERT_TRUE(stream->Read(&msg));
  ASSERT_EQ(msg.events_size(), 1);
  EXPECT_EQ(msg.events(0).attempt_id(), 10u);
  EXPECT_EQ(msg.events(0).error().code(), static_cast<std::uint32_t>(grpc::UNAVAILABLE));
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&msg));
  EXPECT_TRUE(stream->Finish().ok());
}

// The same message starts and cancels an attempt, 20 times: none of them reaches the
// engine or sends anything; 20 fresh attempts with the same request ids then all finish.
TEST_F(WorkerServiceTest, GenerateStreamStartCancelledInTheSameMessageNeverStarts) {
  start(config(200));
  grpc::ClientContext ctx;
  auto stream = stub_->GenerateStream(&ctx);
  for (std::uint64_t k = 1; k <= 20; ++k) {
    wv1::StreamRequest both;
    *both.add_start() = attempt(k, 50, "r" + std::to_string(k));
    both.add_cancel(k);
    ASSERT_TRUE(stream->Write(both));
  }
  for (std::uint64_t k = 1; k <= 20; ++k) {
    wv1::StreamRequest fresh;
    *fresh.add_start() = attempt(100 + k, 20, "r" + std::to_string(k));
    ASSERT_TRUE(stream->Write(fresh));
  }
  StreamLog log;
  ASSERT_TRUE(read_until(stream.get(), &log, [&] {
    for (std::uint64_t k = 1; k <= 20; ++k) {
      if (!log.ended(100 + k)) return false;
    }
    return true;
  }));
  stream->WritesDone();
  ASSERT_FALSE(read_until(stream.get(), &log, [] { return false; }));  // to the end
  EXPECT_TRUE(stream->Finish().ok());
  for (std::uint64_t k = 1; k <= 20; ++k) {
    EXPECT_EQ(log.events.count(k), 0u) << "attempt " << k << " was cancelled with its start";
    const auto& last = log.events[100 + k].back();
    ASSERT_TRUE(last.has_final()) << "attempt " << 100 + k;
    EXPECT_EQ(last.final().finish_reason(), ::switchyard::v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(log.tokens(100 + k), 20u);
  }
  EXPECT_EQ(engine_->enqueues.load(), 20);  // the fresh ones only
  EXPECT_EQ(engine_->cancels.load(), 0);
  EXPECT_TRUE(eventually([&] { return idle(); }));
}

// One message cancels attempt 1 and starts attempt 2 under the same request id: the
// cancel is for attempt 1 only, and attempt 2 runs to its end.
TEST_F(WorkerServiceTest, GenerateStreamHandlesCancelsBeforeStarts) {
  start(config(500));
  grpc::ClientContext ctx;
  std::unique_ptr<BidiStream> stream;
  StreamLog log;
  ASSERT_TRUE(stream_with_tokens(&ctx, attempt(1, 5000, "same"), &log, &stream));
  wv1::StreamRequest swap;
  swap.add_cancel(1);
  *swap.add_start() = attempt(2, 10, "same");
  ASSERT_TRUE(stream->Write(swap));
  ASSERT_TRUE(read_until(stream.get(), &log, [&] { return log.ended(2); }));
  stream->WritesDone();
  ASSERT_FALSE(read_until(stream.get(), &log, [] { return false; }));
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_FALSE(log.ended(1)) << "a cancelled attempt sends nothing after its cancel";
  EXPECT_LT(log.tokens(1), 5000u);
  ASSERT_TRUE(log.events[2].back().has_final());
  EXPECT_EQ(log.events[2].back().final().finish_reason(), ::switchyard::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(log.tokens(2), 10u);
  EXPECT_EQ(engine_->enqueues.load(), 2);
  EXPECT_EQ(engine_->cancels.load(), 1);
  EXPECT_TRUE(eventually([&] { return idle(); }));
}

// request_id is for logs only on the stream: open attempts may share one.
TEST_F(WorkerServiceTest, GenerateStreamAttemptsMayShareARequestId) {
  start(config(200));
  grpc::ClientContext ctx;
  auto stream = stub_->GenerateStream(&ctx);
  wv1::StreamRequest both;
  *both.add_start() = attempt(5, 30, "shared");
  *both.add_start() = attempt(6, 30, "shared");
  ASSERT_TRUE(stream->Write(both));
  StreamLog log;
  ASSERT_TRUE(read_until(stream.get(), &log, [&] { return log.ended(5) && log.ended(6); }));
  for (std::uint64_t a : {5u, 6u}) {
    ASSERT_TRUE(log.events[a].back().has_final()) << "attempt " << a;
    EXPECT_EQ(log.tokens(a), 30u);
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(WorkerServiceTest, GenerateStreamRefusesAttemptIdZeroNamingTheField) {
  start(config());
  grpc::ClientContext ctx;
  auto stream = stub_->GenerateStream(&ctx);
  wv1::StreamRequest req;
  *req.add_start() = attempt(0, 5, "no-attempt");
  ASSERT_TRUE(stream->Write(req));
  wv1::StreamResponse msg;
  ASSERT_TRUE(stream->Read(&msg));
  ASSERT_EQ(msg.events_size(), 1);
  const auto& e = msg.events(0);
  EXPECT_EQ(e.attempt_id(), 0u);
  ASSERT_TRUE(e.has_error());
  EXPECT_EQ(e.error().code(), static_cast<std::uint32_t>(grpc::INVALID_ARGUMENT));
  EXPECT_NE(e.error().message().find("attempt_id"), std::string::npos) << e.error().message();
  ASSERT_EQ(e.error().field_violations_size(), 1);
  EXPECT_EQ(e.error().field_violations(0).field(), "attempt_id");
  EXPECT_EQ(engine_->enqueues.load(), 0);
  stream->WritesDone();
  EXPECT_FALSE(stream->Read(&msg));
  EXPECT_TRUE(stream->Finish().ok());
}

// A start reusing an open attempt id: ALREADY_EXISTS, the engine never sees it, and the
// open attempt goes on unharmed.
TEST_F(WorkerServiceTest, GenerateStreamRefusesAnOpenAttemptIdBeforeEnqueueing) {
  start(config(500));
  grpc::ClientContext ctx;
  std::unique_ptr<BidiStream> stream;
  StreamLog log;
  ASSERT_TRUE(stream_with_tokens(&ctx, attempt(7, 200, "a"), &log, &stream));
  wv1::StreamRequest again;
  *again.add_start() = attempt(7, 5, "b");
  ASSERT_TRUE(stream->Write(again));
  ASSERT_TRUE(read_until(stream.get(), &log, [&] {
    auto it = log.events.find(7);
    return it != log.events.end() && it->second.back().has_final();
  }));
  int errors = 0;
  for (const auto& e : log.events[7]) {
    if (!e.has_error()) continue;
    ++errors;
    EXPECT_EQ(e.error().code(), static_cast<std::uint32_t>(grpc::ALREADY_EXISTS));
  }
  EXPECT_EQ(errors, 1);
  EXPECT_EQ(log.tokens(7), 200u);
  EXPECT_EQ(log.events[7].back().final().usage().completion_tokens(), 200u);
  EXPECT_EQ(engine_->enqueues.load(), 1);
  EXPECT_EQ(engine_->cancels.load(), 0);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A Generate stream that ends before its request cancels the engine request, once.
TEST_F(WorkerServiceTest, GenerateClientCancelCancelsTheEngineRequestOnce) {
  start(config(1000));
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, gen(5000, "cancel-me"));
  wv1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(eventually([&] { return idle(); }));
  EXPECT_EQ(engine_->cancels.load(), 1);
}

// The client goes away while a write is stalled on flow control: the write fails and the
// call is cancelled; the engine request is cancelled exactly once.
TEST_F(WorkerServiceTest, GenerateClientGoneMidWriteCancelsTheEngineRequestOnce) {
  start(config(50));
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  {
    auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                             grpc::InsecureChannelCredentials(), args);
    auto stub = Worker::NewStub(channel);
    grpc::ClientContext ctx;
    auto reader = stub->Generate(&ctx, gen(5000, "gone"));
    wv1::GenerateResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the window fills up
    ctx.TryCancel();
    reader->Finish();
  }  // and the channel closes
  EXPECT_TRUE(eventually([&] { return idle(); }));
  EXPECT_EQ(engine_->cancels.load(), 1);
}

// The reactor's reactions driven directly (CallbackServerContext's public constructor is for
// this), in an order gRPC allows: a failed write ends the stream, the call finishes
// CANCELLED, then OnCancel and OnDone. The engine request is cancelled as soon as the
// write fails, and only once; OnCancel alone (which real clients happen to trigger too)
// must not be what frees the engine.
TEST_F(WorkerServiceTest, GenerateEndedByAFailedWriteCancelsTheEngineRequestOnce) {
  start(config(1000));
  grpc::CallbackServerContext ctx;
  grpc::ByteBuffer req;
  ASSERT_TRUE(serialize(gen(5000, "write-fails"), &req).ok());
  auto* reactor = service_->Generate(&ctx, &req);
  ASSERT_TRUE(eventually([&] {
    auto s = sim_->latest_stats();
    return s && s->generated_tokens_total >= 2;
  }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a write has been started
  reactor->OnWriteDone(false);
  EXPECT_EQ(engine_->cancels.load(), 1) << "the failed write did not cancel the engine request";
  reactor->OnCancel();
  reactor->OnDone();
  EXPECT_TRUE(eventually([&] { return idle(); }));
  EXPECT_EQ(engine_->cancels.load(), 1);
}

// A second Generate with a request id in flight is refused before it reaches the engine.
TEST_F(WorkerServiceTest, GenerateDuplicateRequestIdNeverEnqueues) {
  start(config(1000));
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, gen(5000, "dup"));
  wv1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  grpc::ClientContext dup_ctx;
  auto dup = read_all(&dup_ctx, gen(5, "dup"));
  EXPECT_EQ(dup.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(dup.status.error_message().find("dup"), std::string::npos);
  EXPECT_EQ(engine_->enqueues.load(), 1);
  EXPECT_EQ(engine_->cancels.load(), 0);
  ctx.TryCancel();
  reader->Finish();
  EXPECT_TRUE(eventually([&] { return idle(); }));
  // The id is free again once its request is over.
  grpc::ClientContext again_ctx;
  EXPECT_TRUE(read_all(&again_ctx, gen(3, "dup")).status.ok());
}

}  // namespace
}  // namespace switchyard::rt
