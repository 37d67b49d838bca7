// GeLU, tanh approximation (the feed-forward activation of SD3 and Flux, diffusers' GELU(approximate="tanh")):
// y = gelu_tanh(x + bias), the bias optional. A 2-D grid (columns x rows) keeps 64-bit divisions out of the
// per-element path.
#include <algorithm>

#include "common.cuh"

namespace sdp {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float gelu_tanh(float v) {
  constexpr float kSqrt2OverPi = 0.79788456080286536f;
  return 0.5f * v * (1.f + tanhf(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
}

template <int V, bool BIAS>  // V = 8: 16-byte vectors (N % 8 == 0, aligned); V = 1: any N
__global__ void __launch_bounds__(kThreads) gelu_tanh_kernel(const half* x, const half* bias, half* y, int64_t rows,
                                                             int n) {
  const int c = (blockIdx.x * kThreads + threadIdx.x) * V;
  if (c >= n) return;
  float b[8];
  if constexpr (BIAS) {
    if constexpr (V == 8) load8(bias + c, b); else b[0] = __half2float(bias[c]);
  }
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    float v[8];
    if constexpr (V == 8) load8(x + row * n + c, v); else v[0] = __half2float(x[row * n + c]);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      if constexpr (BIAS) v[e] += b[e];
      v[e] = gelu_tanh(v[e]);
    }
    if constexpr (V == 8) store8(y + row * n + c, v); else y[row * n + c] = __float2half(v[0]);
  }
}

template <int V>
int launch(const half* x, const half* bias, half* y, int64_t rows, int n, cudaStream_t s) {
  const dim3 grid(blocks_for((n + V - 1) / V, kThreads), unsigned(std::min<int64_t>(rows, 65535)));
  if (bias) gelu_tanh_kernel<V, true><<<grid, kThreads, 0, s>>>(x, bias, y, rows, n);
  else gelu_tanh_kernel<V, false><<<grid, kThreads, 0, s>>>(x, bias, y, rows, n);
  return check_launch("gelu_tanh");
}

}  // namespace
}  // namespace sdp

extern "C" int sdp_gelu_tanh(const void* x, const void* bias, void* y, int64_t rows, int n, sdp_stream_t stream) {
  SDP_REQUIRE(rows >= 1 && n >= 1, "rows and n must be >= 1");
  SDP_REQUIRE(x && y, "x and y must be non-null");
  const half *xh = static_cast<const half*>(x), *bh = static_cast<const half*>(bias);
  half* yh = static_cast<half*>(y);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool vector = n % 8 == 0 && sdp::aligned16(x) && sdp::aligned16(y) && (!bias || sdp::aligned16(bias));
  return vector ? sdp::launch<8>(xh, bh, yh, rows, n, s) : sdp::launch<1>(xh, bh, yh, rows, n, s);
}
