// The modulated LayerNorm of AdaLN blocks (SD3's and Flux's AdaLayerNormZero / Continuous):
// y = (x - mean) / sqrt(var + eps) * (1 + scale[b]) + shift[b] over the C channels of each token of x [B, S, C].
//
// Rows of C % 8 == 0 channels up to kMaxRegisterRow are held in registers (with_row_tiling): exact two-pass
// mean and variance with one read and one write. Other rows take one block each and read the row three times
// (mean, variance, normalize), mostly from cache.
#include "common.cuh"

namespace sdp {
namespace {

constexpr int kWarpsPerBlock = 4;

template <int VPL, int LANES>  // 8-element vectors per lane, lanes per row
__global__ void __launch_bounds__(32 * kWarpsPerBlock) ada_layer_norm_rows(const half* x, const half* scale,
                                                                           const half* shift, half* y, int64_t rows,
                                                                           int64_t seq, int n, float eps) {
  constexpr int kRowsPerWarp = 32 / LANES;
  const int64_t warp_row = (int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * kRowsPerWarp;
  if (warp_row >= rows) return;  // warp-uniform: the shuffles below need every lane of the warp
  const int lane = threadIdx.x % LANES;
  const int64_t row = warp_row + (threadIdx.x % 32) / LANES;
  const bool valid = row < rows;
  const half* src = x + row * n;
  float v[VPL][8];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = (i * LANES + lane) * 8;
    if (valid && c < n) {
      load8(src + c, v[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += v[i][e];
    }
  }
  const float mean = group_sum<LANES>(sum) / n;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i)
    if (valid && (i * LANES + lane) * 8 < n)
#pragma unroll
      for (int e = 0; e < 8; ++e) sq += (v[i][e] - mean) * (v[i][e] - mean);
  const float rstd = rsqrtf(group_sum<LANES>(sq) / n + eps);
  if (!valid) return;
  const int64_t modulation = row / seq * n;  // the batch's [C] of scale and shift
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = (i * LANES + lane) * 8;
    if (c < n) {
      float a[8], b[8];
      load8(scale + modulation + c, a);
      load8(shift + modulation + c, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] = (v[i][e] - mean) * rstd * (1.f + a[e]) + b[e];
      store8(y + row * n + c, v[i]);
    }
  }
}

template <int V>  // V = 8: 16-byte vectors (n % 8 == 0, aligned); V = 1: any n
__global__ void __launch_bounds__(256) ada_layer_norm_block(const half* x, const half* scale, const half* shift,
                                                            half* y, int64_t seq, int n, float eps) {
  __shared__ float scratch[32];
  const half* src = x + int64_t(blockIdx.x) * n;
  half* dst = y + int64_t(blockIdx.x) * n;
  const int64_t modulation = blockIdx.x / seq * n;
  float sum = 0.f;
  for (int c = threadIdx.x * V; c < n; c += blockDim.x * V) {
    float v[8];
    if constexpr (V == 8) load8(src + c, v); else v[0] = __half2float(src[c]);
#pragma unroll
    for (int e = 0; e < V; ++e) sum += v[e];
  }
  const float mean = block_sum(sum, scratch) / n;
  float sq = 0.f;
  for (int c = threadIdx.x * V; c < n; c += blockDim.x * V) {
    float v[8];
    if constexpr (V == 8) load8(src + c, v); else v[0] = __half2float(src[c]);
#pragma unroll
    for (int e = 0; e < V; ++e) sq += (v[e] - mean) * (v[e] - mean);
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / n + eps);
  for (int c = threadIdx.x * V; c < n; c += blockDim.x * V) {
    float v[8], a[8], b[8];
    if constexpr (V == 8) {
      load8(src + c, v);
      load8(scale + modulation + c, a);
      load8(shift + modulation + c, b);
    } else {
      v[0] = __half2float(src[c]);
      a[0] = __half2float(scale[modulation + c]);
      b[0] = __half2float(shift[modulation + c]);
    }
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = (v[e] - mean) * rstd * (1.f + a[e]) + b[e];
    if constexpr (V == 8) store8(dst + c, v); else dst[c] = __float2half(v[0]);
  }
}

template <int V>
int launch_block(const half* x, const half* scale, const half* shift, half* y, int64_t rows, int64_t seq, int n,
                 float eps, cudaStream_t s) {
  ada_layer_norm_block<V><<<unsigned(rows), row_block_threads(n, V), 0, s>>>(x, scale, shift, y, seq, n, eps);
  return check_launch("ada_layer_norm_block");
}

}  // namespace
}  // namespace sdp

extern "C" int sdp_ada_layer_norm(const void* x, const void* scale, const void* shift, void* y, int batch, int64_t seq,
                                  int channels, float eps, sdp_stream_t stream) {
  SDP_REQUIRE(batch >= 1 && seq >= 1 && channels >= 1, "batch, seq and channels must be >= 1");
  const int64_t rows = int64_t(batch) * seq;
  SDP_REQUIRE(rows <= 2147483647LL, "batch * seq must fit the grid");
  SDP_REQUIRE(x && scale && shift && y, "pointers must be non-null");
  SDP_REQUIRE(eps >= 0.f, "eps must be >= 0");
  const half *xh = static_cast<const half*>(x), *a = static_cast<const half*>(scale), *b = static_cast<const half*>(shift);
  half* yh = static_cast<half*>(y);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int n = channels;
  const bool vector = n % 8 == 0 && sdp::aligned16(x) && sdp::aligned16(y) && sdp::aligned16(scale) &&
                      sdp::aligned16(shift);
  if (vector && n <= sdp::kMaxRegisterRow) {
    return sdp::with_row_tiling(n, [&](auto vpl, auto lanes) {
      constexpr int kRowsPerBlock = sdp::kWarpsPerBlock * 32 / decltype(lanes)::value;
      sdp::ada_layer_norm_rows<decltype(vpl)::value, decltype(lanes)::value>
          <<<sdp::blocks_for(rows, kRowsPerBlock), 32 * sdp::kWarpsPerBlock, 0, s>>>(xh, a, b, yh, rows, seq, n, eps);
      return sdp::check_launch("ada_layer_norm_rows");
    });
  }
  return vector ? sdp::launch_block<8>(xh, a, b, yh, rows, seq, n, eps, s)
                : sdp::launch_block<1>(xh, a, b, yh, rows, seq, n, eps, s);
}
