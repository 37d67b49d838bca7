// Hopper (sm_90a) attention for the other head sizes: D (a multiple of 8 up to 256) is padded up to
// 32, 96, 128, 192 or 256 (48 and 56 to 64, in attention_sm90.cu) inside shared memory (TMA fills the columns past
// D with zeros), so no padded copy of the inputs is ever made.
#include "attention_sm90_launch.cuh"

namespace sdp {
namespace sm90 {

int run_generic(const Problem& problem, cudaStream_t stream, bool* not_launched) {
  const int d = problem.head_dim;
  if (d <= 32) return launch<Config<32, 32, 128, 2, 3>>(problem, stream, not_launched);
  if (d <= 96) return launch<Config<96, 96, 128, 2>>(problem, stream, not_launched);
  if (d <= 128) return launch<Config<128, 128, 128, 2>>(problem, stream, not_launched);
  if (d <= 192) return launch<Config<192, 192, 64, 2>>(problem, stream, not_launched);
  return launch<Config<256, 256, 64, 1>>(problem, stream, not_launched);
}

}  // namespace sm90
}  // namespace sdp
