// Shared helpers: argument checks with messages, launch checks, fp16 vector access, warp reductions.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "sdplugins.h"

namespace sdp {

int fail(int code, const std::string& message);  // records message, returns code
int multiprocessors();                            // of the current device

// Returns from the calling ABI function with SDP_INVALID_ARGUMENT when `cond` is false.
#define SDP_REQUIRE(cond, msg)                                                        \
  do {                                                                                \
    if (!(cond)) return ::sdp::fail(SDP_INVALID_ARGUMENT, std::string(__func__) + ": " + (msg)); \
  } while (0)

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// After a launch: report configuration or launch errors instead of losing them.
inline int check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(SDP_CUDA_ERROR, std::string(what) + ": " + cudaGetErrorString(err));
  return SDP_OK;
}

inline unsigned blocks_for(int64_t work, int per_block) {
  return static_cast<unsigned>((work + per_block - 1) / per_block);
}

// 8 fp16 values <-> fp32, through one 16-byte access.
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
  const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const half* p, float (&v)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), v);
}

__device__ __forceinline__ void store8(half* p, const float (&v)[8]) {
  uint4 raw;
  half2* h = reinterpret_cast<half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over aligned groups of LANES lanes (a power of two <= 32); every lane of the warp takes part.
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* >= 32 floats */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// Rows held in registers (the row kernels of rms_norm.cu and ada_layer_norm.cu): a row of n fp16 values,
// n % 8 == 0 and n <= kMaxRegisterRow, is read by LANES lanes of one warp (32 / LANES rows per warp), VPL
// 16-byte vectors per lane. Calls launch(VPL, LANES) (std::integral_constant) for the smallest tiling of n.
constexpr int kMaxRegisterRow = 4096;

template <class Launch>
int with_row_tiling(int n, Launch&& launch) {
  using one = std::integral_constant<int, 1>;
  using lanes32 = std::integral_constant<int, 32>;
  if (n <= 8) return launch(one{}, one{});
  if (n <= 16) return launch(one{}, std::integral_constant<int, 2>{});
  if (n <= 32) return launch(one{}, std::integral_constant<int, 4>{});
  if (n <= 64) return launch(one{}, std::integral_constant<int, 8>{});
  if (n <= 128) return launch(one{}, std::integral_constant<int, 16>{});
  if (n <= 256) return launch(one{}, lanes32{});
  if (n <= 512) return launch(std::integral_constant<int, 2>{}, lanes32{});
  if (n <= 1024) return launch(std::integral_constant<int, 4>{}, lanes32{});
  if (n <= 2048) return launch(std::integral_constant<int, 8>{}, lanes32{});
  return launch(std::integral_constant<int, 16>{}, lanes32{});
}

// Threads for a block-per-row kernel over n values read V at a time: a multiple of 32, at most 256.
inline int row_block_threads(int n, int v) {
  const int64_t vectors = (int64_t(n) + v - 1) / v;
  return vectors >= 256 ? 256 : int((vectors + 31) / 32 * 32);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

}  // namespace sdp
