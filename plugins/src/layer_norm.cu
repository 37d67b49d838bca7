// LayerNorm over the last dimension, any size.
//
// Rows of up to 2048 elements (N % 8 == 0) are held in registers by one warp: exact two-pass
// mean/variance with one read and one write. Other rows take one block each and read the row three
// times (mean, variance, normalize), mostly from cache.
#include "common.cuh"

namespace sdp {
namespace {

constexpr int kWarpsPerBlock = 4;

template <int VPL>  // 8-element vectors per lane
__global__ void __launch_bounds__(32 * kWarpsPerBlock) layer_norm_warp(const half* x, const half* gamma,
                                                                       const half* beta, half* y, int64_t rows,
                                                                       int n, float eps) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const half* src = x + row * n;
  float v[VPL][8];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c < n) {
      load8(src + c, v[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += v[i][e];
    }
  }
  const float mean = warp_sum(sum) / n;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i)
    if ((i * 32 + lane) * 8 < n)
#pragma unroll
      for (int e = 0; e < 8; ++e) sq += (v[i][e] - mean) * (v[i][e] - mean);
  const float rstd = rsqrtf(warp_sum(sq) / n + eps);
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = (i * 32 + lane) * 8;
    if (c < n) {
      float g[8], b[8];  // fetching these with x measured slower on 5 of 6 SD shapes (H200)
      load8(gamma + c, g);
      load8(beta + c, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] = (v[i][e] - mean) * rstd * g[e] + b[e];
      store8(y + row * n + c, v[i]);
    }
  }
}

__global__ void __launch_bounds__(256) layer_norm_block(const half* x, const half* gamma, const half* beta, half* y,
                                                        int n, float eps) {
  __shared__ float scratch[32];
  const half* src = x + int64_t(blockIdx.x) * n;
  half* dst = y + int64_t(blockIdx.x) * n;
  float sum = 0.f;
  for (int c = threadIdx.x; c < n; c += blockDim.x) sum += __half2float(src[c]);
  const float mean = block_sum(sum, scratch) / n;
  float sq = 0.f;
  for (int c = threadIdx.x; c < n; c += blockDim.x) {
    const float d = __half2float(src[c]) - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / n + eps);
  for (int c = threadIdx.x; c < n; c += blockDim.x)
    dst[c] = __float2half((__half2float(src[c]) - mean) * rstd * __half2float(gamma[c]) + __half2float(beta[c]));
}

template <int VPL>
int launch_warp(const half* x, const half* g, const half* b, half* y, int64_t rows, int n, float eps, cudaStream_t s) {
  layer_norm_warp<VPL><<<blocks_for(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(x, g, b, y, rows, n, eps);
  return check_launch("layer_norm_warp");
}

}  // namespace
}  // namespace sdp

extern "C" int sdp_layer_norm(const void* x, const void* gamma, const void* beta, void* y, int64_t rows, int n,
                              float eps, sdp_stream_t stream) {
  SDP_REQUIRE(rows >= 1 && n >= 1, "rows and n must be >= 1");
  SDP_REQUIRE(rows <= 2147483647LL, "rows must fit the grid");
  SDP_REQUIRE(x && gamma && beta && y, "pointers must be non-null");
  SDP_REQUIRE(eps >= 0.f, "eps must be >= 0");
  const half *xh = static_cast<const half*>(x), *g = static_cast<const half*>(gamma), *b = static_cast<const half*>(beta);
  half* yh = static_cast<half*>(y);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool vector = n % 8 == 0 && sdp::aligned16(x) && sdp::aligned16(y) && sdp::aligned16(gamma) && sdp::aligned16(beta);
  if (vector && n <= 256) return sdp::launch_warp<1>(xh, g, b, yh, rows, n, eps, s);
  if (vector && n <= 512) return sdp::launch_warp<2>(xh, g, b, yh, rows, n, eps, s);
  if (vector && n <= 1024) return sdp::launch_warp<4>(xh, g, b, yh, rows, n, eps, s);
  if (vector && n <= 2048) return sdp::launch_warp<8>(xh, g, b, yh, rows, n, eps, s);
  sdp::layer_norm_block<<<unsigned(rows), 256, 0, s>>>(xh, g, b, yh, n, eps);
  return sdp::check_launch("layer_norm_block");
}
