// Fused multi-head attention (self: fMHA, cross: fMHCA), FlashAttention-2 style.
//
// One block owns BM = 16 * MT * WARPS query rows of one (batch, head); each warp owns MT tiles of 16
// rows (two tiles let every K/V fragment read from shared memory feed two MMAs). K and V
// stream through shared memory in tiles of BN keys; S = Q K^T and O += P V run on tensor cores
// (mma m16n8k16) with an online softmax, so no S x S matrix ever reaches memory. The next K tile is
// fetched while P V runs and the next V tile while the following Q K^T runs.
//
// Head sizes: the template's DK is the largest D it serves. D = 40, 64, 80 and 160 have their own
// instantiations that round the Q K^T reduction only up to a multiple of 16 (48 for D = 40) and the
// P V output to a multiple of 8 (exact), instead of padding to a power of two.
//
// sdp_fmha / sdp_fmhca pick the kernels at run time (run_attention): on compute capability 9.0 the
// warp-specialized wgmma/TMA kernels of attention_sm90*.cu, elsewhere these; SDPLUGINS_ATTENTION=mma
// or =wgmma forces one (see sdplugins.h).
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <cstring>

#include "attention_sm90.cuh"
#include "common.cuh"
#include "mma.cuh"

namespace sdp {
namespace {

struct AttentionParams {
  const half* q;
  const half* k;
  const half* v;
  half* o;
  int64_t q_batch, q_row, q_head;  // strides in elements
  int64_t kv_batch, kv_row, kv_head;
  int64_t o_batch, o_row, o_head;
  int seq_q, seq_kv, d;
  float scale_log2;  // softmax scale * log2(e): exponentials use exp2
};

template <int DK_, int WARPS_, int BN_, bool Q_IN_REGS_, int MT_ = 1>
struct AttentionTile {
  static constexpr int DK = DK_, WARPS = WARPS_, BN = BN_, MT = MT_;
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;
  static constexpr int BM = 16 * MT * WARPS, THREADS = 32 * WARPS;
  static constexpr int KSTEPS = (DK + 15) / 16;  // k-steps of Q K^T
  static constexpr int STRIDE = KSTEPS * 16 + 8;  // smem row in halves; the +8 makes ldmatrix conflict-free
  static constexpr int NT_O = DK / 8;             // 8-wide output column tiles
  static constexpr int NT_S = BN / 8;             // 8-wide score column tiles
  static constexpr int SMEM_BYTES = (BM + 2 * BN) * STRIDE * 2;
  static_assert(DK % 8 == 0 && BN % 16 == 0, "tile shape");
};

// Copy rows [row0, row0 + count) x d columns of a strided matrix into shared memory, spread over
// `threads` threads of which this is number `tid`; rows past `rows` become zeros (finite values
// matter: masked probabilities are exact zeros times these).
template <int STRIDE>
__device__ __forceinline__ void load_rows(half* dst, const half* src, int64_t row_stride, int row0, int count,
                                          int rows, int d, int tid, int threads) {
  const int vecs = d / 8;
  for (int i = tid; i < count * vecs; i += threads) {
    const int r = i / vecs, c = (i - r * vecs) * 8;
    half* s = dst + r * STRIDE + c;
    if (row0 + r < rows)
      cp_async16(s, src + (row0 + r) * row_stride + c);
    else
      *reinterpret_cast<uint4*>(s) = make_uint4(0, 0, 0, 0);
  }
}

// S[mt] += Q[mt] K^T for one 16-wide k-step, over 16-key pairs of score tiles below `keys`; each
// K fragment read from shared memory feeds all MT query tiles.
template <int MT, int NT_S, int STRIDE>
__device__ __forceinline__ void accumulate_qk(float (&s)[MT][NT_S][4], const unsigned (&a)[MT][4], const half* sK,
                                              int ks, int keys, int lane) {
#pragma unroll
  for (int np = 0; np < NT_S / 2; ++np) {
    if (np * 16 >= keys) break;
    unsigned b[4];
    ldmatrix_x4(b, sK + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * STRIDE + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
      mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
    }
  }
}

// The score accumulators of two adjacent 8-key tiles are exactly the A fragment of one 16-key step,
// so P never leaves registers.
template <int NT_S>
__device__ __forceinline__ void p_fragment(unsigned (&a)[4], const float (&s)[NT_S][4], int kk) {
  a[0] = pack_half2(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_half2(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// O[mt] += P[mt] V for one 16-key step (V rows start at v_rows for this lane), output columns < d.
template <int MT, int NT_O>
__device__ __forceinline__ void accumulate_pv(float (&acc)[MT][NT_O][4], const unsigned (&a)[MT][4], const half* v_rows,
                                              int d, int lane) {
#pragma unroll
  for (int dp = 0; dp < NT_O / 2; ++dp) {
    if (dp * 16 >= d) break;
    unsigned b[4];
    ldmatrix_x4_trans(b, v_rows + dp * 16 + (lane >> 4) * 8);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma_16816(acc[mt][2 * dp], a[mt], b[0], b[1]);
      mma_16816(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
    }
  }
  if constexpr (NT_O % 2 == 1) {  // D = 40: five 8-column tiles, the last one alone
    unsigned b[2];
    ldmatrix_x2_trans(b, v_rows + (NT_O - 1) * 8);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt][NT_O - 1], a[mt], b[0], b[1]);
  }
}

template <class T>
__global__ void __launch_bounds__(T::THREADS) attention_kernel(AttentionParams p) {
  extern __shared__ __align__(16) half smem[];
  half* sQ = smem;
  half* sK = sQ + T::BM * T::STRIDE;
  half* sV = sK + T::BN * T::STRIDE;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int m0 = blockIdx.x * T::BM, head = blockIdx.y, batch = blockIdx.z;
  const half* q = p.q + batch * p.q_batch + head * p.q_head;
  const half* k = p.k + batch * p.kv_batch + head * p.kv_head;
  const half* v = p.v + batch * p.kv_batch + head * p.kv_head;
  half* o = p.o + batch * p.o_batch + head * p.o_head;

  // Q and K columns past d are never loaded: zero them once so padded k-steps add nothing. (V's
  // padding only feeds output columns past d, which are never stored.)
  const int pad_vecs = (T::KSTEPS * 16 - p.d) / 8;
  for (int i = threadIdx.x; i < (T::BM + T::BN) * pad_vecs; i += T::THREADS)
    *reinterpret_cast<uint4*>(sQ + (i / pad_vecs) * T::STRIDE + p.d + (i % pad_vecs) * 8) = make_uint4(0, 0, 0, 0);

  load_rows<T::STRIDE>(sQ, q, p.q_row, m0, T::BM, p.seq_q, p.d, threadIdx.x, T::THREADS);
  load_rows<T::STRIDE>(sK, k, p.kv_row, 0, T::BN, p.seq_kv, p.d, threadIdx.x, T::THREADS);
  cp_async_commit();
  load_rows<T::STRIDE>(sV, v, p.kv_row, 0, T::BN, p.seq_kv, p.d, threadIdx.x, T::THREADS);
  cp_async_commit();

  const int ksteps = (p.d + 15) / 16;  // runtime bound: generic instantiations serve several d
  constexpr int MT = T::MT;
  const half* q_warp = sQ + (warp * MT * 16 + (lane & 15)) * T::STRIDE + (lane >> 4) * 8;
  unsigned q_frag[MT][T::Q_IN_REGS ? T::KSTEPS : 1][4];
  float acc[MT][T::NT_O][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < T::NT_O; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -FLT_MAX;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  const int tiles = (p.seq_kv + T::BN - 1) / T::BN;
  for (int j = 0; j < tiles; ++j) {
    cp_async_wait<1>();  // Q and K_j have landed; V_j may still be in flight
    __syncthreads();
    if (T::Q_IN_REGS && j == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < (T::Q_IN_REGS ? T::KSTEPS : 0); ++ks)
          ldmatrix_x4(q_frag[mt][ks], q_warp + mt * 16 * T::STRIDE + ks * 16);
    }

    // S = Q K^T for this warp's rows and BN keys.
    float s[MT][T::NT_S][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < T::NT_S; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < T::KSTEPS; ++ks) {
      if (ks >= ksteps) break;
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (T::Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][ks][i];
        } else {
          ldmatrix_x4(a[mt], q_warp + mt * 16 * T::STRIDE + ks * 16);
        }
      }
      accumulate_qk<MT, T::NT_S, T::STRIDE>(s, a, sK, ks, T::BN, lane);
    }
    __syncthreads();  // all warps are done with K_j
    if (j + 1 < tiles)
      load_rows<T::STRIDE>(sK, k, p.kv_row, (j + 1) * T::BN, T::BN, p.seq_kv, p.d, threadIdx.x, T::THREADS);
    cp_async_commit();

    // Online softmax on raw scores (the scale is folded into one FFMA before exp2). Thread holds
    // rows g = lane/4 (elements 0,1) and g + 8 (elements 2,3) of each tile. Only the last tile can
    // be ragged.
    if ((j + 1) * T::BN > p.seq_kv) {
      const int key0 = j * T::BN + 2 * (lane & 3);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < T::NT_S; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (key0 + nt * 8 + (e & 1) >= p.seq_kv) s[mt][nt][e] = -FLT_MAX;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float tile_max[2] = {-FLT_MAX, -FLT_MAX};
#pragma unroll
      for (int nt = 0; nt < T::NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[mt][nt][e]);
      float correction[2], shift[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[mt][r], tile_max[r]);
        correction[r] = exp2f((row_max[mt][r] - new_max) * p.scale_log2);
        row_max[mt][r] = new_max;
        row_sum[mt][r] *= correction[r];
        shift[r] = -new_max * p.scale_log2;
      }
#pragma unroll
      for (int nt = 0; nt < T::NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][nt][e] = exp2f(fmaf(s[mt][nt][e], p.scale_log2, shift[e >> 1]));
          row_sum[mt][e >> 1] += s[mt][nt][e];
        }
#pragma unroll
      for (int i = 0; i < T::NT_O; ++i) {
        acc[mt][i][0] *= correction[0];
        acc[mt][i][1] *= correction[0];
        acc[mt][i][2] *= correction[1];
        acc[mt][i][3] *= correction[1];
      }
    }

    cp_async_wait<1>();  // V_j has landed; K_{j+1} may still be in flight
    __syncthreads();

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < T::BN / 16; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) p_fragment<T::NT_S>(a[mt], s[mt], kk);
      accumulate_pv<MT, T::NT_O>(acc, a, sV + (kk * 16 + (lane & 15)) * T::STRIDE, p.d, lane);
    }
    __syncthreads();  // all warps are done with V_j
    if (j + 1 < tiles)
      load_rows<T::STRIDE>(sV, v, p.kv_row, (j + 1) * T::BN, T::BN, p.seq_kv, p.d, threadIdx.x, T::THREADS);
    cp_async_commit();
  }
  cp_async_wait<0>();

  // Normalize, stage this warp's rows in its own part of sQ, then write 16-byte vectors.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[r] = 1.f / sum;
    }
    half* out_rows = sQ + ((warp * MT + mt) * 16 + (lane >> 2)) * T::STRIDE + 2 * (lane & 3);
#pragma unroll
    for (int nt = 0; nt < T::NT_O; ++nt) {
      *reinterpret_cast<half2*>(out_rows + nt * 8) = __floats2half2_rn(acc[mt][nt][0] * inv[0], acc[mt][nt][1] * inv[0]);
      *reinterpret_cast<half2*>(out_rows + 8 * T::STRIDE + nt * 8) =
          __floats2half2_rn(acc[mt][nt][2] * inv[1], acc[mt][nt][3] * inv[1]);
    }
  }
  __syncthreads();
  const int vecs = p.d / 8;
  for (int i = threadIdx.x; i < T::BM * vecs; i += T::THREADS) {
    const int r = i / vecs, c = (i - r * vecs) * 8;
    if (m0 + r < p.seq_q)
      *reinterpret_cast<uint4*>(o + (m0 + r) * p.o_row + c) = *reinterpret_cast<const uint4*>(sQ + r * T::STRIDE + c);
  }
}

// ---- Short key sequences (cross-attention over text tokens) ------------------------------------
// All of K and V (up to MAX_KV keys) stay in shared memory for the block's life. Each warp then
// streams its own 16-row query tiles through a double buffer: it prefetches the next tile while it
// computes the current one, with a single-pass softmax over all keys and no block-wide barrier in
// the loop. This is a memory-bound problem (read Q, write O), so what matters is keeping loads in
// flight, not reusing K/V tiles.
template <int DK_, int MAX_KV_>
struct ShortKvTile {
  static constexpr int DK = DK_, MAX_KV = MAX_KV_, WARPS = 4, THREADS = 32 * WARPS;
  static constexpr int KSTEPS = (DK + 15) / 16;
  static constexpr int STRIDE = KSTEPS * 16 + 8;
  static constexpr int NT_O = DK / 8, NT_S = MAX_KV / 8;
  static constexpr int SMEM_BYTES = (2 * MAX_KV + WARPS * 2 * 16) * STRIDE * 2;
  static_assert(MAX_KV % 16 == 0, "keys come in 16-key MMA steps");
};

template <class T>
__global__ void __launch_bounds__(T::THREADS) short_kv_attention_kernel(AttentionParams p, int rows_per_block) {
  extern __shared__ __align__(16) half smem[];
  half* sK = smem;
  half* sV = sK + T::MAX_KV * T::STRIDE;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  half* sQ = sV + T::MAX_KV * T::STRIDE + warp * 2 * 16 * T::STRIDE;  // this warp's two 16-row buffers
  const int head = blockIdx.y, batch = blockIdx.z;
  const half* q = p.q + batch * p.q_batch + head * p.q_head;
  const half* k = p.k + batch * p.kv_batch + head * p.kv_head;
  const half* v = p.v + batch * p.kv_batch + head * p.kv_head;
  half* o = p.o + batch * p.o_batch + head * p.o_head;
  const int kv_pad = (p.seq_kv + 15) / 16 * 16;

  // K and Q columns past d feed the QK^T reduction: zero them (V's only reach unstored columns).
  const int pad_vecs = (T::KSTEPS * 16 - p.d) / 8;
  for (int i = threadIdx.x; i < kv_pad * pad_vecs; i += T::THREADS)
    *reinterpret_cast<uint4*>(sK + (i / pad_vecs) * T::STRIDE + p.d + (i % pad_vecs) * 8) = make_uint4(0, 0, 0, 0);
  for (int i = lane; i < 2 * 16 * pad_vecs; i += 32)
    *reinterpret_cast<uint4*>(sQ + (i / pad_vecs) * T::STRIDE + p.d + (i % pad_vecs) * 8) = make_uint4(0, 0, 0, 0);
  load_rows<T::STRIDE>(sK, k, p.kv_row, 0, kv_pad, p.seq_kv, p.d, threadIdx.x, T::THREADS);
  load_rows<T::STRIDE>(sV, v, p.kv_row, 0, kv_pad, p.seq_kv, p.d, threadIdx.x, T::THREADS);
  const int m_begin = blockIdx.x * rows_per_block;
  const int m_end = min(m_begin + rows_per_block, p.seq_q);
  int tile = m_begin + warp * 16;
  if (tile < m_end) load_rows<T::STRIDE>(sQ, q, p.q_row, tile, 16, p.seq_q, p.d, lane, 32);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();  // K and V are shared by all warps; from here on each warp works alone

  const int ksteps = (p.d + 15) / 16, key0 = 2 * (lane & 3);
  for (int buffer = 0; tile < m_end; tile += T::WARPS * 16, buffer ^= 1) {
    half* current = sQ + buffer * 16 * T::STRIDE;
    const int next = tile + T::WARPS * 16;
    if (next < m_end)
      load_rows<T::STRIDE>(sQ + (buffer ^ 1) * 16 * T::STRIDE, q, p.q_row, next, 16, p.seq_q, p.d, lane, 32);
    cp_async_commit();

    float s[1][T::NT_S][4];
#pragma unroll
    for (int i = 0; i < T::NT_S; ++i) s[0][i][0] = s[0][i][1] = s[0][i][2] = s[0][i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < T::KSTEPS; ++ks) {
      if (ks >= ksteps) break;
      unsigned a[1][4];
      ldmatrix_x4(a[0], current + (lane & 15) * T::STRIDE + (lane >> 4) * 8 + ks * 16);
      accumulate_qk<1, T::NT_S, T::STRIDE>(s, a, sK, ks, kv_pad, lane);
    }
    // Single-pass softmax over every key (rows g and g + 8 of the tile, as in attention_kernel).
    float row_max[2] = {-FLT_MAX, -FLT_MAX}, row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < T::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (key0 + nt * 8 + (e & 1) >= p.seq_kv) s[0][nt][e] = -FLT_MAX;
        row_max[e >> 1] = fmaxf(row_max[e >> 1], s[0][nt][e]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
      row_max[r] = -row_max[r] * p.scale_log2;
    }
#pragma unroll
    for (int nt = 0; nt < T::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[0][nt][e] = exp2f(fmaf(s[0][nt][e], p.scale_log2, row_max[e >> 1]));
        row_sum[e >> 1] += s[0][nt][e];
      }
    float acc[1][T::NT_O][4];
#pragma unroll
    for (int i = 0; i < T::NT_O; ++i) acc[0][i][0] = acc[0][i][1] = acc[0][i][2] = acc[0][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < T::MAX_KV / 16; ++kk) {
      if (kk * 16 >= kv_pad) break;
      unsigned a[1][4];
      p_fragment<T::NT_S>(a[0], s[0], kk);
      accumulate_pv<1, T::NT_O>(acc, a, sV + (kk * 16 + (lane & 15)) * T::STRIDE, p.d, lane);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      row_sum[r] = 1.f / row_sum[r];
    }
    __syncwarp();  // every lane's ldmatrix of this tile is done before it is overwritten with O
    half* out_rows = current + (lane >> 2) * T::STRIDE + 2 * (lane & 3);
#pragma unroll
    for (int nt = 0; nt < T::NT_O; ++nt) {
      *reinterpret_cast<half2*>(out_rows + nt * 8) =
          __floats2half2_rn(acc[0][nt][0] * row_sum[0], acc[0][nt][1] * row_sum[0]);
      *reinterpret_cast<half2*>(out_rows + 8 * T::STRIDE + nt * 8) =
          __floats2half2_rn(acc[0][nt][2] * row_sum[1], acc[0][nt][3] * row_sum[1]);
    }
    __syncwarp();
    const int vecs = p.d / 8;
    for (int i = lane; i < 16 * vecs; i += 32) {
      const int r = i / vecs, c = (i - r * vecs) * 8;
      if (tile + r < m_end)
        *reinterpret_cast<uint4*>(o + int64_t(tile + r) * p.o_row + c) =
            *reinterpret_cast<const uint4*>(current + r * T::STRIDE + c);
    }
    cp_async_wait<0>();  // the next tile has landed (this lane's copies) ...
    __syncwarp();        // ... and every lane's, and this tile's stores have read the buffer
  }
}

template <class T>
int launch_short_kv(const AttentionParams& p, int batch, int heads, cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      short_kv_attention_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::SMEM_BYTES);
  if (attr != cudaSuccess) return fail(SDP_CUDA_ERROR, std::string("attention smem: ") + cudaGetErrorString(attr));
  // About eight blocks per multiprocessor in all, so that the four or five that fit at once keep
  // 16-20 warps in flight; each block covers whole 16-row tiles.
  const int64_t tiles = (p.seq_q + 15) / 16;
  const int64_t per_item = std::max<int64_t>(1, (8 * multiprocessors() + int64_t(batch) * heads - 1) /
                                                    (int64_t(batch) * heads));
  const int rows_per_block = int((tiles + per_item - 1) / per_item) * 16;
  dim3 grid((p.seq_q + rows_per_block - 1) / rows_per_block, heads, batch);
  short_kv_attention_kernel<T><<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p, rows_per_block);
  return check_launch("short-kv attention kernel");
}

template <class T>
int launch(const AttentionParams& p, int batch, int heads, cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      attention_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::SMEM_BYTES);
  if (attr != cudaSuccess) return fail(SDP_CUDA_ERROR, std::string("attention smem: ") + cudaGetErrorString(attr));
  dim3 grid((p.seq_q + T::BM - 1) / T::BM, heads, batch);
  attention_kernel<T><<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p);
  return check_launch("attention kernel");
}

// Head-size dispatch: exact fast paths for SD's head sizes, generic tiles for the rest. For D = 40,
// two 16-row tiles per warp (128-row blocks) pay off once they still give every multiprocessor two
// blocks (measured on an H200: 343 -> 320 us at S = 4096). At D = 64 the two-tile variant needs 194
// registers, leaves 8 warps per multiprocessor and measured slower, for self-attention (291 -> 367 us)
// and cross-attention alike (15.2 -> 18.3 us at Sq = 4096, Skv = 77).
int dispatch(const AttentionParams& p, int batch, int heads, cudaStream_t stream) {
  // Short keys and many query rows: K/V-resident tiles. Measured on an H200 (Skv = 77): faster from
  // 65536 query rows in all (SDXL 1024^2: 88 -> 67 us), slower below 41K rows, where every small
  // block's K/V load dominates.
  if (p.seq_kv <= 128 && int64_t(p.seq_q) * heads * batch >= 65536) {
    if (p.d <= 64)
      return p.d == 40 ? launch_short_kv<ShortKvTile<40, 128>>(p, batch, heads, stream)
                       : launch_short_kv<ShortKvTile<64, 128>>(p, batch, heads, stream);
    if (p.d == 80 && p.seq_kv <= 80) return launch_short_kv<ShortKvTile<80, 80>>(p, batch, heads, stream);
  }
  const bool wide = int64_t((p.seq_q + 127) / 128) * heads * batch >= 2 * multiprocessors();
  switch (p.d) {
    case 40:
      return wide ? launch<AttentionTile<40, 4, 64, true, 2>>(p, batch, heads, stream)
                  : launch<AttentionTile<40, 4, 128, true>>(p, batch, heads, stream);
    case 64: return launch<AttentionTile<64, 4, 128, true>>(p, batch, heads, stream);  // two tiles measured slower
    case 80: return launch<AttentionTile<80, 4, 64, true>>(p, batch, heads, stream);
    case 160: return launch<AttentionTile<160, 4, 32, false>>(p, batch, heads, stream);
    default: break;
  }
  if (p.d <= 32) return launch<AttentionTile<32, 4, 64, true>>(p, batch, heads, stream);
  if (p.d <= 128) return launch<AttentionTile<128, 4, 64, false>>(p, batch, heads, stream);
  return launch<AttentionTile<256, 2, 32, false>>(p, batch, heads, stream);
}

// ---- Path: mma.sync kernels above (sm_75+), or the wgmma/TMA kernels (attention_sm90*.cu) -------
enum class Path { automatic, mma, wgmma };

// SDPLUGINS_ATTENTION=auto|mma|wgmma, read at every call so that tests and benchmarks can switch
// paths inside one process.
int requested_path(Path* path) {
  const char* value = std::getenv("SDPLUGINS_ATTENTION");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) {
    *path = Path::automatic;
  } else if (std::strcmp(value, "mma") == 0) {
    *path = Path::mma;
  } else if (std::strcmp(value, "wgmma") == 0) {
    *path = Path::wgmma;
  } else {
    return fail(SDP_INVALID_ARGUMENT,
                std::string("SDPLUGINS_ATTENTION must be auto, mma or wgmma, got '") + value + "'");
  }
  return SDP_OK;
}

// Whether the current device has compute capability 9.0 (the sm_90a kernels run there and only
// there); asked once per device.
bool device_is_sm90() {
  static std::atomic<int> known[64];  // 0: not asked yet, 1: yes, 2: no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const bool cached = device >= 0 && device < 64;
  if (cached) {
    const int k = known[device].load(std::memory_order_relaxed);
    if (k != 0) return k == 1;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  const bool yes = major == 9 && minor == 0;
  if (cached) known[device].store(yes ? 1 : 2, std::memory_order_relaxed);
  return yes;
}

int run_attention(const AttentionParams& p, const sm90::Problem& hopper, int batch, int heads, cudaStream_t stream) {
  Path path;
  if (const int err = requested_path(&path)) return err;
  if (path == Path::mma) return dispatch(p, batch, heads, stream);
  const bool on_hopper = sm90::available() && device_is_sm90();
  if (path == Path::wgmma && !on_hopper)
    return fail(SDP_INVALID_ARGUMENT, sm90::available()
                                          ? "SDPLUGINS_ATTENTION=wgmma needs a GPU of compute capability 9.0 (H100, H200)"
                                          : "SDPLUGINS_ATTENTION=wgmma: this library was built without its sm_90a "
                                            "kernels (CMake option SDPLUGINS_SM90A)");
  if (!on_hopper) return dispatch(p, batch, heads, stream);
  bool not_launched = false;
  const int err = sm90::run(hopper, stream, &not_launched);
  // A driver that cannot encode tensor maps: in auto mode the mma kernels still serve the call.
  if (err != SDP_OK && not_launched && path == Path::automatic) return dispatch(p, batch, heads, stream);
  return err;
}

}  // namespace

#define SDP_CHECK_ATTENTION_ARGS(batch, seq_q, seq_kv, heads, d)                                 \
  SDP_REQUIRE(batch >= 1 && seq_q >= 1 && seq_kv >= 1 && heads >= 1,                            \
              "batch, sequence lengths and heads must be >= 1");                                \
  SDP_REQUIRE(heads <= 65535 && batch <= 65535, "batch and heads must be <= 65535");            \
  SDP_REQUIRE(d % 8 == 0 && d >= 8 && d <= 256,                                                 \
              "head_dim must be a multiple of 8 in [8, 256], got " + std::to_string(d))

}  // namespace sdp

extern "C" int sdp_fmha(const void* qkv, void* out, int batch, int seq, int heads, int head_dim, float scale,
                        sdp_stream_t stream) {
  SDP_CHECK_ATTENTION_ARGS(batch, seq, seq, heads, head_dim);
  SDP_REQUIRE(scale > 0.f, "scale must be > 0");
  SDP_REQUIRE(qkv && out && sdp::aligned16(qkv) && sdp::aligned16(out), "pointers must be non-null and 16-byte aligned");
  const half* base = static_cast<const half*>(qkv);
  const int64_t row = int64_t(heads) * 3 * head_dim;
  sdp::AttentionParams p{base, base + head_dim, base + 2 * head_dim, static_cast<half*>(out),
                         seq * row, row, 3 * head_dim,
                         seq * row, row, 3 * head_dim,
                         int64_t(seq) * heads * head_dim, int64_t(heads) * head_dim, head_dim,
                         seq, seq, head_dim, scale * 1.4426950408889634f};
  const sdp::sm90::Problem hopper{qkv, 3 * heads, 3, qkv, 3 * heads, 3, 1, 2, out,
                                  batch, seq, seq, heads, head_dim, p.scale_log2};
  return sdp::run_attention(p, hopper, batch, heads, reinterpret_cast<cudaStream_t>(stream));
}

extern "C" int sdp_fmhca(const void* q, const void* kv, void* out, int batch, int seq_q, int seq_kv, int heads,
                         int head_dim, float scale, sdp_stream_t stream) {
  SDP_CHECK_ATTENTION_ARGS(batch, seq_q, seq_kv, heads, head_dim);
  SDP_REQUIRE(scale > 0.f, "scale must be > 0");
  SDP_REQUIRE(q && kv && out && sdp::aligned16(q) && sdp::aligned16(kv) && sdp::aligned16(out),
              "pointers must be non-null and 16-byte aligned");
  const half* kv_base = static_cast<const half*>(kv);
  const int64_t q_row = int64_t(heads) * head_dim, kv_row = int64_t(heads) * 2 * head_dim;
  sdp::AttentionParams p{static_cast<const half*>(q), kv_base, kv_base + head_dim, static_cast<half*>(out),
                         seq_q * q_row, q_row, head_dim,
                         seq_kv * kv_row, kv_row, 2 * head_dim,
                         seq_q * q_row, q_row, head_dim,
                         seq_q, seq_kv, head_dim, scale * 1.4426950408889634f};
  const sdp::sm90::Problem hopper{q, heads, 1, kv, 2 * heads, 2, 0, 1, out,
                                  batch, seq_q, seq_kv, heads, head_dim, p.scale_log2};
  return sdp::run_attention(p, hopper, batch, heads, reinterpret_cast<cudaStream_t>(stream));
}
