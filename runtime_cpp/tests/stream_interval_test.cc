// GenerateRequest.stream_interval over real gRPC, on Generate and GenerateStream: the first
// token at once, then a chunk whenever at least N tokens are unsent, the rest just before
// the Final. The simulator makes one token per step, and its steps are long enough that
// every chunk is written before the next token comes (nothing coalesces behind a write).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "worker_fixture.h"

namespace switchyard::rt {
namespace {

using namespace switchyard::rt::test_support;  // NOLINT: the shared fixture

constexpr int kFinal = -1;  // in a message log: the Final

// What one Generate call sends: each chunk's size in order, kFinal for the Final.
struct GenerateLog {
  std::vector<int> messages;
  std::vector<std::uint32_t> tokens;
  wv1::Final final;
  grpc::Status status;
};

GenerateLog read_generate(Worker::Stub* stub, grpc::ClientContext* ctx,
                          const wv1::GenerateRequest& req) {
  GenerateLog log;
  auto reader = stub->Generate(ctx, req);
  wv1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (msg.has_chunk()) {
      log.messages.push_back(msg.chunk().token_ids_size());
      for (auto t : msg.chunk().token_ids()) log.tokens.push_back(t);
    } else {
      log.messages.push_back(kFinal);
      log.final = msg.final();
    }
  }
  log.status = reader->Finish();
  return log;
}

wv1::GenerateRequest with_interval(wv1::GenerateRequest r, std::uint32_t interval) {
  r.set_stream_interval(interval);
  return r;
}

class StreamIntervalTest : public WorkerServiceTest {
 protected:
  static constexpr double kStepUs = 30000;  // 30 ms a token

  // Waits until the simulator has generated `n` tokens in all.
  bool generated_at_least(std::uint64_t n) {
    return eventually([&] {
      auto s = sim_->latest_stats();
      return s && s->generated_tokens_total >= n;
    });
  }

  // The simulator's first `n` tokens for the fixture's prompt.
  static std::vector<std::uint32_t> expected_tokens(int n) {
    const auto h = SimExecutor::hash_tokens({11, 12, 13});
    std::vector<std::uint32_t> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(static_cast<std::uint32_t>(SimExecutor::token_at(h, 0, i, 1000)));
    }
    return out;
  }
};

TEST_F(StreamIntervalTest, GetInfoDeclaresTheCapability) {
  start(config());
  grpc::ClientContext ctx;
  wv1::GetInfoResponse info;
  ASSERT_TRUE(stub_->GetInfo(&ctx, wv1::GetInfoRequest(), &info).ok());
  EXPECT_TRUE(info.capabilities().stream_interval());
}

TEST_F(StreamIntervalTest, GenerateSendsTheFirstTokenThenEveryNAndTheRestBeforeTheFinal) {
  start(config(kStepUs));
  grpc::ClientContext ctx;
  auto log = read_generate(stub_.get(), &ctx, with_interval(gen(10), 4));
  ASSERT_TRUE(log.status.ok()) << log.status.error_message();
  EXPECT_EQ(log.messages, (std::vector<int>{1, 4, 4, 1, kFinal}));
  EXPECT_EQ(log.tokens, expected_tokens(10));
  EXPECT_EQ(log.final.finish_reason(), ::switchyard::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(log.final.usage().completion_tokens(), 10u);
  EXPECT_GT(log.final.time_to_first_token_ms(), 0);
}

TEST_F(StreamIntervalTest, GenerateWithIntervalZeroOrOneSendsEveryStep) {
  start(config(kStepUs));
  for (std::uint32_t interval : {0u, 1u}) {
    grpc::ClientContext ctx;
    auto log = read_generate(stub_.get(), &ctx, with_interval(gen(10), interval));
    ASSERT_TRUE(log.status.ok()) << log.status.error_message();
    std::vector<int> every_step(10, 1);
    every_step.push_back(kFinal);
    EXPECT_EQ(log.messages, every_step) << "stream_interval " << interval;
    EXPECT_EQ(log.tokens, expected_tokens(10));
    EXPECT_EQ(log.final.usage().completion_tokens(), 10u);
  }
}

// Aborted by id, a request ends with a CANCELLED Final: the tokens held back go out just
// before it, and usage counts exactly what was sent.
TEST_F(StreamIntervalTest, GenerateAbortedSendsTheTokensHeldBeforeItsFinal) {
  start(config(2000));
  GenerateLog log;
  std::thread reader([&] {
    grpc::ClientContext ctx;
    log = read_generate(stub_.get(), &ctx, with_interval(gen(5000, "held"), 1000));
  });
  ASSERT_TRUE(generated_at_least(20));
  grpc::ClientContext actx;
  wv1::AbortRequest abort;
  abort.add_request_ids("held");
  wv1::AbortResponse aborted;
  ASSERT_TRUE(stub_->Abort(&actx, abort, &aborted).ok());
  reader.join();
  ASSERT_TRUE(log.status.ok()) << log.status.error_message();
  EXPECT_EQ(aborted.aborted(), 1u);
  ASSERT_EQ(log.messages.size(), 3u);
  EXPECT_EQ(log.messages[0], 1);
  EXPECT_GE(log.messages[1], 19);
  EXPECT_LT(log.messages[1], 1000);
  EXPECT_EQ(log.messages[2], kFinal);
  EXPECT_EQ(log.final.finish_reason(), ::switchyard::v1::FINISH_REASON_CANCELLED);
  EXPECT_EQ(log.final.usage().completion_tokens(), log.tokens.size());
  EXPECT_EQ(log.tokens, expected_tokens(static_cast<int>(log.tokens.size())));
}

// A Generate call the client cancels while tokens are held: nothing more is sent, the call
// ends CANCELLED and the engine request is cancelled once.
TEST_F(StreamIntervalTest, GenerateCancelledWithTokensHeldSendsNothingMore) {
  start(config(2000));
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, with_interval(gen(5000), 1000));
  wv1::GenerateResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  EXPECT_EQ(msg.chunk().token_ids_size(), 1);
  ASSERT_TRUE(generated_at_least(20));
  ctx.TryCancel();
  EXPECT_FALSE(reader->Read(&msg));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(eventually([&] { return idle(); }));
  EXPECT_EQ(engine_->cancels.load(), 1);
}

// The sizes of an attempt's chunk events in order, kFinal for its Final.
std::vector<int> shape(const StreamLog& log, std::uint64_t attempt) {
  std::vector<int> out;
  for (const auto& e : log.events.at(attempt)) {
    out.push_back(e.has_chunk() ? e.chunk().token_ids_size() : kFinal);
  }
  return out;
}

// Each attempt on one GenerateStream keeps the cadence of its own stream_interval.
TEST_F(StreamIntervalTest, GenerateStreamAttemptsKeepTheirOwnCadences) {
  start(config(kStepUs));
  grpc::ClientContext ctx;
  auto stream = stub_->GenerateStream(&ctx);
  wv1::StreamRequest starts;
  *starts.add_start() = with_interval(attempt(1, 10, "four"), 4);
  *starts.add_start() = with_interval(attempt(2, 10, "two"), 2);
  *starts.add_start() = with_interval(attempt(3, 10, "every"), 0);
  ASSERT_TRUE(stream->Write(starts));
  StreamLog log;
  stream->WritesDone();
  ASSERT_FALSE(read_until(stream.get(), &log, [] { return false; }));  // to the end
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(shape(log, 1), (std::vector<int>{1, 4, 4, 1, kFinal}));
  EXPECT_EQ(shape(log, 2), (std::vector<int>{1, 2, 2, 2, 2, 1, kFinal}));
  EXPECT_EQ(shape(log, 3), (std::vector<int>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, kFinal}));
  for (std::uint64_t a : {1u, 2u, 3u}) {
    std::vector<std::uint32_t> tokens;
    for (const auto& e : log.events[a]) {
      tokens.insert(tokens.end(), e.chunk().token_ids().begin(), e.chunk().token_ids().end());
    }
    EXPECT_EQ(tokens, expected_tokens(10)) << "attempt " << a;
    EXPECT_EQ(log.events[a].back().final().usage().completion_tokens(), 10u) << "attempt " << a;
  }
}

// An attempt cancelled while tokens are held sends nothing more; the next one goes on.
TEST_F(StreamIntervalTest, GenerateStreamCancelledAttemptSendsNothingMore) {
  start(config(2000));
  grpc::ClientContext ctx;
  std::unique_ptr<BidiStream> stream;
  StreamLog log;
  ASSERT_TRUE(
      stream_with_tokens(&ctx, with_interval(attempt(1, 5000, "held"), 1000), &log, &stream));
  ASSERT_TRUE(generated_at_least(20));
  wv1::StreamRequest swap;
  swap.add_cancel(1);
  *swap.add_start() = with_interval(attempt(2, 5, "after"), 8);
  ASSERT_TRUE(stream->Write(swap));
  stream->WritesDone();
  ASSERT_FALSE(read_until(stream.get(), &log, [] { return false; }));
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(shape(log, 1), std::vector<int>{1}) << "the cancelled attempt sent more";
  EXPECT_EQ(shape(log, 2), (std::vector<int>{1, 4, kFinal}));
  EXPECT_EQ(engine_->cancels.load(), 1);
  EXPECT_TRUE(eventually([&] { return idle(); }));
}

}  // namespace
}  // namespace switchyard::rt
