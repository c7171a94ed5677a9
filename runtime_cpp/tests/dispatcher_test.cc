#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "dispatcher.h"
#include "sim_executor.h"

namespace switchyard::rt {
namespace {

class Collect : public StreamSink {
 public:
  void on_response(GenResponse&& r) override {
    std::lock_guard<std::mutex> lock(mu);
    for (auto t : r.tokens) tokens.push_back(t);
    if (r.is_final) {
      final_seen = true;
      cv.notify_all();
    }
  }
  bool wait_final() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(5), [&] { return final_seen; });
  }
  std::mutex mu;
  std::condition_variable cv;
  Tokens tokens;
  bool final_seen = false;
};

SimConfig fast() {
  SimConfig c;
  c.vocab_size = 100;
  c.decode_step_us = 100;
  c.decode_us_per_request = 0;
  c.prefill_us_per_token = 0;
  return c;
}

TEST(Dispatcher, DeliversInOrderEvenWhenResponsesBeatRegistration) {
  SimExecutor sim(fast());
  Dispatcher d(sim);
  GenRequest r;
  r.prompt = {1, 2};
  r.max_tokens = 30;
  auto id = sim.enqueue(r);
  // Let responses arrive and be parked before the stream registers.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto sink = std::make_shared<Collect>();
  ASSERT_TRUE(d.add(id, "a", sink));
  ASSERT_TRUE(sink->wait_final());
  const auto h = SimExecutor::hash_tokens(r.prompt);
  ASSERT_EQ(sink->tokens.size(), 30u);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(sink->tokens[i], SimExecutor::token_at(h, 0, i, 100));
  EXPECT_EQ(d.in_flight(), 0u);
  EXPECT_FALSE(d.find("a"));
}

TEST(Dispatcher, NamesAreUniqueWhileInFlight) {
  SimExecutor sim(fast());
  Dispatcher d(sim);
  GenRequest r;
  r.prompt = {1};
  r.max_tokens = 2000;
  auto id = sim.enqueue(r);
  auto sink = std::make_shared<Collect>();
  ASSERT_TRUE(d.add(id, "same", sink));
  EXPECT_EQ(d.find("same"), id);
  EXPECT_FALSE(d.add(id + 1000, "same", std::make_shared<Collect>()));
  sim.cancel(id);
  ASSERT_TRUE(sink->wait_final());
  EXPECT_FALSE(d.find("same"));
}

TEST(Dispatcher, AReservedNameIsRefusedUntilReleasedOrOver) {
  SimExecutor sim(fast());
  Dispatcher d(sim);
  ASSERT_TRUE(d.reserve("r"));
  EXPECT_FALSE(d.reserve("r"));  // a second request with it never reaches the engine
  EXPECT_FALSE(d.find("r"));     // not in flight yet: Abort finds nothing
  d.release("r");
  ASSERT_TRUE(d.reserve("r"));
  GenRequest r;
  r.prompt = {1};
  r.max_tokens = 3;
  auto id = sim.enqueue(r);
  auto sink = std::make_shared<Collect>();
  ASSERT_TRUE(d.add(id, "r", sink));  // takes over its reservation
  EXPECT_FALSE(d.reserve("r"));
  ASSERT_TRUE(sink->wait_final());
  EXPECT_TRUE(d.reserve("r"));  // free again once the request is over
  EXPECT_TRUE(d.reserve(""));   // empty names are not tracked
  EXPECT_TRUE(d.reserve(""));
}

}  // namespace
}  // namespace switchyard::rt
