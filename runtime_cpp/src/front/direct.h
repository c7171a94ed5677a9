// The direct path in C++: a worker's StreamResponse, as it arrives, turned into the public
// chunks of the requests that Python handed over (control/workers/stream.py says when),
// so that a streamed token costs Python nothing.
//
// Python hands a request over in the middle of its stream, when everything its next
// chunks need is plain: text from the tokens' bytes (a byte-level BPE vocabulary), no
// logprobs, no stop strings, no cadence, a client that keeps up. A chunk that needs more
// (a token without bytes, logprobs, a full or ended call) and
// every Final or error is left to Python, together with the request's tokens handled here
// (`Handback`), so that Python's state is whole again before it sees the event.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "front/utf8.h"
#include "switchyard/front/v1/front.pb.h"

namespace switchyard::front {

// A vocabulary's tokens as bytes: what a byte-level BPE token spells. Tokens without
// bytes (added and special tokens) are Python's to decode.
class ByteVocab {
 public:
  // The table Python sends: for each token id in order, a little-endian int32 length
  // (-1: no bytes) and that many bytes. Throws std::invalid_argument if it is cut short.
  static std::shared_ptr<const ByteVocab> parse(std::string_view table);
  const std::string* bytes(std::uint32_t id) const {
    return id < has_.size() && has_[id] ? &bytes_[id] : nullptr;
  }
  std::size_t size() const { return has_.size(); }

 private:
  std::vector<std::string> bytes_;
  std::vector<char> has_;
};

// The writes one feed makes: call id and serialized public GenerateResponse, in order.
using Writes = std::vector<std::pair<std::uint64_t, std::string>>;

class DirectTable {
 public:
  // Whether a call can take a message now (open, not full): the front's answer.
  using Ready = std::function<bool(std::uint64_t call)>;

  // Returns the vocabulary's handle.
  int add_vocab(std::shared_ptr<const ByteVocab> vocab);
  // `attempt` on `stream` is handed over: its chunks go to public call `call`, decoded
  // with vocabulary `vocab` after the bytes `pending` (an unfinished character), the last
  // token having come at `last_token_at` (steady clock, seconds). False for an unknown
  // vocabulary or an attempt already handed over.
  bool start(std::uint64_t stream, std::uint64_t attempt, std::uint64_t call, int vocab,
             std::string pending, double last_token_at);
  // Takes an attempt back: what it handled since `start` (none: it was not here).
  bool stop(std::uint64_t stream, std::uint64_t attempt, v1::Handback* out);
  // One worker message (a serialized switchyard.worker.v1.StreamResponse) of `stream`:
  // the chunks of handed-over attempts become `writes`; what is left, and the state of
  // the attempts it concerns, goes in `result`. False if `raw` does not parse.
  bool feed(std::uint64_t stream, std::string_view raw, double now, const Ready& ready,
            Writes& writes, v1::FeedResult* result);
  std::size_t size() const;

 private:
  struct Attempt {
    std::uint64_t call = 0;
    std::shared_ptr<const ByteVocab> vocab;
    std::string pending;
    std::vector<std::uint32_t> ids;  // handled here since start
    double last_token_at = 0;
  };
  using Key = std::pair<std::uint64_t, std::uint64_t>;  // stream, attempt

  static void hand_back(std::uint64_t attempt, Attempt& a, v1::Handback* out);

  mutable std::mutex mu_;  // Python's thread only, in practice; held for no gRPC call
  std::vector<std::shared_ptr<const ByteVocab>> vocabs_;
  std::map<Key, Attempt> attempts_;
};

}  // namespace switchyard::front
