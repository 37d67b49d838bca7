// Hopper (sm_90a) attention: driver entry point, head-size dispatch, and the instantiations for
// Stable Diffusion's head sizes (40, 64, 80, 160). Compiled for sm_90a only (CMake target
// sdplugins_sm90); the dispatcher in attention.cu calls run() on compute capability 9.0.
#include "attention_sm90_launch.cuh"

namespace sdp {
namespace sm90 {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encoder;
}

// Tiles: 128 query rows (2 warpgroups x 64) x 128 keys. D = 40 reduces Q K^T over 48 columns and
// computes 48 output columns (32-byte swizzle atoms of 16), D = 80 over exactly 80 (five atoms of
// 16), D = 160 over five atoms of 32. Q is double-buffered and K/V triple-buffered where shared
// memory allows (D = 160: 40 KB per Q block and per K/V tile, Q single, K/V double).
int run(const Problem& problem, cudaStream_t stream, bool* not_launched) {
  const int d = problem.head_dim;
  if (d == 40) return launch<Config<40, 48, 128, 2, 3>>(problem, stream, not_launched);
  if (d == 80) return launch<Config<80, 80, 128, 2, 2>>(problem, stream, not_launched);
  if (d == 160) return launch<Config<160, 160, 128, 1, 2>>(problem, stream, not_launched);
  if (d > 32 && d <= 64) return launch<Config<64, 64, 128, 2, 3>>(problem, stream, not_launched);  // 48, 56 padded
  return run_generic(problem, stream, not_launched);
}

}  // namespace sm90
}  // namespace sdp
