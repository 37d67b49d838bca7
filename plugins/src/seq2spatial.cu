// Seq2Spatial: the end of a spatial transformer. x [B, HW, C] + bias [C], transposed to [B, C, HW],
// plus the residual: [B, C, HW] (NCHW, added after the transpose, read on the output side) or
// [B, HW, C] (NHWC, the sequence layout, added before the transpose, read beside x). One read of each
// input and one write, through a shared-memory tile. V = 8 moves 16-byte vectors on both sides (C and
// HW divisible by 8); V = 1 handles any shape.
#include "common.cuh"

namespace sdp {
namespace {

// Tiles of 64 channels by 64 pixels, or by 32 pixels where 64 would leave fewer than 4 blocks per
// multiprocessor (measured on an H200: the small tile wins on small grids, loses on large ones).
constexpr int kTileC = 64, kThreads = 256;

template <int V, int kTileP, int kResidualLayout>
__global__ void __launch_bounds__(kThreads) seq2spatial_kernel(const half* x, const half* bias, const half* residual,
                                                          half* y, int hw, int channels) {
  __shared__ float tile[kTileP][kTileC + 1];  // [pixel][channel]; +1 spreads columns over banks
  constexpr int kVecsP = kTileP / V, kVecsC = kTileC / V;  // vectors along pixels, along channels
  constexpr int kPerThread = kTileC * kVecsP / kThreads;
  constexpr bool kSpatialResidual = kResidualLayout == SDP_LAYOUT_NCHW;
  const half* res = residual + int64_t(blockIdx.z) * channels * hw;  // [C, HW] or [HW, C]: same size
  // An NCHW residual does not depend on the tile: fetch it first so both reads are in flight together.
  float r[kPerThread][V];
  if constexpr (kSpatialResidual) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int i = threadIdx.x + k * kThreads, c = i / kVecsP, p = (i % kVecsP) * V;
      if (blockIdx.y * kTileC + c < channels && blockIdx.x * kTileP + p < hw) {
        const int64_t at = int64_t(blockIdx.y * kTileC + c) * hw + blockIdx.x * kTileP + p;
        if constexpr (V == 8) load8(res + at, r[k]); else r[k][0] = __half2float(res[at]);
      }
    }
  }
  const int p0 = blockIdx.x * kTileP, c0 = blockIdx.y * kTileC;
  const int64_t item = blockIdx.z;
  const half* src = x + item * hw * channels;
  for (int i = threadIdx.x; i < kTileP * kVecsC; i += kThreads) {  // rows of pixels, channels contiguous
    const int p = i / kVecsC, c = (i % kVecsC) * V;
    float v[8] = {};
    if (p0 + p < hw && c0 + c < channels) {
      const int64_t offset = int64_t(p0 + p) * channels + c0 + c;  // in x and in a sequence-layout residual
      if constexpr (V == 8) {
        float b[8];
        load8(src + offset, v);
        load8(bias + c0 + c, b);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] += b[e];
        if constexpr (!kSpatialResidual) {
          load8(res + offset, b);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] += b[e];
        }
      } else {
        v[0] = __half2float(src[offset]) + __half2float(bias[c0 + c]);
        if constexpr (!kSpatialResidual) v[0] += __half2float(res[offset]);
      }
    }
#pragma unroll
    for (int e = 0; e < V; ++e) tile[p][c + e] = v[e];
  }
  __syncthreads();
  half* dst = y + item * int64_t(channels) * hw;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {  // rows of channels, pixels contiguous
    const int i = threadIdx.x + k * kThreads, c = i / kVecsP, p = (i % kVecsP) * V;
    if (c0 + c >= channels || p0 + p >= hw) continue;
    const int64_t at = int64_t(c0 + c) * hw + p0 + p;
    if constexpr (V == 8) {
#pragma unroll
      for (int e = 0; e < 8; ++e) r[k][e] = kSpatialResidual ? r[k][e] + tile[p + e][c] : tile[p + e][c];
      store8(dst + at, r[k]);
    } else {
      dst[at] = __float2half(kSpatialResidual ? tile[p][c] + r[k][0] : tile[p][c]);
    }
  }
}

template <int V, int kTileP, int kResidualLayout>
int launch_tile(const half* x, const half* bias, const half* residual, half* y, int batch, int hw, int channels,
                cudaStream_t stream) {
  dim3 grid(blocks_for(hw, kTileP), blocks_for(channels, kTileC), batch);
  seq2spatial_kernel<V, kTileP, kResidualLayout><<<grid, kThreads, 0, stream>>>(x, bias, residual, y, hw, channels);
  return check_launch("seq2spatial");
}

template <int V, int kResidualLayout>
int launch_layout(const half* x, const half* bias, const half* residual, half* y, int batch, int hw, int channels,
                  cudaStream_t stream) {
  const int64_t big_tiles = int64_t(blocks_for(hw, 64)) * blocks_for(channels, kTileC) * batch;
  return big_tiles < 4 * multiprocessors()
             ? launch_tile<V, 32, kResidualLayout>(x, bias, residual, y, batch, hw, channels, stream)
             : launch_tile<V, 64, kResidualLayout>(x, bias, residual, y, batch, hw, channels, stream);
}

template <int V>
int launch(const half* x, const half* bias, const half* residual, half* y, int batch, int hw, int channels,
           int residual_layout, cudaStream_t stream) {
  return residual_layout == SDP_LAYOUT_NCHW
             ? launch_layout<V, SDP_LAYOUT_NCHW>(x, bias, residual, y, batch, hw, channels, stream)
             : launch_layout<V, SDP_LAYOUT_NHWC>(x, bias, residual, y, batch, hw, channels, stream);
}

}  // namespace
}  // namespace sdp

extern "C" int sdp_seq2spatial(const void* x, const void* bias, const void* residual, void* y, int batch, int hw,
                               int channels, int residual_layout, sdp_stream_t stream) {
  SDP_REQUIRE(batch >= 1 && hw >= 1 && channels >= 1, "batch, hw and channels must be >= 1");
  SDP_REQUIRE(batch <= 65535, "batch must be <= 65535");
  SDP_REQUIRE(x && bias && residual && y, "pointers must be non-null");
  SDP_REQUIRE(residual_layout == SDP_LAYOUT_NCHW || residual_layout == SDP_LAYOUT_NHWC,
              "residual_layout must be NCHW (0) or NHWC (1), got " + std::to_string(residual_layout));
  const half *xh = static_cast<const half*>(x), *bh = static_cast<const half*>(bias);
  const half* rh = static_cast<const half*>(residual);
  half* yh = static_cast<half*>(y);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool vector = channels % 8 == 0 && hw % 8 == 0 && sdp::aligned16(x) && sdp::aligned16(bias) &&
                      sdp::aligned16(residual) && sdp::aligned16(y);
  return vector ? sdp::launch<8>(xh, bh, rh, yh, batch, hw, channels, residual_layout, s)
                : sdp::launch<1>(xh, bh, rh, yh, batch, hw, channels, residual_layout, s);
}
