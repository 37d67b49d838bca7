// SplitGeLU (GEGLU's activation): y = x[..., :N] * gelu_erf(x[..., N:]), optionally after adding bias.
// A 2-D grid (columns x rows) keeps 64-bit divisions out of the per-element path.
#include <algorithm>

#include "common.cuh"

namespace sdp {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float gelu_erf(float g) { return 0.5f * g * (1.f + erff(g * 0.70710678118654752f)); }

// The value half x[c, c+V) and the gate half x[n+c, n+c+V) of one row (or of the bias).
template <int V>
__device__ __forceinline__ void load_halves(const half* row, int c, int n, float (&a)[8], float (&g)[8]) {
  if constexpr (V == 8) {
    load8(row + c, a);
    load8(row + n + c, g);
  } else {
    a[0] = __half2float(row[c]);
    g[0] = __half2float(row[n + c]);
  }
}

template <int V, bool BIAS>  // V = 8: 16-byte vectors (N % 8 == 0); V = 1: any N
__global__ void __launch_bounds__(kThreads) split_gelu_kernel(const half* x, const half* bias, half* y, int64_t rows, int n) {
  const int c = (blockIdx.x * kThreads + threadIdx.x) * V;
  if (c >= n) return;
  float ba[8], bg[8];
  if constexpr (BIAS) load_halves<V>(bias, c, n, ba, bg);
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    float a[8], g[8];
    load_halves<V>(x + row * 2 * n, c, n, a, g);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      if constexpr (BIAS) a[e] += ba[e], g[e] += bg[e];
      a[e] *= gelu_erf(g[e]);
    }
    if constexpr (V == 8) store8(y + row * n + c, a); else y[row * n + c] = __float2half(a[0]);
  }
}

template <int V>
int launch(const half* x, const half* bias, half* y, int64_t rows, int n, cudaStream_t s) {
  const dim3 grid(blocks_for(n / V, kThreads), unsigned(std::min<int64_t>(rows, 65535)));
  if (bias) split_gelu_kernel<V, true><<<grid, kThreads, 0, s>>>(x, bias, y, rows, n);
  else split_gelu_kernel<V, false><<<grid, kThreads, 0, s>>>(x, bias, y, rows, n);
  return check_launch("split_gelu");
}

}  // namespace
}  // namespace sdp

extern "C" int sdp_split_gelu(const void* x, const void* bias, void* y, int64_t rows, int n, sdp_stream_t stream) {
  SDP_REQUIRE(rows >= 1 && n >= 1, "rows and n must be >= 1");
  SDP_REQUIRE(x && y, "x and y must be non-null");
  const half *xh = static_cast<const half*>(x), *bh = static_cast<const half*>(bias);
  half* yh = static_cast<half*>(y);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool vector = n % 8 == 0 && sdp::aligned16(x) && sdp::aligned16(y) && (!bias || sdp::aligned16(bias));
  return vector ? sdp::launch<8>(xh, bh, yh, rows, n, s) : sdp::launch<1>(xh, bh, yh, rows, n, s);
}
