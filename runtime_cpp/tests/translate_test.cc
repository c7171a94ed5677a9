#include <gtest/gtest.h>

#include <vector>

#include "translate.h"

namespace switchyard::rt {
namespace {

EngineInfo info() {
  EngineInfo i;
  i.max_context = 100;
  i.vocab_size = 50;
  i.eos_token_ids = {2, 3};
  return i;
}

wv1::GenerateRequest valid() {
  wv1::GenerateRequest r;
  r.set_request_id("r1");
  for (int t : {1, 5, 7}) r.add_prompt_token_ids(t);
  r.set_max_tokens(10);
  return r;
}

TEST(Translate, MapsEveryField) {
  auto in = valid();
  auto* s = in.mutable_sampling();
  s->set_temperature(0.7f);
  s->set_top_p(0.9f);
  s->set_top_k(40);
  s->set_min_p(0.05f);
  s->set_repetition_penalty(1.1f);
  s->set_presence_penalty(0.5f);
  s->set_frequency_penalty(-0.5f);
  s->set_seed(42);
  in.set_min_tokens(2);
  in.add_stop_token_ids(9);
  in.set_logprobs(0);  // the sampled token's log probability
  in.set_priority(3);
  GenRequest out;
  FieldError err;
  ASSERT_TRUE(to_gen_request(in, info(), 250.0, &out, &err)) << err.field;
  EXPECT_EQ(out.prompt, (Tokens{1, 5, 7}));
  EXPECT_EQ(out.max_tokens, 10);
  EXPECT_FLOAT_EQ(*out.sampling.temperature, 0.7f);
  EXPECT_FLOAT_EQ(*out.sampling.top_p, 0.9f);
  EXPECT_EQ(*out.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(*out.sampling.min_p, 0.05f);
  EXPECT_FLOAT_EQ(*out.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(*out.sampling.seed, 42u);
  EXPECT_EQ(out.sampling.min_tokens, 2);
  EXPECT_EQ(*out.end_id, 2);
  // The stop token, then the second EOS id, stop like stop words.
  ASSERT_EQ(out.stop_words.size(), 2u);
  EXPECT_EQ(out.stop_words[0], Tokens{9});
  EXPECT_EQ(out.stop_words[1], Tokens{3});
  EXPECT_TRUE(out.return_logprobs);
  EXPECT_EQ(out.priority, 3);
  EXPECT_EQ(out.allotted_time->count(), 250);
}

TEST(Translate, UnsetStaysUnsetAndIgnoreEosDropsTheEndId) {
  auto in = valid();
  in.set_ignore_eos(true);
  GenRequest out;
  FieldError err;
  ASSERT_TRUE(to_gen_request(in, info(), -1, &out, &err));
  EXPECT_FALSE(out.sampling.temperature);
  EXPECT_FALSE(out.sampling.seed);
  EXPECT_FALSE(out.end_id);
  EXPECT_FALSE(out.allotted_time);
  EXPECT_TRUE(out.stop_words.empty());
}

TEST(Translate, BadInputNamesTheField) {
  struct Case {
    std::function<void(wv1::GenerateRequest&)> mutate;
    std::string field;
  };
  std::vector<Case> cases = {
      {[](auto& r) { r.clear_prompt_token_ids(); }, "prompt_token_ids"},
      {[](auto& r) { r.add_prompt_token_ids(50); }, "prompt_token_ids[3]"},
      {[](auto& r) { r.set_max_tokens(0); }, "max_tokens"},
      {[](auto& r) { r.set_max_tokens(98); }, "max_tokens"},
      {[](auto& r) { r.set_min_tokens(11); }, "min_tokens"},
      {[](auto& r) { r.mutable_sampling()->set_temperature(-1); }, "sampling.temperature"},
      {[](auto& r) { r.mutable_sampling()->set_top_p(0); }, "sampling.top_p"},
      {[](auto& r) { r.mutable_sampling()->set_top_k(-2); }, "sampling.top_k"},
      {[](auto& r) { r.mutable_sampling()->set_min_p(2); }, "sampling.min_p"},
      {[](auto& r) { r.mutable_sampling()->set_repetition_penalty(0); }, "sampling.repetition_penalty"},
      {[](auto& r) { r.mutable_sampling()->set_presence_penalty(3); }, "sampling.presence_penalty"},
      {[](auto& r) { r.add_stop_token_ids(77); }, "stop_token_ids[0]"},
      {[](auto& r) { r.set_logprobs(21); }, "logprobs"},
      {[](auto& r) { r.set_logprobs(2); }, "logprobs"},
  };
  for (const auto& c : cases) {
    auto in = valid();
    c.mutate(in);
    GenRequest out;
    FieldError err;
    EXPECT_FALSE(to_gen_request(in, info(), -1, &out, &err)) << c.field;
    EXPECT_EQ(err.field, c.field);
    EXPECT_FALSE(err.message.empty());
  }
}

TEST(Translate, ResponsesMapToChunksAndFinals) {
  GenResponse a;
  a.tokens = {4, 5};
  a.logprobs = {-0.5f, -1.5f};
  wv1::Chunk chunk;
  append_chunk(a, &chunk);
  GenResponse b;
  b.tokens = {6};
  append_chunk(b, &chunk);  // coalesced into the same chunk
  ASSERT_EQ(chunk.token_ids_size(), 3);
  EXPECT_EQ(chunk.token_ids(2), 6u);
  ASSERT_EQ(chunk.logprobs_size(), 2);
  EXPECT_FLOAT_EQ(chunk.logprobs(1).logprob(), -1.5f);
  EXPECT_EQ(chunk.logprobs(1).token_id(), 5u);

  const std::pair<FinishReason, ::switchyard::v1::FinishReason> table[] = {
      {FinishReason::kEndId, ::switchyard::v1::FINISH_REASON_STOP},
      {FinishReason::kStopWords, ::switchyard::v1::FINISH_REASON_STOP},
      {FinishReason::kLength, ::switchyard::v1::FINISH_REASON_LENGTH},
      {FinishReason::kTimedOut, ::switchyard::v1::FINISH_REASON_TIME_LIMIT},
      {FinishReason::kCancelled, ::switchyard::v1::FINISH_REASON_CANCELLED},
  };
  for (auto [engine, wire] : table) EXPECT_EQ(to_wire(engine), wire);

  GenResponse fin;
  fin.is_final = true;
  fin.finish = FinishReason::kEndId;
  fin.tokens = {2};
  fin.prompt_tokens = 3;
  fin.cached_prompt_tokens = 1;
  fin.queue_ms = 4.5;
  wv1::Final out;
  fill_final(fin, 7, std::nullopt, {2, 3}, &out);
  EXPECT_EQ(out.finish_reason(), ::switchyard::v1::FINISH_REASON_STOP);
  EXPECT_EQ(out.eos_token_id(), 2u);
  EXPECT_EQ(out.usage().prompt_tokens(), 3u);
  EXPECT_EQ(out.usage().completion_tokens(), 7u);
  EXPECT_EQ(out.usage().cached_prompt_tokens(), 1u);
  EXPECT_DOUBLE_EQ(out.queue_ms(), 4.5);

  GenResponse failed;
  failed.is_final = true;
  failed.error = "engine fault";
  wv1::Final err;
  fill_final(failed, 0, std::nullopt, {2}, &err);
  EXPECT_EQ(err.finish_reason(), ::switchyard::v1::FINISH_REASON_ERROR);
  EXPECT_EQ(err.error_message(), "engine fault");

  // A second EOS id travels as a stop word but is reported as the EOS it is; a final
  // without tokens uses the last token the stream carried.
  GenResponse stop;
  stop.is_final = true;
  stop.finish = FinishReason::kStopWords;
  wv1::Final eos2;
  fill_final(stop, 4, TokenId{3}, {2, 3}, &eos2);
  EXPECT_EQ(eos2.eos_token_id(), 3u);
  wv1::Final word;
  fill_final(stop, 4, TokenId{9}, {2, 3}, &word);
  EXPECT_EQ(word.stop_token_id(), 9u);
}

// Sizes of the chunks a cadence lets out for `steps` (each the token count of one engine
// response, the last one final), each released chunk written at once.
std::vector<int> cadence_chunks(std::uint32_t interval, const std::vector<int>& steps) {
  ChunkCadence cadence(interval);
  std::vector<int> sizes;
  TokenId next = 100;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    GenResponse r;
    for (int k = 0; k < steps[i]; ++k) r.tokens.push_back(next++);
    r.is_final = i + 1 == steps.size();
    if (!cadence.add(r)) continue;
    wv1::Chunk chunk;
    cadence.take(&chunk);
    sizes.push_back(chunk.token_ids_size());
  }
  return sizes;
}

// stream_interval: the first token at once, then a chunk whenever at least N are unsent,
// the rest before the Final; 0 and 1 change nothing.
TEST(Translate, ChunkCadenceHoldsTokensToTheStreamInterval) {
  const std::vector<int> ten(10, 1);
  EXPECT_EQ(cadence_chunks(4, ten), (std::vector<int>{1, 4, 4, 1}));
  EXPECT_EQ(cadence_chunks(2, ten), (std::vector<int>{1, 2, 2, 2, 2, 1}));
  EXPECT_EQ(cadence_chunks(3, ten), (std::vector<int>{1, 3, 3, 3}));
  EXPECT_EQ(cadence_chunks(0, ten), std::vector<int>(10, 1));
  EXPECT_EQ(cadence_chunks(1, ten), std::vector<int>(10, 1));
  EXPECT_EQ(cadence_chunks(100, ten), (std::vector<int>{1, 9}));
  // All tokens of the first response with any go out at once (an empty one is no first);
  // a response that brings many tokens releases them all together.
  EXPECT_EQ(cadence_chunks(4, {0, 3, 1, 1, 6, 2, 0}), (std::vector<int>{3, 8, 2}));
  // A final without tokens releases what is held; with nothing held there is no chunk.
  EXPECT_EQ(cadence_chunks(4, {1, 1, 1, 0}), (std::vector<int>{1, 2}));
  EXPECT_EQ(cadence_chunks(4, {1, 0}), (std::vector<int>{1}));
  EXPECT_TRUE(cadence_chunks(4, {0, 0}).empty());  // a beam search: the Final alone
}

// Logprobs stay aligned with their tokens; an error final releases the tokens held; a
// released chunk is appended to what is being coalesced.
TEST(Translate, ChunkCadenceKeepsLogprobsAlignedAndReleasesOnAnError) {
  ChunkCadence cadence(4);
  wv1::Chunk coalesced;
  GenResponse first;
  first.tokens = {7};
  first.logprobs = {-0.1f};
  ASSERT_TRUE(cadence.add(first));
  cadence.take(&coalesced);
  for (TokenId t : {8, 9}) {
    GenResponse r;
    r.tokens = {t};
    r.logprobs = {-static_cast<float>(t)};
    EXPECT_FALSE(cadence.add(r));
  }
  GenResponse failed;
  failed.is_final = true;
  failed.error = "engine fault";
  ASSERT_TRUE(cadence.add(failed));
  cadence.take(&coalesced);
  ASSERT_EQ(coalesced.token_ids_size(), 3);
  ASSERT_EQ(coalesced.logprobs_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(coalesced.logprobs(i).token_id(), coalesced.token_ids(i));
  }
  EXPECT_EQ(coalesced.token_ids(2), 9u);
  EXPECT_FLOAT_EQ(coalesced.logprobs(2).logprob(), -9.f);
  wv1::Chunk none;
  cadence.take(&none);  // nothing held any more
  EXPECT_EQ(none.token_ids_size(), 0);
}

// TensorRT-LLM leaves the end id out of its output; the worker streams it as the last token
// (vLLM's convention), so the stop reason names it and completion_tokens count it.
TEST(Translate, NormalizeEndIdPutsTheEndIdBackOnce) {
  GenResponse trt;
  trt.is_final = true;
  trt.finish = FinishReason::kEndId;
  trt.tokens = {7, 8};  // what TensorRT-LLM sends: no end id
  normalize_end_id(&trt, TokenId{2}, std::nullopt);
  EXPECT_EQ(trt.tokens, (Tokens{7, 8, 2}));
  wv1::Final out;
  fill_final(trt, 3, std::nullopt, {2, 3}, &out);
  EXPECT_EQ(out.eos_token_id(), 2u);  // not 8, the last ordinary token

  // Streaming: the final often carries no tokens of its own.
  GenResponse empty_final;
  empty_final.is_final = true;
  empty_final.finish = FinishReason::kEndId;
  normalize_end_id(&empty_final, TokenId{2}, TokenId{8});
  EXPECT_EQ(empty_final.tokens, (Tokens{2}));

  // An engine that already includes it (vLLM's convention) is left alone.
  GenResponse vllm;
  vllm.is_final = true;
  vllm.finish = FinishReason::kEndId;
  vllm.tokens = {7, 2};
  normalize_end_id(&vllm, TokenId{2}, std::nullopt);
  EXPECT_EQ(vllm.tokens, (Tokens{7, 2}));
  GenResponse after;  // the end id came in an earlier response
  after.is_final = true;
  after.finish = FinishReason::kEndId;
  normalize_end_id(&after, TokenId{2}, TokenId{2});
  EXPECT_TRUE(after.tokens.empty());

  // Other endings, errors and requests without an end id are untouched.
  for (FinishReason f : {FinishReason::kLength, FinishReason::kStopWords, FinishReason::kCancelled}) {
    GenResponse r;
    r.is_final = true;
    r.finish = f;
    r.tokens = {7};
    normalize_end_id(&r, TokenId{2}, std::nullopt);
    EXPECT_EQ(r.tokens, (Tokens{7}));
  }
  GenResponse no_end;
  no_end.is_final = true;
  no_end.finish = FinishReason::kEndId;
  normalize_end_id(&no_end, std::nullopt, TokenId{5});
  EXPECT_TRUE(no_end.tokens.empty());
  GenResponse not_final;
  not_final.finish = FinishReason::kEndId;
  normalize_end_id(&not_final, TokenId{2}, TokenId{5});
  EXPECT_TRUE(not_final.tokens.empty());
}

TEST(Translate, PromptLongerThanTheEnginesInputLimitNamesTheField) {
  EngineInfo i = info();
  i.max_input_len = 2;
  GenRequest out;
  FieldError err;
  ASSERT_FALSE(to_gen_request(valid(), i, -1, &out, &err));  // 3 prompt tokens
  EXPECT_EQ(err.field, "prompt_token_ids");
  EXPECT_NE(err.message.find("max_input_len"), std::string::npos);
}

TEST(Translate, ConstraintsBecomeGuidesWhereTheEngineTakesThem) {
  EngineInfo guided = info();
  guided.structured_output = {"choice", "grammar", "json_object", "json_schema", "regex"};
  auto in = valid();
  in.mutable_constraint()->set_json_schema(R"({"type": "object"})");
  GenRequest out;
  FieldError err;
  ASSERT_TRUE(to_gen_request(in, guided, -1, &out, &err)) << err.field << ": " << err.message;
  ASSERT_TRUE(out.guide.has_value());
  EXPECT_EQ(out.guide->kind, Guide::Kind::kJsonSchema);
  EXPECT_EQ(out.guide->text, R"({"type": "object"})");

  in.mutable_constraint()->set_json_object(true);
  ASSERT_TRUE(to_gen_request(in, guided, -1, &out, &err));
  EXPECT_EQ(out.guide->kind, Guide::Kind::kJsonObject);

  // A choice is a regex of exactly those strings, each taken literally.
  auto* choice = in.mutable_constraint()->mutable_choice();
  choice->add_values("yes");
  choice->add_values("a.b (c)|d");
  ASSERT_TRUE(to_gen_request(in, guided, -1, &out, &err));
  EXPECT_EQ(out.guide->kind, Guide::Kind::kRegex);
  EXPECT_EQ(out.guide->text, R"((yes|a\.b \(c\)\|d))");

  in.mutable_constraint()->set_grammar(R"(root ::= "a" | "b")");
  ASSERT_TRUE(to_gen_request(in, guided, -1, &out, &err));
  EXPECT_EQ(out.guide->kind, Guide::Kind::kGrammar);
}

TEST(Translate, PromptLogprobsAreRefusedNamingTheField) {
  auto in = valid();
  in.set_prompt_logprobs(0);
  GenRequest out;
  FieldError err;
  EXPECT_FALSE(to_gen_request(in, info(), -1, &out, &err));
  EXPECT_EQ(err.field, "prompt_logprobs");
}

TEST(Translate, AConstraintTheEngineDoesNotTakeNamesTheField) {
  auto in = valid();
  in.mutable_constraint()->set_regex("[a-z]+");
  GenRequest out;
  FieldError err;
  EXPECT_FALSE(to_gen_request(in, info(), -1, &out, &err));  // no structured output
  EXPECT_EQ(err.field, "constraint.regex");
  EXPECT_NE(err.message.find("it takes: none"), std::string::npos) << err.message;

  in.mutable_constraint()->Clear();
  in.mutable_constraint();  // set, with no kind
  EngineInfo guided = info();
  guided.structured_output = {"regex"};
  EXPECT_FALSE(to_gen_request(in, guided, -1, &out, &err));
  EXPECT_EQ(err.field, "constraint");
}

TEST(Translate, BeamSearchWhereTheEngineHasItAndOnlyWhatItTakes) {
  auto in = valid();
  in.set_beam_width(3);
  GenRequest out;
  FieldError err;
  EXPECT_FALSE(to_gen_request(in, info(), -1, &out, &err));  // the engine has none
  EXPECT_EQ(err.field, "beam_width");
  EXPECT_NE(err.message.find("no beam search"), std::string::npos) << err.message;

  EngineInfo beams = info();
  beams.max_beam_width = 4;
  in.mutable_sampling()->set_temperature(0.f);
  ASSERT_TRUE(to_gen_request(in, beams, -1, &out, &err)) << err.field << ": " << err.message;
  EXPECT_EQ(out.beam_width, 3);
  EXPECT_FALSE(out.streaming);       // the beams change until the search ends
  EXPECT_TRUE(out.return_logprobs);  // each beam's cumulative log probability
  EXPECT_FALSE(out.sampling.temperature.has_value());

  in.set_beam_width(5);
  EXPECT_FALSE(to_gen_request(in, beams, -1, &out, &err));
  EXPECT_EQ(err.field, "beam_width");
  EXPECT_NE(err.message.find("at most 4"), std::string::npos) << err.message;

  in.set_beam_width(2);
  auto seeded = in;
  seeded.mutable_sampling()->set_seed(7);
  EXPECT_FALSE(to_gen_request(seeded, beams, -1, &out, &err));
  EXPECT_EQ(err.field, "sampling.seed");
  auto stopped = in;
  stopped.add_stop_token_ids(9);
  EXPECT_FALSE(to_gen_request(stopped, beams, -1, &out, &err));
  EXPECT_EQ(err.field, "stop_token_ids");
  auto warm = in;
  warm.mutable_sampling()->set_temperature(0.7f);
  EXPECT_FALSE(to_gen_request(warm, beams, -1, &out, &err));
  EXPECT_EQ(err.field, "sampling.temperature");
  auto scored = in;
  scored.set_logprobs(0);
  EXPECT_FALSE(to_gen_request(scored, beams, -1, &out, &err));
  EXPECT_EQ(err.field, "logprobs");
}

TEST(Translate, ABeamSearchsFinalCarriesEveryBeamWithTheEosPutBack) {
  // normalize_end_id leaves a beam search's final alone: no stray EOS chunk before it.
  GenResponse n;
  n.is_final = true;
  n.finish = FinishReason::kEndId;
  n.beams = {{{4}, -1.f, FinishReason::kEndId}};
  normalize_end_id(&n, TokenId{2}, std::nullopt);
  EXPECT_TRUE(n.tokens.empty());

  GenResponse r;
  r.is_final = true;
  r.finish = FinishReason::kEndId;
  r.prompt_tokens = 3;
  r.beams = {{{4, 5}, -1.5f, FinishReason::kEndId},
             {{6, 7, 8}, -2.f, FinishReason::kLength},
             {{9, 3}, -2.5f, FinishReason::kEndId}};  // 3: an extra EOS id, a stop word
  wv1::Final final;
  fill_final(r, 0, std::nullopt, {2, 3}, &final);
  ASSERT_EQ(final.beams_size(), 3);
  const auto& first = final.beams(0);
  EXPECT_EQ(std::vector<std::uint32_t>(first.token_ids().begin(), first.token_ids().end()),
            (std::vector<std::uint32_t>{4, 5, 2}));
  EXPECT_EQ(first.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_TRUE(first.has_eos_token_id());
  EXPECT_EQ(first.eos_token_id(), 2u);
  EXPECT_FLOAT_EQ(first.cumulative_logprob(), -1.5f);
  const auto& second = final.beams(1);
  EXPECT_EQ(second.token_ids_size(), 3);
  EXPECT_EQ(second.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_FALSE(second.has_eos_token_id());
  const auto& third = final.beams(2);  // it ended with its EOS among its tokens
  EXPECT_EQ(third.token_ids_size(), 2);
  EXPECT_EQ(third.eos_token_id(), 3u);
  EXPECT_EQ(third.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(final.usage().completion_tokens(), 8u);  // every beam's tokens
  EXPECT_EQ(final.usage().prompt_tokens(), 3u);
  EXPECT_EQ(final.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(final.stop_reason_case(), wv1::Final::STOP_REASON_NOT_SET);  // per beam only
}

TEST(Translate, AResumedRequestContinuesAfterTheTokensSoFar) {
  auto in = valid();
  for (int t : {11, 12}) in.add_resume_token_ids(t);
  GenRequest out;
  FieldError err;
  ASSERT_TRUE(to_gen_request(in, info(), -1, &out, &err)) << err.field << ": " << err.message;
  EXPECT_EQ(out.prompt, (Tokens{1, 5, 7, 11, 12}));  // the engine continues after them
  EXPECT_EQ(out.resumed_tokens, 2);                  // usage counts them nowhere
  EXPECT_EQ(out.max_tokens, 10);

  in.add_resume_token_ids(77);  // outside the vocabulary of 50
  EXPECT_FALSE(to_gen_request(in, info(), -1, &out, &err));
  EXPECT_EQ(err.field, "resume_token_ids[2]");
  EXPECT_FALSE(err.unsupported);

  // The prompt and the tokens so far leave no room for max_tokens.
  auto full = valid();
  for (int i = 0; i < 90; ++i) full.add_resume_token_ids(4);
  EXPECT_FALSE(to_gen_request(full, info(), -1, &out, &err));
  EXPECT_EQ(err.field, "max_tokens");
  // The tokens so far fill the context: named as what overflowed it.
  for (int i = 0; i < 10; ++i) full.add_resume_token_ids(4);
  EXPECT_FALSE(to_gen_request(full, info(), -1, &out, &err));
  EXPECT_EQ(err.field, "resume_token_ids");
}

TEST(Translate, AConstrainedResumeIsRefusedAsUnsupported) {
  // Guided decoding starts its grammar at the first output token: continuing another
  // worker's constrained output would break the constraint, so it is refused.
  EngineInfo guided = info();
  guided.structured_output = {"choice", "grammar", "json_object", "json_schema", "regex"};
  auto in = valid();
  in.mutable_constraint()->set_regex("[a-z]+");
  in.add_resume_token_ids(11);
  GenRequest out;
  FieldError err;
  EXPECT_FALSE(to_gen_request(in, guided, -1, &out, &err));
  EXPECT_EQ(err.field, "resume_token_ids");
  EXPECT_TRUE(err.unsupported);  // FAILED_PRECONDITION, not INVALID_ARGUMENT

  EngineInfo beams = info();
  beams.max_beam_width = 4;
  auto beam = valid();
  beam.set_beam_width(2);
  beam.add_resume_token_ids(11);
  EXPECT_FALSE(to_gen_request(beam, beams, -1, &out, &err));
  EXPECT_EQ(err.field, "resume_token_ids");
}

}  // namespace
}  // namespace switchyard::rt
