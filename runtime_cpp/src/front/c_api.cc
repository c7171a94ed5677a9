// The front as a plain C library (libswitchyard_front.so), loaded by Python's ctypes:
// no Python headers, so one build serves every Python version. Errors come back as a
// message in the caller's buffer and a null or negative result.
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "front/front.h"

using switchyard::front::Front;
using switchyard::front::FrontOptions;

namespace {

void say(char* error, std::size_t size, const char* message) {
  if (error == nullptr || size == 0) return;
  std::strncpy(error, message, size - 1);
  error[size - 1] = '\0';
}

std::string text(const char* s) { return s == nullptr ? std::string() : std::string(s); }

// `bytes` into a malloc'd *data (none when empty), for Python to copy and free.
int hand_out(const std::string& bytes, char** data, std::size_t* size) {
  *size = bytes.size();
  *data = nullptr;
  if (bytes.empty()) return 0;
  *data = static_cast<char*>(std::malloc(bytes.size()));
  if (*data == nullptr) return -1;
  std::memcpy(*data, bytes.data(), bytes.size());
  return 0;
}

}  // namespace

#define SY_EXPORT __attribute__((visibility("default")))

extern "C" {

SY_EXPORT void* sy_front_start(const char* address, int reuse_port, int max_message_bytes,
                     int max_metadata_bytes, const char* cert_pem, const char* key_pem, const char* client_ca_pem,
                     char* error, std::size_t error_size) {
  try {
    FrontOptions options;
    options.address = text(address);
    options.reuse_port = reuse_port != 0;
    options.max_message_bytes = max_message_bytes;
    options.max_metadata_bytes = max_metadata_bytes;
    options.cert_pem = text(cert_pem);
    options.key_pem = text(key_pem);
    options.client_ca_pem = text(client_ca_pem);
    return new Front(options);
  } catch (const std::exception& e) {
    say(error, error_size, e.what());
    return nullptr;
  }
}

SY_EXPORT int sy_front_port(void* front) { return static_cast<Front*>(front)->port(); }

SY_EXPORT int sy_front_event_fd(void* front) { return static_cast<Front*>(front)->event_fd(); }

SY_EXPORT long sy_front_open_calls(void* front) {
  return static_cast<long>(static_cast<Front*>(front)->open_calls());
}

// Every event since the last poll: *data (free it with sy_front_free) and *size; 0 bytes
// when there are none.
SY_EXPORT int sy_front_poll(void* front, char** data, std::size_t* size) {
  return hand_out(static_cast<Front*>(front)->poll(), data, size);
}

SY_EXPORT void sy_front_free(char* data) { std::free(data); }

SY_EXPORT void sy_front_apply(void* front, const char* data, std::size_t size) {
  static_cast<Front*>(front)->apply(std::string(data, size));
}

SY_EXPORT unsigned long long sy_front_bad_batches(void* front) {
  return static_cast<Front*>(front)->bad_batches();
}

// ---- the direct path (direct.h) --------------------------------------------------------

// A vocabulary table's handle, or -1 (the table is cut short).
SY_EXPORT int sy_front_vocab(void* front, const char* table, std::size_t size) {
  try {
    return static_cast<Front*>(front)->add_vocab(std::string_view(table, size));
  } catch (const std::exception&) {
    return -1;
  }
}

SY_EXPORT int sy_front_direct_start(void* front, unsigned long long stream,
                                    unsigned long long attempt, unsigned long long call,
                                    int vocab, const char* pending, std::size_t pending_size,
                                    double last_token_at) {
  return static_cast<Front*>(front)->direct_start(stream, attempt, call, vocab,
                                                  std::string(pending, pending_size),
                                                  last_token_at)
             ? 0
             : -1;
}

// The attempt's serialized Handback in *data (free it with sy_front_free); 0 bytes when it
// was not handed over.
SY_EXPORT int sy_front_direct_stop(void* front, unsigned long long stream,
                                   unsigned long long attempt, char** data, std::size_t* size) {
  return hand_out(static_cast<Front*>(front)->direct_stop(stream, attempt), data, size);
}

// One worker message: the serialized FeedResult in *data (free it with sy_front_free);
// -1 when the message does not parse.
SY_EXPORT int sy_front_feed(void* front, unsigned long long stream, const char* raw,
                            std::size_t size, char** data, std::size_t* out_size) {
  try {
    return hand_out(static_cast<Front*>(front)->feed(stream, std::string_view(raw, size)),
                    data, out_size);
  } catch (const std::exception&) {
    *data = nullptr;
    *out_size = 0;
    return -1;
  }
}

SY_EXPORT void sy_front_shutdown(void* front, double grace_s) {
  static_cast<Front*>(front)->shutdown(grace_s);
}

SY_EXPORT void sy_front_destroy(void* front) { delete static_cast<Front*>(front); }

}  // extern "C"
