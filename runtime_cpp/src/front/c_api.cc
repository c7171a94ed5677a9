// The front as a plain C library (libswitchyard_front.so), loaded by Python's ctypes:
// no Python headers, so one build serves every Python version. Errors come back as a
// message in the caller's buffer and a null or negative result.
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

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
  std::string events = static_cast<Front*>(front)->poll();
  *size = events.size();
  *data = nullptr;
  if (events.empty()) return 0;
  *data = static_cast<char*>(std::malloc(events.size()));
  if (*data == nullptr) return -1;
  std::memcpy(*data, events.data(), events.size());
  return 0;
}

SY_EXPORT void sy_front_free(char* data) { std::free(data); }

SY_EXPORT void sy_front_apply(void* front, const char* data, std::size_t size) {
  static_cast<Front*>(front)->apply(std::string(data, size));
}

SY_EXPORT unsigned long long sy_front_bad_batches(void* front) {
  return static_cast<Front*>(front)->bad_batches();
}

SY_EXPORT void sy_front_shutdown(void* front, double grace_s) {
  static_cast<Front*>(front)->shutdown(grace_s);
}

SY_EXPORT void sy_front_destroy(void* front) { delete static_cast<Front*>(front); }

}  // extern "C"
