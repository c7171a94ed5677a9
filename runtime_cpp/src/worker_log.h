// The worker's log: one line per event, key=value fields, on stderr (the Python side's
// console format), e.g. `[cpp-worker] serving address=127.0.0.1:7001 engine=sim`.
#pragma once

#include <iostream>
#include <string>

namespace switchyard::rt {

inline void log(const std::string& event, const std::string& fields = "") {
  // One write per line: lines from gRPC threads do not interleave.
  std::cerr << ("[cpp-worker] " + event + (fields.empty() ? "" : " ") + fields + "\n")
            << std::flush;
}

}  // namespace switchyard::rt
