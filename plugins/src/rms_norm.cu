// RMSNorm over the last dimension (SD3's and Flux's Q/K norms over each head), any size.
//
// Rows of N % 8 == 0 elements up to kMaxRegisterRow are held in registers (with_row_tiling: a head of 64
// takes 8 lanes, so one warp normalizes 4 heads): one read, one write. Other rows take one block each and
// read the row twice (sum of squares, then normalize), the second time mostly from cache.
#include "common.cuh"

namespace sdp {
namespace {

constexpr int kWarpsPerBlock = 4;

template <int VPL, int LANES>  // 8-element vectors per lane, lanes per row
__global__ void __launch_bounds__(32 * kWarpsPerBlock) rms_norm_rows(const half* x, const half* weight, half* y,
                                                                     int64_t rows, int n, float eps) {
  constexpr int kRowsPerWarp = 32 / LANES;
  const int64_t warp_row = (int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * kRowsPerWarp;
  if (warp_row >= rows) return;  // warp-uniform: the shuffles below need every lane of the warp
  const int lane = threadIdx.x % LANES;
  const int64_t row = warp_row + (threadIdx.x % 32) / LANES;
  const bool valid = row < rows;
  const half* src = x + row * n;
  float v[VPL][8];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = (i * LANES + lane) * 8;
    if (valid && c < n) {
      load8(src + c, v[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) sq += v[i][e] * v[i][e];
    }
  }
  const float rms = rsqrtf(group_sum<LANES>(sq) / n + eps);
  if (!valid) return;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = (i * LANES + lane) * 8;
    if (c < n) {
      float w[8];
      load8(weight + c, w);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] *= rms * w[e];
      store8(y + row * n + c, v[i]);
    }
  }
}

template <int V>  // V = 8: 16-byte vectors (n % 8 == 0, aligned); V = 1: any n
__global__ void __launch_bounds__(256) rms_norm_block(const half* x, const half* weight, half* y, int n, float eps) {
  __shared__ float scratch[32];
  const half* src = x + int64_t(blockIdx.x) * n;
  half* dst = y + int64_t(blockIdx.x) * n;
  float sq = 0.f;
  for (int c = threadIdx.x * V; c < n; c += blockDim.x * V) {
    float v[8];
    if constexpr (V == 8) load8(src + c, v); else v[0] = __half2float(src[c]);
#pragma unroll
    for (int e = 0; e < V; ++e) sq += v[e] * v[e];
  }
  const float rms = rsqrtf(block_sum(sq, scratch) / n + eps);
  for (int c = threadIdx.x * V; c < n; c += blockDim.x * V) {
    float v[8], w[8];
    if constexpr (V == 8) {
      load8(src + c, v);
      load8(weight + c, w);
    } else {
      v[0] = __half2float(src[c]);
      w[0] = __half2float(weight[c]);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] *= rms * w[e];
    if constexpr (V == 8) store8(dst + c, v); else dst[c] = __float2half(v[0]);
  }
}

template <int V>
int launch_block(const half* x, const half* w, half* y, int64_t rows, int n, float eps, cudaStream_t s) {
  rms_norm_block<V><<<unsigned(rows), row_block_threads(n, V), 0, s>>>(x, w, y, n, eps);
  return check_launch("rms_norm_block");
}

}  // namespace
}  // namespace sdp

extern "C" int sdp_rms_norm(const void* x, const void* weight, void* y, int64_t rows, int n, float eps,
                            sdp_stream_t stream) {
  SDP_REQUIRE(rows >= 1 && n >= 1, "rows and n must be >= 1");
  SDP_REQUIRE(rows <= 2147483647LL, "rows must fit the grid");
  SDP_REQUIRE(x && weight && y, "pointers must be non-null");
  SDP_REQUIRE(eps >= 0.f, "eps must be >= 0");
  const half *xh = static_cast<const half*>(x), *w = static_cast<const half*>(weight);
  half* yh = static_cast<half*>(y);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool vector = n % 8 == 0 && sdp::aligned16(x) && sdp::aligned16(y) && sdp::aligned16(weight);
  if (vector && n <= sdp::kMaxRegisterRow) {
    return sdp::with_row_tiling(n, [&](auto vpl, auto lanes) {
      constexpr int kRowsPerBlock = sdp::kWarpsPerBlock * 32 / decltype(lanes)::value;
      sdp::rms_norm_rows<decltype(vpl)::value, decltype(lanes)::value>
          <<<sdp::blocks_for(rows, kRowsPerBlock), 32 * sdp::kWarpsPerBlock, 0, s>>>(xh, w, yh, rows, n, eps);
      return sdp::check_launch("rms_norm_rows");
    });
  }
  return vector ? sdp::launch_block<8>(xh, w, yh, rows, n, eps, s) : sdp::launch_block<1>(xh, w, yh, rows, n, eps, s);
}
