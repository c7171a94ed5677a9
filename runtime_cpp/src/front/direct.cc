#include "front/direct.h"

#include <cstring>
#include <stdexcept>

#include "switchyard/v1/generation.pb.h"
#include "switchyard/worker/v1/worker.pb.h"

namespace switchyard::front {

std::shared_ptr<const ByteVocab> ByteVocab::parse(std::string_view table) {
  auto vocab = std::make_shared<ByteVocab>();
  std::size_t at = 0;
  while (at < table.size()) {
    if (table.size() - at < 4) throw std::invalid_argument("vocabulary table cut short");
    std::uint32_t raw;
    std::memcpy(&raw, table.data() + at, 4);  // little-endian (x86-64, aarch64)
    at += 4;
    const auto length = static_cast<std::int32_t>(raw);
    if (length < 0) {
      vocab->bytes_.emplace_back();
      vocab->has_.push_back(0);
      continue;
    }
    if (table.size() - at < static_cast<std::size_t>(length)) {
      throw std::invalid_argument("vocabulary table cut short");
    }
    vocab->bytes_.emplace_back(table.substr(at, static_cast<std::size_t>(length)));
    vocab->has_.push_back(1);
    at += static_cast<std::size_t>(length);
  }
  return vocab;
}

int DirectTable::add_vocab(std::shared_ptr<const ByteVocab> vocab) {
  std::lock_guard<std::mutex> lock(mu_);
  vocabs_.push_back(std::move(vocab));
  return static_cast<int>(vocabs_.size()) - 1;
}

bool DirectTable::start(std::uint64_t stream, std::uint64_t attempt, std::uint64_t call,
                        int vocab, std::string pending, double last_token_at) {
  std::lock_guard<std::mutex> lock(mu_);
  if (vocab < 0 || static_cast<std::size_t>(vocab) >= vocabs_.size()) return false;
  Attempt a;
  a.call = call;
  a.vocab = vocabs_[vocab];
  a.pending = std::move(pending);
  a.last_token_at = last_token_at;
  return attempts_.emplace(Key{stream, attempt}, std::move(a)).second;
}

void DirectTable::hand_back(std::uint64_t attempt, Attempt& a, v1::Handback* out) {
  out->set_attempt(attempt);
  out->mutable_token_ids()->Add(a.ids.begin(), a.ids.end());
  out->set_last_token_at(a.last_token_at);
}

bool DirectTable::stop(std::uint64_t stream, std::uint64_t attempt, v1::Handback* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = attempts_.find(Key{stream, attempt});
  if (it == attempts_.end()) return false;
  hand_back(attempt, it->second, out);
  attempts_.erase(it);
  return true;
}

std::size_t DirectTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return attempts_.size();
}

bool DirectTable::feed(std::uint64_t stream, std::string_view raw, double now,
                       const Ready& ready, Writes& writes, v1::FeedResult* result) {
  worker::v1::StreamResponse message;
  if (!message.ParseFromArray(raw.data(), static_cast<int>(raw.size()))) return false;
  worker::v1::StreamResponse rest;
  std::string bytes;
  std::string text;
  std::uint64_t tokens = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& event : *message.mutable_events()) {
    auto it = attempts_.find(Key{stream, event.attempt_id()});
    if (it == attempts_.end()) {
      *rest.add_events() = std::move(event);
      continue;
    }
    Attempt& a = it->second;
    bool taken = false;
    if (event.has_chunk()) {
      const auto& chunk = event.chunk();
      const int n = chunk.token_ids_size();
      bool plain = n > 0 && chunk.logprobs_size() == 0 && chunk.prompt_logprobs_size() == 0;
      bytes.clear();
      for (int k = 0; plain && k < n; ++k) {
        const std::string* b = a.vocab->bytes(chunk.token_ids(k));
        if (b == nullptr) {
          plain = false;
        } else {
          bytes.append(*b);
        }
      }
      if (plain && ready(a.call)) {
        text.clear();
        utf8_append(a.pending, bytes, text);
        switchyard::v1::GenerateResponse out;
        auto* public_chunk = out.mutable_chunk();
        public_chunk->set_text(text);
        public_chunk->mutable_token_ids()->CopyFrom(chunk.token_ids());
        writes.emplace_back(a.call, out.SerializeAsString());
        a.ids.insert(a.ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
        result->add_itl((now - a.last_token_at) / n);
        a.last_token_at = now;
        tokens += static_cast<std::uint64_t>(n);
        taken = true;
      }
    }
    if (!taken) {
      hand_back(event.attempt_id(), a, result->add_handbacks());
      attempts_.erase(it);
      *rest.add_events() = std::move(event);
    }
  }
  result->set_tokens(tokens);
  if (rest.events_size() > 0) rest.SerializeToString(result->mutable_rest());
  return true;
}

}  // namespace switchyard::front
