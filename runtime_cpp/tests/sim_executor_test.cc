#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "kv_events_stream.h"
#include "sim_executor.h"

namespace switchyard::rt {
namespace {

SimConfig virtual_config() {
  SimConfig c;
  c.virtual_clock = true;
  c.vocab_size = 1000;
  c.max_context = 512;
  c.tokens_per_block = 16;
  c.kv_blocks = 64;
  c.prefill_us_per_token = 10;
  c.decode_step_us = 1000;
  c.decode_us_per_request = 100;
  return c;
}

GenRequest request(Tokens prompt, int max_tokens, std::uint64_t seed = 0) {
  GenRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.seed = seed;
  return r;
}

// Runs iterations until every enqueued request is final; returns tokens per request.
std::map<RequestId, GenResponse> run_all(SimExecutor& sim, std::map<RequestId, Tokens>* tokens) {
  std::map<RequestId, GenResponse> finals;
  for (int i = 0; i < 10000; ++i) {
    sim.step();
    for (auto& r : sim.await_responses(std::chrono::milliseconds(0))) {
      auto& t = (*tokens)[r.id];
      t.insert(t.end(), r.tokens.begin(), r.tokens.end());
      if (r.is_final) finals[r.id] = r;
    }
    auto s = sim.latest_stats();
    if (s && s->active_requests == 0 && s->queued_requests == 0) break;
  }
  return finals;
}

TEST(SimExecutor, OutputIsAFunctionOfPromptSeedAndPosition) {
  SimExecutor sim(virtual_config());
  auto a = sim.enqueue(request({1, 2, 3}, 8, 7));
  auto b = sim.enqueue(request({1, 2, 3}, 8, 7));
  auto c = sim.enqueue(request({1, 2, 3}, 8, 8));
  std::map<RequestId, Tokens> tokens;
  auto finals = run_all(sim, &tokens);
  ASSERT_EQ(finals.size(), 3u);
  EXPECT_EQ(tokens[a], tokens[b]);
  EXPECT_NE(tokens[a], tokens[c]);
  ASSERT_EQ(tokens[a].size(), 8u);
  const auto h = SimExecutor::hash_tokens({1, 2, 3});
  for (int i = 0; i < 8; ++i) EXPECT_EQ(tokens[a][i], SimExecutor::token_at(h, 7, i, 1000));
  EXPECT_EQ(finals[a].finish, FinishReason::kLength);
  EXPECT_EQ(finals[a].prompt_tokens, 3);
}

TEST(SimExecutor, LatencyModelChargesPrefillAndBatchedDecode) {
  SimExecutor sim(virtual_config());
  sim.enqueue(request(Tokens(100, 5), 4));
  // First iteration: 100 prompt tokens of prefill plus one decode step for one request.
  EXPECT_DOUBLE_EQ(sim.step(), 100 * 10 + 1000 + 100);
  EXPECT_DOUBLE_EQ(sim.step(), 1000 + 100);
  sim.enqueue(request(Tokens(10, 6), 4));
  sim.enqueue(request(Tokens(10, 7), 4));
  // Two new prompts of 10 tokens, three requests decoding.
  EXPECT_DOUBLE_EQ(sim.step(), 20 * 10 + 1000 + 3 * 100);
  EXPECT_GT(sim.now_us(), 0);
}

TEST(SimExecutor, KvBudgetQueuesRequestsThatDoNotFit) {
  auto c = virtual_config();
  c.kv_blocks = 4;  // 64 tokens
  SimExecutor sim(c);
  sim.enqueue(request(Tokens(16, 1), 16));  // 2 blocks
  sim.enqueue(request(Tokens(16, 2), 16));  // 2 blocks
  sim.enqueue(request(Tokens(16, 3), 16));  // waits
  sim.step();
  auto s = sim.latest_stats();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->active_requests, 2);
  EXPECT_EQ(s->queued_requests, 1);
  EXPECT_EQ(s->kv_blocks_used, 4);
  EXPECT_EQ(s->kv_blocks_free, 0);
  std::map<RequestId, Tokens> tokens;
  auto finals = run_all(sim, &tokens);
  EXPECT_EQ(finals.size(), 3u);
  EXPECT_EQ(sim.latest_stats()->kv_blocks_free, 4);
  EXPECT_THROW(sim.enqueue(request(Tokens(60, 1), 20)), InvalidRequest);
}

TEST(SimExecutor, CancelEndsWithCancelledWithinOneStep) {
  SimExecutor sim(virtual_config());
  auto id = sim.enqueue(request({1, 2}, 100));
  sim.step();
  sim.step();
  sim.cancel(id);
  sim.step();
  bool cancelled = false;
  for (auto& r : sim.await_responses(std::chrono::milliseconds(0))) {
    if (r.is_final) {
      EXPECT_EQ(r.finish, FinishReason::kCancelled);
      cancelled = true;
    }
  }
  EXPECT_TRUE(cancelled);
  EXPECT_EQ(sim.latest_stats()->active_requests, 0);
  sim.cancel(12345);  // unknown ids are ignored
}

TEST(SimExecutor, StopWordsEndIdAndMinTokens) {
  SimExecutor sim(virtual_config());
  const auto h = SimExecutor::hash_tokens({9, 9});
  const TokenId third = SimExecutor::token_at(h, 0, 2, 1000);
  GenRequest r = request({9, 9}, 50);
  r.stop_words = {{third}};
  auto id = sim.enqueue(r);
  std::map<RequestId, Tokens> tokens;
  auto finals = run_all(sim, &tokens);
  EXPECT_EQ(finals[id].finish, FinishReason::kStopWords);
  EXPECT_EQ(tokens[id].size(), 3u);
  EXPECT_EQ(tokens[id].back(), third);

  auto c = virtual_config();
  c.eos_every = 3;
  SimExecutor eos_sim(c);
  GenRequest e = request({4, 5, 6}, 200);
  e.end_id = 2;
  e.sampling.min_tokens = 5;
  auto eid = eos_sim.enqueue(e);
  tokens.clear();
  finals = run_all(eos_sim, &tokens);
  EXPECT_EQ(finals[eid].finish, FinishReason::kEndId);
  EXPECT_EQ(tokens[eid].back(), 2);
  EXPECT_GE(tokens[eid].size(), 6u);
}

TEST(SimExecutor, AllottedTimeEndsWithTimedOut) {
  SimExecutor sim(virtual_config());
  GenRequest r = request({1}, 400);
  r.allotted_time = std::chrono::milliseconds(5);  // about four 1.1 ms steps
  auto id = sim.enqueue(r);
  std::map<RequestId, Tokens> tokens;
  auto finals = run_all(sim, &tokens);
  EXPECT_EQ(finals[id].finish, FinishReason::kTimedOut);
  EXPECT_LT(tokens[id].size(), 10u);
}

TEST(SimExecutor, PrefixCacheSkipsPrefillOfKnownBlocks) {
  SimExecutor sim(virtual_config());
  Tokens shared(64, 3);
  Tokens a = shared, b = shared;
  a.push_back(10);
  b.push_back(11);
  sim.enqueue(request(a, 2));
  std::map<RequestId, Tokens> tokens;
  run_all(sim, &tokens);
  auto id = sim.enqueue(request(b, 2));
  // Only the last (uncached) token is prefilled.
  EXPECT_DOUBLE_EQ(sim.step(), 1 * 10 + 1000 + 100);
  auto finals = run_all(sim, &tokens);
  EXPECT_EQ(finals[id].cached_prompt_tokens, 64);
}

TEST(SimExecutor, KvEventsSayWhichBlocksItStoresAndEvicts) {
  SimConfig c = virtual_config();
  c.tokens_per_block = 4;
  c.prefix_cache_blocks = 3;
  SimExecutor sim(c);
  EXPECT_TRUE(sim.kv_events());
  std::map<RequestId, Tokens> tokens;
  sim.enqueue(request({1, 2, 3, 4, 5, 6, 7, 8, 9}, 1));  // two full blocks and one token
  run_all(sim, &tokens);
  KvCacheEvents first = sim.take_kv_events(std::chrono::milliseconds(0));
  EXPECT_FALSE(first.lost);
  ASSERT_EQ(first.events.size(), 1u);
  const KvCacheEvent& a = first.events[0];
  EXPECT_EQ(a.kind, KvCacheEvent::Kind::kStored);
  EXPECT_FALSE(a.parent_hash.has_value());
  ASSERT_EQ(a.block_hashes.size(), 2u);
  EXPECT_EQ(a.tokens, (Tokens{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(a.block_size, 4);
  // The same first block, then two new ones: stored after it; the cache holds three, so
  // the least recently used (the first prompt's second block) goes.
  sim.enqueue(request({1, 2, 3, 4, 9, 9, 9, 9, 8, 8, 8, 8}, 1));
  run_all(sim, &tokens);
  KvCacheEvents second = sim.take_kv_events(std::chrono::milliseconds(0));
  ASSERT_EQ(second.events.size(), 2u);
  const KvCacheEvent& b = second.events[0];
  EXPECT_EQ(b.kind, KvCacheEvent::Kind::kStored);
  EXPECT_EQ(b.parent_hash, std::optional<std::uint64_t>(a.block_hashes[0]));
  EXPECT_EQ(b.block_hashes.size(), 2u);
  EXPECT_EQ(b.tokens, (Tokens{9, 9, 9, 9, 8, 8, 8, 8}));
  const KvCacheEvent& gone = second.events[1];
  EXPECT_EQ(gone.kind, KvCacheEvent::Kind::kRemoved);
  EXPECT_EQ(gone.block_hashes, (std::vector<std::uint64_t>{a.block_hashes[1]}));
  // Nothing new: an empty answer once the timeout passes.
  EXPECT_TRUE(sim.take_kv_events(std::chrono::milliseconds(1)).events.empty());
}

TEST(SimExecutor, APrefixIsEvictedFromItsEnd) {
  SimConfig c = virtual_config();
  c.tokens_per_block = 4;
  c.prefix_cache_blocks = 3;
  SimExecutor sim(c);
  std::map<RequestId, Tokens> tokens;
  const Tokens a = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  sim.enqueue(request(a, 1));
  run_all(sim, &tokens);
  // Two new blocks make room by evicting one: the first prompt's last, not its first.
  sim.enqueue(request({7, 7, 7, 7, 6, 6, 6, 6, 5}, 1));
  run_all(sim, &tokens);
  KvCacheEvents events = sim.take_kv_events(std::chrono::milliseconds(0));
  ASSERT_FALSE(events.events.empty());
  const KvCacheEvent& stored_a = events.events.front();
  const KvCacheEvent& gone = events.events.back();
  ASSERT_EQ(gone.kind, KvCacheEvent::Kind::kRemoved);
  ASSERT_EQ(stored_a.block_hashes.size(), 2u);
  EXPECT_EQ(gone.block_hashes, (std::vector<std::uint64_t>{stored_a.block_hashes[1]}));
  // So the first prompt again finds its first block.
  auto id = sim.enqueue(request(a, 1));
  auto finals = run_all(sim, &tokens);
  EXPECT_EQ(finals[id].cached_prompt_tokens, 4);
}

TEST(SimExecutor, PriorityOrdersTheQueue) {
  auto c = virtual_config();
  c.max_batch = 1;
  SimExecutor sim(c);
  auto low = sim.enqueue(request({1}, 1));
  GenRequest hi = request({2}, 1);
  hi.priority = 5;
  auto high = sim.enqueue(hi);
  sim.step();
  auto out = sim.await_responses(std::chrono::milliseconds(0));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].id, high);
  sim.step();
  EXPECT_EQ(sim.await_responses(std::chrono::milliseconds(0))[0].id, low);
}

TEST(SimExecutor, NonStreamingSendsEverythingWithTheFinal) {
  SimExecutor sim(virtual_config());
  GenRequest r = request({1, 2}, 5);
  r.streaming = false;
  r.return_logprobs = true;
  sim.enqueue(r);
  std::vector<GenResponse> all;
  for (int i = 0; i < 10; ++i) {
    sim.step();
    for (auto& x : sim.await_responses(std::chrono::milliseconds(0))) all.push_back(x);
  }
  ASSERT_EQ(all.size(), 1u);
  EXPECT_TRUE(all[0].is_final);
  EXPECT_EQ(all[0].tokens.size(), 5u);
  EXPECT_EQ(all[0].logprobs.size(), 5u);
}

TEST(SimExecutor, RejectsInvalidRequestsNamingTheField) {
  SimExecutor sim(virtual_config());
  try {
    sim.enqueue(request({}, 4));
    FAIL();
  } catch (const InvalidRequest& e) {
    EXPECT_EQ(e.field(), "prompt_token_ids");
  }
  try {
    sim.enqueue(request({1, 5000}, 4));
    FAIL();
  } catch (const InvalidRequest& e) {
    EXPECT_EQ(e.field(), "prompt_token_ids[1]");
  }
  try {
    sim.enqueue(request({1}, 600));
    FAIL();
  } catch (const InvalidRequest& e) {
    EXPECT_EQ(e.field(), "max_tokens");
  }
}

TEST(SimExecutor, RealTimeModeRunsOnItsOwnThread) {
  auto c = virtual_config();
  c.virtual_clock = false;
  c.decode_step_us = 200;
  SimExecutor sim(c);
  EXPECT_THROW(sim.step(), std::logic_error);  // its own thread steps it
  auto id = sim.enqueue(request({1, 2, 3}, 20));
  int got = 0;
  bool final_seen = false;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!final_seen && std::chrono::steady_clock::now() < until) {
    for (auto& r : sim.await_responses(std::chrono::milliseconds(50))) {
      EXPECT_EQ(r.id, id);
      got += static_cast<int>(r.tokens.size());
      final_seen = final_seen || r.is_final;
    }
  }
  EXPECT_TRUE(final_seen);
  EXPECT_EQ(got, 20);
  sim.shutdown();
  sim.shutdown();  // idempotent
  EXPECT_FALSE(sim.can_enqueue());
}

// TensorRT-LLM's convention: the same generation, with the end id left out of the output.
TEST(SimExecutor, TrtllmEosConventionLeavesTheEndIdOut) {
  auto c = virtual_config();
  c.eos_every = 3;
  SimExecutor vllm(c);
  c.end_id_in_output = false;
  SimExecutor trt(c);
  GenRequest e = request({4, 5, 6}, 200);
  e.end_id = 2;
  std::map<RequestId, Tokens> a, b;
  const auto ia = vllm.enqueue(e);
  const auto ib = trt.enqueue(e);
  auto fa = run_all(vllm, &a);
  auto fb = run_all(trt, &b);
  ASSERT_EQ(fa[ia].finish, FinishReason::kEndId);
  ASSERT_EQ(fb[ib].finish, FinishReason::kEndId);
  EXPECT_EQ(a[ia].back(), 2);
  ASSERT_EQ(b[ib].size() + 1, a[ia].size());
  EXPECT_TRUE(std::equal(b[ib].begin(), b[ib].end(), a[ia].begin()));
}

}  // namespace
}  // namespace switchyard::rt

namespace switchyard::rt {
namespace {

TEST(KvEvents, TheWireBatchSaysEveryKindAndALoss) {
  KvCacheEvents found;
  found.lost = true;
  KvCacheEvent stored;
  stored.block_hashes = {11, 12};
  stored.parent_hash = 10;
  stored.tokens = {1, 2, 3, 4};
  stored.block_size = 2;
  stored.adapter = 7;
  KvCacheEvent removed;
  removed.kind = KvCacheEvent::Kind::kRemoved;
  removed.block_hashes = {10};
  KvCacheEvent cleared;
  cleared.kind = KvCacheEvent::Kind::kCleared;
  found.events = {stored, removed, cleared};
  const wv1::KvEventBatch batch = to_batch(found);
  EXPECT_TRUE(batch.reset());  // events were lost before these: subscribers forget
  ASSERT_EQ(batch.events_size(), 3);
  const auto& s = batch.events(0).stored();
  EXPECT_EQ(std::vector<std::uint64_t>(s.block_hashes().begin(), s.block_hashes().end()),
            (std::vector<std::uint64_t>{11, 12}));
  EXPECT_EQ(s.parent_block_hash(), 10u);
  EXPECT_EQ(s.token_ids_size(), 4);
  EXPECT_EQ(s.block_size(), 2u);
  EXPECT_EQ(s.adapter(), "task-7");
  EXPECT_EQ(batch.events(1).removed().block_hashes(0), 10u);
  EXPECT_TRUE(batch.events(2).has_cleared());
}

}  // namespace
}  // namespace switchyard::rt
