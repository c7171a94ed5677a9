// The native front's direct path (src/front/direct.h): incremental UTF-8 as Python's
// decoder reads valid input, and which chunks of a worker's message it takes and which it
// leaves to Python, with the request's state handed back first.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "front/direct.h"
#include "switchyard/v1/generation.pb.h"
#include "switchyard/worker/v1/worker.pb.h"

namespace switchyard::front {
namespace {

std::string table(const std::vector<const char*>& tokens) {
  std::string out;
  for (const char* t : tokens) {
    const std::int32_t n = t == nullptr ? -1 : static_cast<std::int32_t>(std::strlen(t));
    out.append(reinterpret_cast<const char*>(&n), 4);
    if (t != nullptr) out.append(t);
  }
  return out;
}

TEST(Utf8Append, AsciiAndWholeCharactersPassThrough) {
  std::string pending, text;
  utf8_append(pending, "h\xc3\xa9llo \xe6\x97\xa5 \xf0\x9f\x9a\x82", text);
  EXPECT_EQ(text, "h\xc3\xa9llo \xe6\x97\xa5 \xf0\x9f\x9a\x82");
  EXPECT_TRUE(pending.empty());
}

TEST(Utf8Append, HoldsACharacterUntilItsLastByte) {
  std::string pending, text;
  utf8_append(pending, "a\xf0\x9f", text);
  EXPECT_EQ(text, "a");
  EXPECT_EQ(pending, "\xf0\x9f");
  utf8_append(pending, "\x9a", text);
  EXPECT_EQ(text, "a");
  utf8_append(pending, "\x82!", text);
  EXPECT_EQ(text, "a\xf0\x9f\x9a\x82!");
  EXPECT_TRUE(pending.empty());
}

TEST(Utf8Append, ReplacesEachMaximalSubpartOfWhatIsNotUtf8) {
  // As Python's decoder with errors="replace": a stray continuation byte, an overlong
  // form, a surrogate, beyond U+10FFFF (one U+FFFD a byte), a start cut by ASCII (one for
  // the start), a byte that can start nothing.
  const std::string r = "\xef\xbf\xbd";
  const std::pair<const char*, std::string> cases[] = {
      {"\x80", r},           {"\xc0\xaf", r + r},         {"\xed\xa0\x80", r + r + r},
      {"\xf4\x90\x80\x80", r + r + r + r}, {"\xe6\x97x", r + "x"}, {"\xf5\x80", r + r},
  };
  for (const auto& [bad, want] : cases) {
    std::string pending, text = "kept";
    utf8_append(pending, bad, text);
    EXPECT_EQ(text, "kept" + want) << bad;
    EXPECT_TRUE(pending.empty());
  }
  std::string pending = "\xe6\x97", text;
  utf8_append(pending, "A", text);
  EXPECT_EQ(text, r + "A");
  EXPECT_TRUE(pending.empty());
  // A start that can only go wrong is replaced at once, not held; but a surrogate's
  // start at the end is held, as CPython's incremental decoder holds it.
  text.clear();
  utf8_append(pending, "\xe0\x80", text);
  EXPECT_EQ(text, r + r);
  EXPECT_TRUE(pending.empty());
  utf8_append(pending, "\xed\xa0", text);
  EXPECT_EQ(pending, "\xed\xa0");
  utf8_append(pending, "x", text);
  EXPECT_EQ(text, r + r + r + r + "x");
}

TEST(ByteVocab, ReadsTheTableAndRefusesOneCutShort) {
  auto vocab = ByteVocab::parse(table({"a", nullptr, "\xe6\x97", ""}));
  ASSERT_EQ(vocab->size(), 4u);
  EXPECT_EQ(*vocab->bytes(0), "a");
  EXPECT_EQ(vocab->bytes(1), nullptr);
  EXPECT_EQ(*vocab->bytes(2), "\xe6\x97");
  EXPECT_EQ(*vocab->bytes(3), "");
  EXPECT_EQ(vocab->bytes(4), nullptr);
  std::string cut = table({"abc"});
  cut.pop_back();
  EXPECT_THROW(ByteVocab::parse(cut), std::invalid_argument);
  EXPECT_THROW(ByteVocab::parse("\x01\x00"), std::invalid_argument);
}

// Tokens: 0 "He", 1 "llo", 2 "\xe6\x97" (a character's start), 3 "\xa5" (its end), 4 an
// added token (no bytes), 5 "\xff" (no UTF-8 at all).
class DirectTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    vocab_ = table_.add_vocab(ByteVocab::parse(table({"He", "llo", "\xe6\x97", "\xa5", nullptr,
                                                      "\xff"})));
  }

  static void chunk(worker::v1::StreamResponse& m, std::uint64_t attempt,
                    std::vector<std::uint32_t> ids) {
    auto* e = m.add_events();
    e->set_attempt_id(attempt);
    for (auto id : ids) e->mutable_chunk()->add_token_ids(id);
  }

  v1::FeedResult feed(const worker::v1::StreamResponse& m, double now = 10.0) {
    v1::FeedResult result;
    EXPECT_TRUE(table_.feed(7, m.SerializeAsString(), now,
                            [this](std::uint64_t call) { return !full_.count(call); }, writes_,
                            &result));
    return result;
  }

  std::string written_text(std::size_t i) {
    switchyard::v1::GenerateResponse r;
    EXPECT_TRUE(r.ParseFromString(writes_.at(i).second));
    return r.chunk().text();
  }

  DirectTable table_;
  int vocab_ = -1;
  Writes writes_;
  std::set<std::uint64_t> full_;
};

TEST_F(DirectTableTest, WritesTheChunksOfAttemptsHandedOverAndLeavesTheRest) {
  ASSERT_TRUE(table_.start(7, 1, 100, vocab_, "", 9.0));
  worker::v1::StreamResponse m;
  chunk(m, 1, {0, 1});
  chunk(m, 2, {0});  // not handed over
  chunk(m, 1, {2});
  chunk(m, 1, {3});
  auto result = feed(m);
  ASSERT_EQ(writes_.size(), 3u);
  EXPECT_EQ(writes_[0].first, 100u);
  EXPECT_EQ(written_text(0), "Hello");
  EXPECT_EQ(written_text(1), "");  // the character is not finished
  EXPECT_EQ(written_text(2), "\xe6\x97\xa5");
  switchyard::v1::GenerateResponse r;
  ASSERT_TRUE(r.ParseFromString(writes_[0].second));
  EXPECT_EQ(r.chunk().token_ids_size(), 2);
  EXPECT_EQ(result.tokens(), 4u);
  ASSERT_EQ(result.itl_size(), 3);
  EXPECT_DOUBLE_EQ(result.itl(0), 0.5);  // (10 - 9) / 2 tokens
  EXPECT_EQ(result.handbacks_size(), 0);
  worker::v1::StreamResponse rest;
  ASSERT_TRUE(rest.ParseFromString(result.rest()));
  ASSERT_EQ(rest.events_size(), 1);
  EXPECT_EQ(rest.events(0).attempt_id(), 2u);

  v1::Handback back;
  ASSERT_TRUE(table_.stop(7, 1, &back));
  EXPECT_EQ(std::vector<std::uint32_t>(back.token_ids().begin(), back.token_ids().end()),
            (std::vector<std::uint32_t>{0, 1, 2, 3}));
  EXPECT_DOUBLE_EQ(back.last_token_at(), 10.0);
  EXPECT_FALSE(table_.stop(7, 1, &back));
  EXPECT_EQ(table_.size(), 0u);
}

TEST_F(DirectTableTest, HandsAnAttemptBackBeforeWhatItCannotTake) {
  // Each of these leaves the attempt to Python, with what it handled before.
  auto logprobs = [](worker::v1::StreamResponse& m) {
    chunk(m, 1, {1});
    m.mutable_events(m.events_size() - 1)->mutable_chunk()->add_logprobs()->set_token_id(1);
  };
  auto no_bytes = [](worker::v1::StreamResponse& m) { chunk(m, 1, {1, 4}); };
  auto final = [](worker::v1::StreamResponse& m) {
    auto* e = m.add_events();
    e->set_attempt_id(1);
    e->mutable_final()->set_finish_reason(switchyard::v1::FINISH_REASON_LENGTH);
  };
  for (auto add :
       std::vector<void (*)(worker::v1::StreamResponse&)>{logprobs, no_bytes, final}) {
    writes_.clear();
    ASSERT_TRUE(table_.start(7, 1, 100, vocab_, "", 9.0));
    worker::v1::StreamResponse m;
    chunk(m, 1, {0});
    add(m);
    chunk(m, 1, {1});  // after the hand-back: Python's too
    auto result = feed(m);
    ASSERT_EQ(writes_.size(), 1u);
    ASSERT_EQ(result.handbacks_size(), 1);
    EXPECT_EQ(result.handbacks(0).attempt(), 1u);
    EXPECT_EQ(result.handbacks(0).token_ids_size(), 1);
    worker::v1::StreamResponse rest;
    ASSERT_TRUE(rest.ParseFromString(result.rest()));
    EXPECT_EQ(rest.events_size(), 2);
    EXPECT_EQ(table_.size(), 0u);
  }
}

TEST_F(DirectTableTest, BytesThatAreNotUtf8AreWrittenAsPythonReadsThem) {
  // A held start that the next token breaks, then a byte that starts nothing: U+FFFD for
  // each, as the control plane's decoder (errors="replace") makes them.
  ASSERT_TRUE(table_.start(7, 1, 100, vocab_, "", 9.0));
  worker::v1::StreamResponse m;
  chunk(m, 1, {2});
  chunk(m, 1, {0, 5, 1});
  auto result = feed(m);
  EXPECT_EQ(result.handbacks_size(), 0);
  ASSERT_EQ(writes_.size(), 2u);
  EXPECT_EQ(written_text(0), "");
  EXPECT_EQ(written_text(1), "\xef\xbf\xbdHe\xef\xbf\xbdllo");
}

TEST_F(DirectTableTest, ACallThatIsFullGetsNothingMore) {
  ASSERT_TRUE(table_.start(7, 1, 100, vocab_, "", 9.0));
  full_.insert(100);
  worker::v1::StreamResponse m;
  chunk(m, 1, {0});
  auto result = feed(m);
  EXPECT_TRUE(writes_.empty());
  ASSERT_EQ(result.handbacks_size(), 1);
  EXPECT_EQ(result.handbacks(0).token_ids_size(), 0);
  EXPECT_DOUBLE_EQ(result.handbacks(0).last_token_at(), 9.0);
}

TEST_F(DirectTableTest, StartsFromTheBytesPythonHeld) {
  ASSERT_TRUE(table_.start(7, 1, 100, vocab_, "\xe6\x97", 9.0));
  worker::v1::StreamResponse m;
  chunk(m, 1, {3, 0});
  feed(m);
  ASSERT_EQ(writes_.size(), 1u);
  EXPECT_EQ(written_text(0), "\xe6\x97\xa5He");
}

TEST_F(DirectTableTest, OtherStreamsAndBadInputAreLeftAlone) {
  EXPECT_FALSE(table_.start(7, 1, 100, vocab_ + 1, "", 0));  // no such vocabulary
  ASSERT_TRUE(table_.start(8, 1, 100, vocab_, "", 0));  // another stream's attempt 1
  EXPECT_FALSE(table_.start(8, 1, 100, vocab_, "", 0));  // already handed over
  worker::v1::StreamResponse m;
  chunk(m, 1, {0});
  auto result = feed(m);
  EXPECT_TRUE(writes_.empty());
  EXPECT_EQ(result.handbacks_size(), 0);
  v1::FeedResult ignored;
  EXPECT_FALSE(table_.feed(7, "\xff\xff\xff", 0, [](std::uint64_t) { return true; }, writes_,
                           &ignored));
}

}  // namespace
}  // namespace switchyard::front
