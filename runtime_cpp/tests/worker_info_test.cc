// GetInfo's engine facts, StreamLoad under load, and one EOS convention on the wire.
#include <algorithm>

#include "worker_fixture.h"

namespace switchyard::rt {
namespace {

using namespace switchyard::rt::test_support;  // NOLINT: the shared fixture

TEST_F(WorkerServiceTest, GetInfoReportsTheEnginesShape) {
  SimConfig c = config();
  c.kv_blocks = 321;
  c.max_batch = 17;
  start(c);
  grpc::ClientContext ctx;
  wv1::GetInfoResponse info;
  ASSERT_TRUE(stub_->GetInfo(&ctx, wv1::GetInfoRequest(), &info).ok());
  EXPECT_EQ(info.tensor_parallel_size(), 1u);
  EXPECT_EQ(info.pipeline_parallel_size(), 1u);
  EXPECT_EQ(info.quantization(), "");
  EXPECT_EQ(info.kv_blocks_total(), 321u);
  EXPECT_EQ(info.max_batch_size(), 17u);
  EXPECT_EQ(info.max_input_len(), 8191u);
  EXPECT_EQ(info.gpu_memory_used_bytes(), 0u);  // no GPU behind a simulator
  EXPECT_EQ(info.gpu_memory_total_bytes(), 0u);
}

// Under load the reports keep counting KV blocks: used + free is the cache, and used
// grows with the requests running and falls back to zero after them.
TEST_F(WorkerServiceTest, StreamLoadReportsKvBlocksUnderLoad) {
  SimConfig c = config(1000);
  c.kv_blocks = 1000;
  c.tokens_per_block = 16;
  start(c);
  wv1::LoadReport idle;
  service_->fill_load(&idle);  // before any engine step: all free, not "0 free"
  EXPECT_EQ(idle.kv_blocks_used(), 0u);
  EXPECT_EQ(idle.kv_blocks_free(), 1000u);
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<wv1::GenerateResponse>>> readers;
  for (int i = 0; i < 4; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    readers.push_back(stub_->Generate(ctxs.back().get(), gen(3000)));
    wv1::GenerateResponse msg;
    ASSERT_TRUE(readers.back()->Read(&msg));
  }
  wv1::LoadReport r;
  ASSERT_TRUE(eventually([&] {
    service_->fill_load(&r);
    return r.running() == 4;
  }));
  // Each request reserves ceil((3 + 3000) / 16) = 188 blocks.
  EXPECT_EQ(r.kv_blocks_used(), 4u * 188u);
  EXPECT_EQ(r.kv_blocks_used() + r.kv_blocks_free(), 1000u);
  EXPECT_NEAR(r.kv_cache_usage(), 0.752, 1e-3);
  for (auto& ctx : ctxs) ctx->TryCancel();
  for (auto& reader : readers) reader->Finish();
  ASSERT_TRUE(eventually([&] {
    service_->fill_load(&r);
    return r.kv_blocks_used() == 0 && r.kv_blocks_free() == 1000u;
  }));
}

// The end id on the wire as vLLM streams it, whichever convention the engine has: the
// last token, counted in completion_tokens, named by the stop reason.
class EosConventionTest : public WorkerServiceTest,
                          public ::testing::WithParamInterface<bool> {};

TEST_P(EosConventionTest, EosIsTheLastTokenAndTheStopReason) {
  SimConfig c = config();
  c.eos_every = 7;
  c.eos_id = 2;
  c.end_id_in_output = GetParam();
  start(c);
  auto req = gen(500);
  req.set_ignore_eos(false);
  grpc::ClientContext ctx;
  Stream s = read_all(&ctx, req);
  ASSERT_TRUE(s.status.ok());
  EXPECT_EQ(s.final.finish_reason(), ::switchyard::v1::FINISH_REASON_STOP);
  ASSERT_EQ(s.final.stop_reason_case(), wv1::Final::kEosTokenId);
  EXPECT_EQ(s.final.eos_token_id(), 2u);
  ASSERT_FALSE(s.tokens.empty());
  EXPECT_EQ(s.tokens.back(), 2u);
  EXPECT_EQ(std::count(s.tokens.begin(), s.tokens.end(), 2u), 1);
  EXPECT_EQ(s.final.usage().completion_tokens(), s.tokens.size());
  EXPECT_LT(s.tokens.size(), 500u);

  // GenerateStream, the control plane's path, the same.
  grpc::ClientContext sctx;
  auto stream = stub_->GenerateStream(&sctx);
  wv1::StreamRequest start_msg;
  *start_msg.add_start() = req;
  start_msg.mutable_start(0)->set_attempt_id(1);
  ASSERT_TRUE(stream->Write(start_msg));
  std::vector<std::uint32_t> tokens;
  wv1::Final final;
  wv1::StreamResponse msg;
  while (stream->Read(&msg)) {
    bool done = false;
    for (const auto& e : msg.events()) {
      if (e.has_chunk()) tokens.insert(tokens.end(), e.chunk().token_ids().begin(),
                                       e.chunk().token_ids().end());
      if (e.has_final()) {
        final = e.final();
        done = true;
      }
    }
    if (done) break;
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(tokens, s.tokens);
  EXPECT_EQ(final.eos_token_id(), 2u);
  EXPECT_EQ(final.usage().completion_tokens(), tokens.size());
}

INSTANTIATE_TEST_SUITE_P(VllmAndTrtllm, EosConventionTest, ::testing::Bool(),
                         [](const auto& p) { return p.param ? "EndIdInOutput" : "EndIdLeftOut"; });

}  // namespace
}  // namespace switchyard::rt
