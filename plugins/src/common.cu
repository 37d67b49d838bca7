// Host-side helpers shared by the kernel families: the per-thread last-error message behind
// sdp_last_error(), and device queries.
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

int multiprocessors() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count > 0 ? count : 1;
}
}  // namespace sdp

extern "C" const char* sdp_last_error(void) { return last_error.c_str(); }
extern "C" int sdp_version(void) { return 1; }
