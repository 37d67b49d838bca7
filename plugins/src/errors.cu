// Per-thread last-error message behind sdp_last_error().
#include <string>

#include "common.cuh"

namespace {
thread_local std::string last_error;
}

namespace sdp {
int fail(int code, const std::string& message) {
  last_error = message;
  return code;
}
}  // namespace sdp

extern "C" const char* sdp_last_error(void) { return last_error.c_str(); }
extern "C" int sdp_version(void) { return 1; }
