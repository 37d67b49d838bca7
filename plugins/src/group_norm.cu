// GroupNorm (+ optional SiLU) over NCHW or NHWC fp16 tensors; any group count dividing C.
//
// Groups of up to 48K elements in NCHW, 40K in NHWC (the UNet's at SD sizes, but in NHWC four of SD 1.5's 61 at
// 512x512: 64x64 with 640 and 960 channels, 32x32 with 1920) take one block each and stay in registers: one read,
// exact two-pass statistics, one write. Larger groups (the VAE's) take three launches.
// `stats` splits the work into chunks (enough blocks to fill the GPU even for the
// VAE's 32 huge groups) and writes each chunk's (mean, M2, count) per group to the workspace.
// `finalize` merges a group's chunks with Chan's parallel-variance formula (stable) into (mean, rstd). Every kernel
// here is deterministic: no atomics, every sum in a fixed order. `apply` normalizes; it walks the chunks
// in reverse order, so the data `stats` read last is re-read while still in L2.
#include <algorithm>

#include "common.cuh"

namespace sdp {
namespace {

constexpr int kThreads = 256;
constexpr int kTargetBlocks = 1024;  // fixed, so the workspace size depends on the shapes alone
constexpr int kMinChunkElements = 2048;
constexpr int kMaxGroupsNHWC = 1024;  // per-group sums of one NHWC block live in shared memory
constexpr int kFusedThreads = 1024, kFusedMaxVectors = 6;  // per thread; more spills at 64 registers
constexpr int kFusedMaxPairs = 22;  // NHWC's half2 pairs (pixels) per thread; 23 spills

struct Moments {
  float mean, m2, count;
};

__device__ __forceinline__ Moments merge(Moments a, Moments b) {
  const float n = a.count + b.count;
  if (n == 0.f) return a;
  const float delta = b.mean - a.mean, wb = b.count / n;
  return {a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.count * wb, n};
}

__device__ __forceinline__ Moments from_sums(float sum, float sum_sq, float count) {
  if (count == 0.f) return {0.f, 0.f, 0.f};
  const float mean = sum / count;
  return {mean, fmaxf(sum_sq - sum * mean, 0.f), count};
}

__device__ Moments warp_merge(Moments m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Moments other{__shfl_xor_sync(0xffffffffu, m.mean, o), __shfl_xor_sync(0xffffffffu, m.m2, o),
                  __shfl_xor_sync(0xffffffffu, m.count, o)};
    m = merge(m, other);
  }
  return m;
}

// Merge across the block; the result is valid in every thread.
__device__ Moments block_merge(Moments m) {
  __shared__ Moments scratch[32];
  m = warp_merge(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = m;
  __syncthreads();
  m = lane < int(blockDim.x >> 5) ? scratch[lane] : Moments{0.f, 0.f, 0.f};
  return warp_merge(m);
}

__device__ __forceinline__ float2 finish(Moments m, float eps) {
  return make_float2(m.mean, rsqrtf(m.m2 / m.count + eps));
}

struct Problem {
  const half* x;
  const half* gamma;
  const half* beta;
  half* y;
  Moments* partial;  // [batch * groups][chunks]
  float2* stats;     // [batch * groups]: mean, rstd
  int batch, channels, hw, groups, cpg;
  int chunks;         // per (batch, group) for NCHW, per batch item for NHWC
  int64_t chunk_len;  // elements (NCHW) or pixels (NHWC) per chunk
  float eps;
};

void plan_chunks(Problem& p, int layout) {
  if (layout == SDP_LAYOUT_NCHW) {
    const int64_t group_elems = int64_t(p.cpg) * p.hw;
    const int64_t most = (group_elems + kMinChunkElements - 1) / kMinChunkElements;
    const int64_t wanted = (kTargetBlocks + int64_t(p.batch) * p.groups - 1) / (int64_t(p.batch) * p.groups);
    int64_t chunks = std::max<int64_t>(1, std::min(most, wanted));
    p.chunk_len = ((group_elems + chunks - 1) / chunks + 7) / 8 * 8;  // chunk starts stay 16-byte aligned
    p.chunks = int((group_elems + p.chunk_len - 1) / p.chunk_len);
  } else {
    const int64_t min_pixels = std::max<int64_t>(1, (8 * kMinChunkElements + p.channels - 1) / p.channels);
    const int64_t most = (p.hw + min_pixels - 1) / min_pixels;
    const int64_t wanted = (kTargetBlocks + p.batch - 1) / p.batch;
    int64_t chunks = std::max<int64_t>(1, std::min(most, wanted));
    p.chunk_len = (p.hw + chunks - 1) / chunks;
    p.chunks = int((p.hw + p.chunk_len - 1) / p.chunk_len);
  }
}

template <bool SILU>
__device__ __forceinline__ float affine(float x, float2 stats, const half* gamma, const half* beta, int c) {
  float y = (x - stats.x) * stats.y * __half2float(gamma[c]) + __half2float(beta[c]);
  return SILU ? silu(y) : y;
}

// One warp per (batch, group): merge its chunk moments into (mean, rstd).
__global__ void __launch_bounds__(kThreads) finalize(Problem p) {
  const int64_t group = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (group >= int64_t(p.batch) * p.groups) return;
  Moments m{0.f, 0.f, 0.f};
  for (int c = threadIdx.x & 31; c < p.chunks; c += 32) m = merge(m, p.partial[group * p.chunks + c]);
  m = warp_merge(m);
  if ((threadIdx.x & 31) == 0) p.stats[group] = finish(m, p.eps);
}

// ---- NCHW: each (batch, group) is one contiguous run of cpg * HW elements -------------------------
// V = 8 needs cpg * HW and HW divisible by 8 (a vector never straddles a channel); V = 1 is general.

template <int V>
__global__ void __launch_bounds__(kThreads) nchw_stats(Problem p) {
  const int64_t group = blockIdx.y, group_elems = int64_t(p.cpg) * p.hw;
  const int64_t begin = blockIdx.x * p.chunk_len, end = min(begin + p.chunk_len, group_elems);
  const half* base = p.x + group * group_elems;
  float sum = 0.f, sum_sq = 0.f, count = 0.f;
  for (int64_t i = begin + threadIdx.x * V; i < end; i += kThreads * V) {
    float v[8];
    if constexpr (V == 8) load8(base + i, v); else v[0] = __half2float(base[i]);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      sum += v[e];
      sum_sq += v[e] * v[e];
    }
    count += V;
  }
  const Moments m = block_merge(from_sums(sum, sum_sq, count));
  if (threadIdx.x == 0) p.partial[group * p.chunks + blockIdx.x] = m;
}

template <int V, bool SILU>
__global__ void __launch_bounds__(kThreads) nchw_apply(Problem p) {
  const int64_t linear = int64_t(gridDim.x) * gridDim.y - 1 - (int64_t(blockIdx.y) * gridDim.x + blockIdx.x);
  const int64_t group = linear / gridDim.x, chunk = linear % gridDim.x;
  const float2 stats = p.stats[group];

  const int64_t group_elems = int64_t(p.cpg) * p.hw;
  const int64_t begin = chunk * p.chunk_len, end = min(begin + p.chunk_len, group_elems);
  const int channel0 = int(group % p.groups) * p.cpg;
  const half* src = p.x + group * group_elems;
  half* dst = p.y + group * group_elems;
  for (int64_t i = begin + threadIdx.x * V; i < end; i += kThreads * V) {
    const int c = channel0 + int(i / p.hw);
    if constexpr (V == 8) {
      float v[8];
      load8(src + i, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = affine<SILU>(v[e], stats, p.gamma, p.beta, c);
      store8(dst + i, v);
    } else {
      dst[i] = __float2half(affine<SILU>(__half2float(src[i]), stats, p.gamma, p.beta, c));
    }
  }
}

// One block per (batch, group), the group held in registers as raw fp16 vectors.
template <int VPT, bool SILU>
__global__ void __launch_bounds__(kFusedThreads) nchw_fused(Problem p) {
  __shared__ float scratch[32];
  const int64_t group = blockIdx.x, n = int64_t(p.cpg) * p.hw;
  const half* src = p.x + group * n;
  half* dst = p.y + group * n;
  uint4 raw[VPT];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t at = (int64_t(i) * blockDim.x + threadIdx.x) * 8;
    if (at < n) {
      raw[i] = *reinterpret_cast<const uint4*>(src + at);
      float v[8];
      unpack8(raw[i], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += v[e];
    }
  }
  const float mean = block_sum(sum, scratch) / float(n);
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if ((int64_t(i) * blockDim.x + threadIdx.x) * 8 < n) {
      float v[8];
      unpack8(raw[i], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sq += (v[e] - mean) * (v[e] - mean);
    }
  }
  const float2 stats = make_float2(mean, rsqrtf(block_sum(sq, scratch) / float(n) + p.eps));
  const int channel0 = int(group % p.groups) * p.cpg;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t at = (int64_t(i) * blockDim.x + threadIdx.x) * 8;
    if (at < n) {
      float v[8];
      unpack8(raw[i], v);
      const int c = channel0 + int(at / p.hw);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = affine<SILU>(v[e], stats, p.gamma, p.beta, c);
      store8(dst + at, v);
    }
  }
}

template <int VPT>
void launch_fused(const Problem& p, bool silu, int threads, cudaStream_t stream) {
  if constexpr (VPT <= kFusedMaxVectors) {
    const int64_t vecs = int64_t(p.cpg) * p.hw / 8;
    if (vecs > int64_t(VPT) * kFusedThreads) return launch_fused<VPT + 1>(p, silu, threads, stream);
    if (silu) nchw_fused<VPT, true><<<p.batch * p.groups, threads, 0, stream>>>(p);
    else nchw_fused<VPT, false><<<p.batch * p.groups, threads, 0, stream>>>(p);
  }
}

// ---- NHWC: x [B, HW, C]; a group is cpg adjacent channels of every pixel -------------------------
// A block takes one chunk of pixels of one batch item. V = 8 needs C divisible by 8.

// Deterministic like the NCHW kernels: every sum is taken in a fixed order, with no atomics, so one input gives one
// output bit for bit (a LoRA refit back to the base weights is checked that way). The block walks the channels in
// passes of `lanes` vectors; in a pass each thread sums one vector of channels over its rows of pixels, then the rows
// are added up per channel, then the channels per group, each by one thread.
template <int V>
__global__ void __launch_bounds__(kThreads) nhwc_stats(Problem p) {
  __shared__ float group_sum[kMaxGroupsNHWC], group_sq[kMaxGroupsNHWC];
  __shared__ float part_sum[kThreads * V], part_sq[kThreads * V];  // [row][channel of the pass]
  for (int g = threadIdx.x; g < p.groups; g += kThreads) group_sum[g] = group_sq[g] = 0.f;
  const int vecs = p.channels / V;  // vectors per pixel
  const int lanes = min(vecs, kThreads), rows = kThreads / lanes;  // rows pixels at a time
  const int row = threadIdx.x / lanes, lane = threadIdx.x % lanes, width = lanes * V;  // width: channels per pass
  const int64_t px_begin = blockIdx.x * p.chunk_len, px_end = min(px_begin + p.chunk_len, int64_t(p.hw));
  const half* base = p.x + int64_t(blockIdx.y) * p.hw * p.channels;
  for (int s0 = 0; s0 < vecs; s0 += lanes) {
    const int s = s0 + lane;
    if (row < rows && s < vecs) {
      float sum[V] = {}, sum_sq[V] = {};
      for (int64_t px = px_begin + row; px < px_end; px += rows) {
        float v[8];
        if constexpr (V == 8) load8(base + px * p.channels + s * V, v); else v[0] = __half2float(base[px * p.channels + s]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          sum[e] += v[e];
          sum_sq[e] += v[e] * v[e];
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        part_sum[row * width + lane * V + e] = sum[e];
        part_sq[row * width + lane * V + e] = sum_sq[e];
      }
    }
    __syncthreads();
    const int c_begin = s0 * V, c_end = min(c_begin + width, p.channels);
    for (int c = threadIdx.x; c < c_end - c_begin; c += kThreads) {  // row 0 of each column takes the column's sum
      float a = 0.f, b = 0.f;
      for (int r = 0; r < rows; ++r) {
        a += part_sum[r * width + c];
        b += part_sq[r * width + c];
      }
      part_sum[c] = a, part_sq[c] = b;
    }
    __syncthreads();
    for (int g = c_begin / p.cpg + threadIdx.x; g <= (c_end - 1) / p.cpg; g += kThreads) {  // groups of this pass
      const int from = max(g * p.cpg, c_begin) - c_begin, to = min((g + 1) * p.cpg, c_end) - c_begin;
      float a = 0.f, b = 0.f;
      for (int c = from; c < to; ++c) {
        a += part_sum[c];
        b += part_sq[c];
      }
      group_sum[g] += a, group_sq[g] += b;  // a group wider than a pass gathers over passes, in pass order
    }
    __syncthreads();  // the next pass writes part_* again
  }
  const float count = float(px_end - px_begin) * p.cpg;
  for (int g = threadIdx.x; g < p.groups; g += kThreads)
    p.partial[(int64_t(blockIdx.y) * p.groups + g) * p.chunks + blockIdx.x] = from_sums(group_sum[g], group_sq[g], count);
}

template <int V, bool SILU>
__global__ void __launch_bounds__(kThreads) nhwc_apply(Problem p) {
  __shared__ float2 stats[kMaxGroupsNHWC];
  const int64_t linear = int64_t(gridDim.x) * gridDim.y - 1 - (int64_t(blockIdx.y) * gridDim.x + blockIdx.x);
  const int64_t item = linear / gridDim.x, chunk = linear % gridDim.x;
  for (int g = threadIdx.x; g < p.groups; g += kThreads) stats[g] = p.stats[item * p.groups + g];
  __syncthreads();
  const int64_t begin = chunk * p.chunk_len * p.channels;
  const int64_t end = min(chunk * p.chunk_len + p.chunk_len, int64_t(p.hw)) * p.channels;
  const half* src = p.x + item * p.hw * p.channels;
  half* dst = p.y + item * p.hw * p.channels;
  for (int64_t i = begin + threadIdx.x * V; i < end; i += kThreads * V) {
    const int c0 = int(i % p.channels);
    if constexpr (V == 8) {
      float v[8];
      load8(src + i, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = affine<SILU>(v[e], stats[(c0 + e) / p.cpg], p.gamma, p.beta, c0 + e);
      store8(dst + i, v);
    } else {
      dst[i] = __float2half(affine<SILU>(__half2float(src[i]), stats[c0 / p.cpg], p.gamma, p.beta, c0));
    }
  }
}

// One block per (batch item, group), the group held in registers as half2 pairs. Thread t takes channels
// 2 (t % (cpg / 2)) and the next of the group, in pixels t / (cpg / 2) + i * rows, so consecutive threads read along
// a pixel's channels, then the next pixel's, with no division in the loops. Needs cpg even (a pair never straddles
// two groups) and x, y 4-byte aligned. Two-pass statistics over the registers, in a fixed order like NCHW's.
template <int PPT, bool SILU>
__global__ void __launch_bounds__(kFusedThreads) nhwc_fused(Problem p) {
  __shared__ float scratch[32];
  const int half_cpg = p.cpg / 2, rows = (p.hw + PPT - 1) / PPT;  // pixels the block takes at once
  const int row = threadIdx.x / half_cpg, c = p.cpg * int(blockIdx.x % p.groups) + 2 * int(threadIdx.x % half_cpg);
  const int64_t item_start = blockIdx.x / p.groups * int64_t(p.hw) * p.channels;
  const half* src = p.x + item_start;
  half* dst = p.y + item_start;
  const int first = row * p.channels + c, step = rows * p.channels;  // within the item: < 2^31 (checked)
  __half2 raw[PPT];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    if (row < rows && row + i * rows < p.hw) {
      raw[i] = *reinterpret_cast<const __half2*>(src + first + i * step);
      const float2 v = __half22float2(raw[i]);
      sum += v.x + v.y;
    }
  }
  const float n = float(p.hw) * p.cpg, mean = block_sum(sum, scratch) / n;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    if (row < rows && row + i * rows < p.hw) {
      const float2 v = __half22float2(raw[i]);
      sq += (v.x - mean) * (v.x - mean) + (v.y - mean) * (v.y - mean);
    }
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / n + p.eps);
  if (row >= rows) return;
  const float scale0 = rstd * __half2float(p.gamma[c]), scale1 = rstd * __half2float(p.gamma[c + 1]);
  const float shift0 = __half2float(p.beta[c]), shift1 = __half2float(p.beta[c + 1]);
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    if (row + i * rows < p.hw) {
      const float2 v = __half22float2(raw[i]);
      float y0 = (v.x - mean) * scale0 + shift0, y1 = (v.y - mean) * scale1 + shift1;
      if (SILU) y0 = silu(y0), y1 = silu(y1);
      *reinterpret_cast<__half2*>(dst + first + i * step) = __floats2half2_rn(y0, y1);
    }
  }
}

// nhwc_fused's pixels per thread: the fewest that fit one block, or 0 where the group cannot take that kernel.
int nhwc_fused_pixels_per_thread(const Problem& p) {
  const auto address = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y);
  if (p.cpg % 2 != 0 || address % 4 != 0 || int64_t(p.hw) * p.channels >= (int64_t(1) << 31)) return 0;
  for (int ppt = 1; ppt <= kFusedMaxPairs; ++ppt)
    if (int64_t((p.hw + ppt - 1) / ppt) * (p.cpg / 2) <= kFusedThreads) return ppt;
  return 0;
}

template <int PPT>
void launch_nhwc_fused(const Problem& p, int ppt, bool silu, cudaStream_t stream) {
  if constexpr (PPT <= kFusedMaxPairs) {
    if (PPT < ppt) return launch_nhwc_fused<PPT + 1>(p, ppt, silu, stream);
    const int threads = ((p.hw + PPT - 1) / PPT * (p.cpg / 2) + 31) / 32 * 32;
    if (silu) nhwc_fused<PPT, true><<<p.batch * p.groups, threads, 0, stream>>>(p);
    else nhwc_fused<PPT, false><<<p.batch * p.groups, threads, 0, stream>>>(p);
  }
}

template <int V>
int run(Problem& p, int layout, bool silu, cudaStream_t stream) {
  const int64_t group_elems = int64_t(p.cpg) * p.hw;
  if (V == 8 && layout == SDP_LAYOUT_NCHW && group_elems <= int64_t(kFusedThreads) * kFusedMaxVectors * 8) {
    const int64_t vecs = group_elems / 8;
    const int64_t per_thread = (vecs + kFusedThreads - 1) / kFusedThreads;
    const int threads = int(((vecs + per_thread - 1) / per_thread + 31) / 32 * 32);
    launch_fused<1>(p, silu, threads, stream);
  } else if (layout == SDP_LAYOUT_NCHW) {
    dim3 grid(p.chunks, p.batch * p.groups);
    nchw_stats<V><<<grid, kThreads, 0, stream>>>(p);
    finalize<<<blocks_for(int64_t(p.batch) * p.groups, kThreads / 32), kThreads, 0, stream>>>(p);
    if (silu) nchw_apply<V, true><<<grid, kThreads, 0, stream>>>(p);
    else nchw_apply<V, false><<<grid, kThreads, 0, stream>>>(p);
  } else if (const int ppt = nhwc_fused_pixels_per_thread(p)) {
    launch_nhwc_fused<1>(p, ppt, silu, stream);
  } else {
    dim3 grid(p.chunks, p.batch);
    nhwc_stats<V><<<grid, kThreads, 0, stream>>>(p);
    finalize<<<blocks_for(int64_t(p.batch) * p.groups, kThreads / 32), kThreads, 0, stream>>>(p);
    if (silu) nhwc_apply<V, true><<<grid, kThreads, 0, stream>>>(p);
    else nhwc_apply<V, false><<<grid, kThreads, 0, stream>>>(p);
  }
  return check_launch("group_norm kernels");
}

int check_shape(int batch, int channels, int hw, int groups, int layout) {
  SDP_REQUIRE(batch >= 1 && channels >= 1 && hw >= 1 && groups >= 1, "batch, channels, hw and groups must be >= 1");
  SDP_REQUIRE(channels % groups == 0,
              "groups (" + std::to_string(groups) + ") must divide channels (" + std::to_string(channels) + ")");
  SDP_REQUIRE(layout == SDP_LAYOUT_NCHW || layout == SDP_LAYOUT_NHWC, "layout must be NCHW (0) or NHWC (1)");
  SDP_REQUIRE(layout == SDP_LAYOUT_NCHW || groups <= kMaxGroupsNHWC,
              "NHWC supports at most " + std::to_string(kMaxGroupsNHWC) + " groups");
  SDP_REQUIRE(int64_t(batch) * groups <= 65535 || layout == SDP_LAYOUT_NHWC, "batch * groups must be <= 65535");
  return SDP_OK;
}

Problem make_problem(int batch, int channels, int hw, int groups, int layout) {
  Problem p{};
  p.batch = batch, p.channels = channels, p.hw = hw, p.groups = groups, p.cpg = channels / groups;
  plan_chunks(p, layout);
  return p;
}

// Chunk moments, then per-group (mean, rstd), 8-byte aligned after the 12-byte Moments.
size_t workspace_bytes(const Problem& p) {
  const size_t partial = size_t(p.batch) * p.groups * p.chunks * sizeof(Moments);
  return (partial + 7) / 8 * 8 + size_t(p.batch) * p.groups * sizeof(float2);
}

}  // namespace
}  // namespace sdp

extern "C" size_t sdp_group_norm_workspace_size(int batch, int channels, int hw, int groups, int layout) {
  if (sdp::check_shape(batch, channels, hw, groups, layout) != SDP_OK) return 0;
  return sdp::workspace_bytes(sdp::make_problem(batch, channels, hw, groups, layout));
}

extern "C" int sdp_group_norm(const void* x, const void* gamma, const void* beta, void* y, void* workspace,
                              size_t workspace_bytes, int batch, int channels, int hw, int groups, float eps,
                              int layout, int silu, sdp_stream_t stream) {
  if (int status = sdp::check_shape(batch, channels, hw, groups, layout)) return status;
  SDP_REQUIRE(x && gamma && beta && y && workspace, "pointers must be non-null");
  SDP_REQUIRE(eps >= 0.f, "eps must be >= 0");
  sdp::Problem p = sdp::make_problem(batch, channels, hw, groups, layout);
  const size_t needed = sdp::workspace_bytes(p);
  SDP_REQUIRE(workspace_bytes >= needed, "workspace too small: need " + std::to_string(needed) + " bytes");
  p.x = static_cast<const half*>(x), p.gamma = static_cast<const half*>(gamma);
  p.beta = static_cast<const half*>(beta), p.y = static_cast<half*>(y);
  p.partial = static_cast<sdp::Moments*>(workspace), p.eps = eps;
  const size_t partial_bytes = size_t(batch) * groups * p.chunks * sizeof(sdp::Moments);
  p.stats = reinterpret_cast<float2*>(static_cast<char*>(workspace) + (partial_bytes + 7) / 8 * 8);
  const bool vector = sdp::aligned16(x) && sdp::aligned16(y) &&
                      (layout == SDP_LAYOUT_NCHW ? hw % 8 == 0 : channels % 8 == 0);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return vector ? sdp::run<8>(p, layout, silu != 0, s) : sdp::run<1>(p, layout, silu != 0, s);
}
