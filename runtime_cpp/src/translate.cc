#include "translate.h"

#include <algorithm>
#include <cmath>
#include <string_view>

namespace switchyard::rt {
namespace {

bool bad(FieldError* e, std::string field, std::string message) {
  e->field = std::move(field);
  e->message = std::move(message);
  return false;
}

bool in_range(float v, float lo, float hi) { return std::isfinite(v) && v >= lo && v <= hi; }

bool takes(const EngineInfo& info, const std::string& kind) {
  return std::find(info.structured_output.begin(), info.structured_output.end(), kind) !=
         info.structured_output.end();
}

std::string taken(const EngineInfo& info) {
  std::string out;
  for (const auto& k : info.structured_output) out += (out.empty() ? "" : ", ") + k;
  return out.empty() ? "none" : out;
}

bool to_guide(const v1::OutputConstraint& c, const EngineInfo& info, Guide* out,
              FieldError* error) {
  using C = v1::OutputConstraint;
  std::string kind;
  switch (c.kind_case()) {
    case C::kJsonSchema: kind = "json_schema"; break;
    case C::kJsonObject: kind = "json_object"; break;
    case C::kRegex: kind = "regex"; break;
    case C::kChoice: kind = "choice"; break;
    case C::kGrammar: kind = "grammar"; break;
    case C::KIND_NOT_SET: return bad(error, "constraint", "set one of its kinds");
  }
  if (!takes(info, kind)) {
    return bad(error, "constraint." + kind,
               "this engine does not take that structured-output kind (it takes: " +
                   taken(info) + ")");
  }
  switch (c.kind_case()) {
    case C::kJsonSchema: *out = {Guide::Kind::kJsonSchema, c.json_schema()}; break;
    case C::kJsonObject: *out = {Guide::Kind::kJsonObject, ""}; break;
    case C::kRegex: *out = {Guide::Kind::kRegex, c.regex()}; break;
    case C::kGrammar: *out = {Guide::Kind::kGrammar, c.grammar()}; break;
    default: {
      if (c.choice().values_size() == 0) {
        return bad(error, "constraint.choice.values", "give at least one choice");
      }
      *out = {Guide::Kind::kRegex, choice_regex(c.choice().values())};
    }
  }
  return true;
}

}  // namespace

std::string choice_regex(const google::protobuf::RepeatedPtrField<std::string>& choices) {
  std::string out = "(";
  for (int i = 0; i < choices.size(); ++i) {
    if (i > 0) out += '|';
    for (char ch : choices.Get(i)) {
      if (std::string_view("\\^$.|?*+()[]{}").find(ch) != std::string_view::npos) out += '\\';
      out += ch;
    }
  }
  return out + ")";
}

namespace {

// Beam search ranks beams by the model's own log probabilities and ends a beam at the
// EOS: what else a request asks for is refused, the same as on the vLLM worker.
bool to_beam_search(const wv1::GenerateRequest& in, const EngineInfo& info, GenRequest* out,
                    FieldError* error) {
  const auto width = in.beam_width();
  if (info.max_beam_width < 2) return bad(error, "beam_width", "this engine has no beam search");
  if (width > static_cast<std::uint32_t>(info.max_beam_width)) {
    return bad(error, "beam_width",
               "this engine searches at most " + std::to_string(info.max_beam_width) +
                   " beams, got " + std::to_string(width));
  }
  const auto& s = in.sampling();
  const char* why = "not with beam search (beam_width > 1)";
  if (s.has_temperature() && s.temperature() != 0.f) {
    return bad(error, "sampling.temperature", std::string(why) + "; it ranks beams by the "
               "model's own log probabilities (temperature 0)");
  }
  if (s.has_top_p()) return bad(error, "sampling.top_p", why);
  if (s.has_top_k()) return bad(error, "sampling.top_k", why);
  if (s.has_min_p()) return bad(error, "sampling.min_p", why);
  if (s.has_repetition_penalty()) return bad(error, "sampling.repetition_penalty", why);
  if (s.has_presence_penalty()) return bad(error, "sampling.presence_penalty", why);
  if (s.has_frequency_penalty()) return bad(error, "sampling.frequency_penalty", why);
  if (s.has_seed()) return bad(error, "sampling.seed", why);
  if (in.stop_token_ids_size() > 0) return bad(error, "stop_token_ids", why);
  if (in.min_tokens() > 0) return bad(error, "min_tokens", why);
  if (in.has_logprobs()) return bad(error, "logprobs", why);
  if (in.has_constraint()) return bad(error, "constraint", why);
  if (in.resume_token_ids_size() > 0) return bad(error, "resume_token_ids", why);
  out->beam_width = static_cast<std::int32_t>(width);
  out->streaming = false;       // the beams change until the search ends
  out->return_logprobs = true;  // for each beam's cumulative log probability
  out->sampling.temperature.reset();  // greedy scoring: the model's own log probabilities
  return true;
}

// Appends `ids` to `out`, or names the first outside the vocabulary as field[index].
bool append_ids(const google::protobuf::RepeatedField<std::uint32_t>& ids, const char* field,
                const EngineInfo& info, Tokens* out, FieldError* error) {
  for (int i = 0; i < ids.size(); ++i) {
    const auto t = ids.Get(i);
    if (t >= static_cast<std::uint32_t>(info.vocab_size)) {
      return bad(error, std::string(field) + "[" + std::to_string(i) + "]",
                 "token id " + std::to_string(t) + " is outside the vocabulary (size " +
                     std::to_string(info.vocab_size) + ")");
    }
    out->push_back(static_cast<TokenId>(t));
  }
  return true;
}

}  // namespace

bool to_gen_request(const wv1::GenerateRequest& in, const EngineInfo& info, double deadline_ms,
                    GenRequest* out, FieldError* error) {
  if (in.prompt_token_ids_size() == 0) return bad(error, "prompt_token_ids", "must not be empty");
  // The prompt, then (a resumed request) the output so far: the engine continues after both.
  out->prompt.clear();
  if (!append_ids(in.prompt_token_ids(), "prompt_token_ids", info, &out->prompt, error) ||
      !append_ids(in.resume_token_ids(), "resume_token_ids", info, &out->prompt, error)) {
    return false;
  }
  out->resumed_tokens = in.resume_token_ids_size();
  const auto n = static_cast<int>(out->prompt.size());
  // Too long for the engine: the prompt, or (resumed) the prompt with the tokens so far.
  const char* input_field = in.resume_token_ids_size() > 0 ? "resume_token_ids" : "prompt_token_ids";
  const std::string input = in.resume_token_ids_size() > 0
                                ? "the prompt and the tokens so far have "
                                : "the prompt has ";
  if (n >= info.max_context) {
    return bad(error, input_field,
               input + std::to_string(n) + " tokens; the context is " +
                   std::to_string(info.max_context));
  }
  if (info.max_input_len > 0 && n > info.max_input_len) {
    return bad(error, input_field,
               input + std::to_string(n) + " tokens; the engine takes at most " +
                   std::to_string(info.max_input_len) + " (max_input_len)");
  }
  if (in.max_tokens() < 1) return bad(error, "max_tokens", "must be at least 1");
  if (static_cast<std::int64_t>(n) + in.max_tokens() > info.max_context) {
    return bad(error, "max_tokens",
               std::to_string(in.max_tokens()) + " tokens do not fit: the prompt has " +
                   std::to_string(n) + " and the context is " + std::to_string(info.max_context));
  }
  if (in.min_tokens() > in.max_tokens()) {
    return bad(error, "min_tokens", "more than max_tokens");
  }
  out->max_tokens = static_cast<std::int32_t>(in.max_tokens());

  const auto& s = in.sampling();
  auto& o = out->sampling;
  if (s.has_temperature()) {
    if (!in_range(s.temperature(), 0.f, INFINITY)) return bad(error, "sampling.temperature", "must be >= 0");
    o.temperature = s.temperature();
  }
  if (s.has_top_p()) {
    if (!(std::isfinite(s.top_p()) && s.top_p() > 0.f && s.top_p() <= 1.f)) {
      return bad(error, "sampling.top_p", "must be in (0, 1]");
    }
    o.top_p = s.top_p();
  }
  if (s.has_top_k()) {
    if (s.top_k() < -1) return bad(error, "sampling.top_k", "must be -1, 0 or >= 1");
    if (s.top_k() > 0) o.top_k = s.top_k();
  }
  if (s.has_min_p()) {
    if (!in_range(s.min_p(), 0.f, 1.f)) return bad(error, "sampling.min_p", "must be in [0, 1]");
    o.min_p = s.min_p();
  }
  if (s.has_repetition_penalty()) {
    if (!(std::isfinite(s.repetition_penalty()) && s.repetition_penalty() > 0.f)) {
      return bad(error, "sampling.repetition_penalty", "must be > 0");
    }
    o.repetition_penalty = s.repetition_penalty();
  }
  if (s.has_presence_penalty()) {
    if (!in_range(s.presence_penalty(), -2.f, 2.f)) return bad(error, "sampling.presence_penalty", "must be in [-2, 2]");
    o.presence_penalty = s.presence_penalty();
  }
  if (s.has_frequency_penalty()) {
    if (!in_range(s.frequency_penalty(), -2.f, 2.f)) return bad(error, "sampling.frequency_penalty", "must be in [-2, 2]");
    o.frequency_penalty = s.frequency_penalty();
  }
  if (s.has_seed()) o.seed = s.seed();
  o.min_tokens = static_cast<std::int32_t>(in.min_tokens());

  out->stop_words.clear();
  for (int i = 0; i < in.stop_token_ids_size(); ++i) {
    auto t = in.stop_token_ids(i);
    if (t >= static_cast<std::uint32_t>(info.vocab_size)) {
      return bad(error, "stop_token_ids[" + std::to_string(i) + "]", "outside the vocabulary");
    }
    out->stop_words.push_back({static_cast<TokenId>(t)});
  }
  if (in.ignore_eos() || info.eos_token_ids.empty()) {
    out->end_id.reset();
  } else {
    out->end_id = info.eos_token_ids.front();
    // Further EOS ids stop like stop tokens.
    for (std::size_t i = 1; i < info.eos_token_ids.size(); ++i) {
      out->stop_words.push_back({info.eos_token_ids[i]});
    }
  }
  out->pad_id = out->end_id;
  out->streaming = true;
  if (in.has_logprobs()) {
    if (in.logprobs() > 0) {
      return bad(error, "logprobs",
                 "this worker returns the sampled token's log probability only; "
                 "top-n alternatives are not supported (ask for 0)");
    }
    out->return_logprobs = true;
  }
  if (in.has_prompt_logprobs()) {
    return bad(error, "prompt_logprobs",
               "this worker does not return the prompt's log probabilities");
  }
  out->priority = in.priority();
  if (in.has_constraint() && in.resume_token_ids_size() > 0) {
    // TensorRT-LLM's guided decoding starts its grammar at the first output token and
    // cannot be advanced past tokens it did not generate (Capabilities say: none resume).
    error->unsupported = true;
    return bad(error, "resume_token_ids",
               "this engine cannot continue a constrained output after another worker's "
               "tokens (its guided decoding starts at the first output token)");
  }
  if (in.has_constraint()) {
    Guide guide;
    if (!to_guide(in.constraint(), info, &guide, error)) return false;
    out->guide = std::move(guide);
  }
  if (deadline_ms >= 0) {
    out->allotted_time = std::chrono::milliseconds(static_cast<std::int64_t>(deadline_ms));
  }
  out->beam_width = 1;
  if (in.beam_width() > 1) return to_beam_search(in, info, out, error);
  return true;
}

void normalize_end_id(GenResponse* r, std::optional<TokenId> end_id,
                      std::optional<TokenId> last_streamed) {
  if (!r->is_final || r->finish != FinishReason::kEndId || !end_id || !r->error.empty()) return;
  if (!r->beams.empty()) return;  // a beam search: fill_beams puts each beam's EOS back
  const std::optional<TokenId> last = r->tokens.empty() ? last_streamed
                                                        : std::optional<TokenId>(r->tokens.back());
  // The end id stops generation the moment it is sampled, so an output that already ends
  // with it came from an engine that includes it (vLLM's convention, or a release that does).
  if (last == end_id) return;
  r->tokens.push_back(*end_id);
}

void append_chunk(const GenResponse& r, wv1::Chunk* chunk) {
  for (std::size_t i = 0; i < r.tokens.size(); ++i) {
    chunk->add_token_ids(static_cast<std::uint32_t>(r.tokens[i]));
    if (i < r.logprobs.size()) {
      auto* lp = chunk->add_logprobs();
      lp->set_token_id(static_cast<std::uint32_t>(r.tokens[i]));
      lp->set_logprob(r.logprobs[i]);
    }
  }
}

bool ChunkCadence::add(const GenResponse& r) {
  append_chunk(r, &held_);
  const auto held = static_cast<std::uint32_t>(held_.token_ids_size());
  if (held == 0) return false;
  return !sent_any_ || r.is_final || held >= std::max<std::uint32_t>(interval_, 1);
}

void ChunkCadence::take(wv1::Chunk* chunk) {
  if (held_.token_ids_size() == 0) return;
  sent_any_ = true;
  if (chunk->token_ids_size() == 0 && chunk->logprobs_size() == 0 &&
      chunk->prompt_logprobs_size() == 0) {
    chunk->Swap(&held_);  // nothing coalesced yet: no copy
  } else {
    chunk->MergeFrom(held_);
  }
  held_.Clear();
}

::switchyard::v1::FinishReason to_wire(FinishReason reason) {
  using W = ::switchyard::v1::FinishReason;
  switch (reason) {
    case FinishReason::kEndId:
    case FinishReason::kStopWords: return W::FINISH_REASON_STOP;
    case FinishReason::kLength: return W::FINISH_REASON_LENGTH;
    case FinishReason::kTimedOut: return W::FINISH_REASON_TIME_LIMIT;
    case FinishReason::kCancelled: return W::FINISH_REASON_CANCELLED;
    case FinishReason::kNotFinished: break;
  }
  return W::FINISH_REASON_ERROR;
}

namespace {

// A finished beam search's beams; an EOS that ended a beam is put back, as a sample has it.
std::int32_t fill_beams(const GenResponse& r, const std::vector<TokenId>& eos_ids,
                        wv1::Final* out) {
  std::int32_t total = 0;
  auto is_eos = [&](TokenId t) {
    return std::find(eos_ids.begin(), eos_ids.end(), t) != eos_ids.end();
  };
  for (const BeamResult& b : r.beams) {
    auto* beam = out->add_beams();
    for (TokenId t : b.tokens) beam->add_token_ids(static_cast<std::uint32_t>(t));
    // An extra EOS id (a stop word) is among the beam's tokens; the end id is not.
    const bool ends_in_eos = !b.tokens.empty() && is_eos(b.tokens.back());
    const bool at_eos = b.finish == FinishReason::kEndId && (ends_in_eos || !eos_ids.empty());
    if (at_eos) {
      const TokenId eos = ends_in_eos ? b.tokens.back() : eos_ids.front();
      if (!ends_in_eos) beam->add_token_ids(static_cast<std::uint32_t>(eos));
      beam->set_eos_token_id(static_cast<std::uint32_t>(eos));
    }
    beam->set_finish_reason(at_eos ? ::switchyard::v1::FINISH_REASON_STOP
                                   : ::switchyard::v1::FINISH_REASON_LENGTH);
    beam->set_cumulative_logprob(b.cumulative_logprob);
    total += beam->token_ids_size();
  }
  return total;
}

}  // namespace

void fill_final(const GenResponse& r, std::int32_t completion_tokens,
                std::optional<TokenId> last_token, const std::vector<TokenId>& eos_ids,
                wv1::Final* out) {
  const bool beams = !r.beams.empty() && r.error.empty();
  if (beams) completion_tokens = fill_beams(r, eos_ids, out);
  if (!r.error.empty()) {
    out->set_finish_reason(::switchyard::v1::FINISH_REASON_ERROR);
    out->set_error_message(r.error);
  } else {
    out->set_finish_reason(to_wire(r.finish));
  }
  if (!r.tokens.empty()) last_token = r.tokens.back();
  if (beams) last_token.reset();  // each beam has its own stop reason
  if (last_token && (r.finish == FinishReason::kEndId || r.finish == FinishReason::kStopWords)) {
    const bool is_eos =
        std::find(eos_ids.begin(), eos_ids.end(), *last_token) != eos_ids.end();
    // Extra EOS ids travel as stop words; they are still the model's end of sequence.
    if (r.finish == FinishReason::kEndId || is_eos) {
      out->set_eos_token_id(static_cast<std::uint32_t>(*last_token));
    } else {
      out->set_stop_token_id(static_cast<std::uint32_t>(*last_token));
    }
  }
  auto* usage = out->mutable_usage();
  usage->set_prompt_tokens(static_cast<std::uint32_t>(r.prompt_tokens));
  usage->set_completion_tokens(static_cast<std::uint32_t>(completion_tokens));
  usage->set_cached_prompt_tokens(static_cast<std::uint32_t>(r.cached_prompt_tokens));
  out->set_queue_ms(r.queue_ms);
}

}  // namespace switchyard::rt
