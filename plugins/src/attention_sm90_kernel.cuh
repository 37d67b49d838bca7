// Fused multi-head attention for Hopper (sm_90a): TMA loads into an mbarrier pipeline, wgmma on
// tensor cores, online softmax in registers (FlashAttention-3's design, written from scratch).
//
// Block = 1 producer warpgroup (warps 0-3; one thread issues all loads, the group hands its registers
// to the others with setmaxnreg) + 2 consumer warpgroups (warps 4-11, 240 registers per thread),
// persistent over work items (one 128-row query block of one (batch, head) each, see Schedule).
//
// Producer (one thread): per item, Q [128 x D] into a Q stage, then for each tile of BN keys K_j and
// V_j into K/V stages; each stage has a "full" mbarrier (arrive + TMA transaction bytes) and an
// "empty" one (all 256 consumer threads arrive when the tensor cores are done reading it). Columns
// past D and rows past the sequence come back from TMA as zeros; nothing is padded in memory.
//
// Consumer warpgroup w (query rows 64 w .. 64 w + 63 of the item):
//   S_0 = Q K_0^T; softmax -> P_0 (fp16, registers)
//   for j >= 1:  issue S_j = Q K_j^T; rescale O; issue O += P_{j-1} V_{j-1}   (both asynchronous)
//                wait for S_j; softmax(S_j) -> P_j while the tensor cores run P_{j-1} V_{j-1}
//                wait for O
//   O += P_last V_last; O /= row sums; 16-byte stores of the rows below the sequence length.
// The two warpgroups take turns issuing their GEMMs (named barriers 1 and 2), so one's softmax runs
// while the other's matrix products do.
//
// S = Q K^T: A = Q and B = K both K-major from shared memory (wgmma_ss). O += P V: A = P from
// registers (the fp32 accumulator fragment of S, converted to fp16, is exactly the A fragment of
// m64nNk16), B = V from shared memory, MN-major (V is [keys, D] with D contiguous).
#pragma once

#include <cuda.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "attention_sm90_layout.cuh"
#include "attention_sm90_wgmma.cuh"

namespace sdp {
namespace sm90 {

struct KernelParams {
  CUtensorMap q_map;   // [B, Sq, q slots, D] fp16, box (W, 1, BM, 1)
  CUtensorMap kv_map;  // [B, Skv, kv slots, D] fp16, box (W, 1, BN, 1)
  half* o;             // [B, Sq, H, D]
  int64_t o_batch, o_row, o_head;
  int seq_q, seq_kv, d;
  int q_slot_mul;                      // Q of head h is slot h * q_slot_mul of q_map
  int kv_slot_mul, k_slot, v_slot;     // K (V) of head h is slot h * kv_slot_mul + k_slot (v_slot)
  int kv_tiles;
  Schedule schedule;
  float scale_log2;  // softmax scale * log2(e)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int N>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Register "fences" for the compiler: an asynchronous wgmma reads and writes these registers after
// its asm statement has issued; these empty volatile asms pin every access to them between the
// issue and the matching wait (ptxas keeps them allocated until then).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Ends a basic block with a branch (never taken). ptxas schedules a wgmma wait as early as it can
// inside a block; without this, the wait for P V moves above the softmax it is meant to overlap
// with. (A __trap() here would make ptxas give up the setmaxnreg register budget and spill.)
__device__ __forceinline__ void end_block(int never_negative) {
  asm volatile(
      "{\n"
      ".reg .pred negative;\n"
      "setp.lt.s32 negative, %0, 0;\n"
      "@!negative bra.uni DONE;\n"
      "nanosleep.u32 1;\n"
      "DONE:\n"
      "}\n" ::"r"(never_negative));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// S = Q K^T over QK_K (issued and committed, not waited for).
template <class C>
__device__ __forceinline__ void issue_qk(float (&s)[C::S_REGS], uint32_t q_tile, uint32_t k_tile) {
  fence_registers(s);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < C::QK_K / 16; ++ks)
    wgmma_ss(s, k_major_descriptor<C>(q_tile + k_step_offset<C>(ks, C::Q_BLOCK_BYTES)),
             k_major_descriptor<C>(k_tile + k_step_offset<C>(ks, C::KV_BLOCK_BYTES)), ks > 0);
  wgmma_commit();
}

// O += P V over the BN keys of the tile (issued and committed, not waited for).
template <class C>
__device__ __forceinline__ void issue_pv(float (&o)[C::O_REGS], uint32_t (&p)[C::BN / 16][4], uint32_t v_tile) {
  fence_registers(o);
  fence_registers(p);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < C::BN / 16; ++kk) wgmma_rs(o, p[kk], mn_major_descriptor<C>(v_tile + kk * 16 * C::WB));
  wgmma_commit();
}

// Online softmax over one tile of scores, rows lane / 4 (r = 0) and lane / 4 + 8 (r = 1) of this
// warp's 16. Keys at or past seq_kv (only in a ragged last tile) are masked. Leaves probabilities
// in s, the running max and (per-thread partial) sums updated, and the factor O must be scaled by.
template <class C>
__device__ __forceinline__ void online_softmax(float (&s)[C::S_REGS], int key0, int seq_kv, bool ragged, float scale_log2,
                                               float (&row_max)[2], float (&row_sum)[2], float (&correction)[2]) {
  if (ragged) {
#pragma unroll
    for (int i = 0; i < C::S_REGS; ++i)
      if (key0 + acc_col(0, i) >= seq_kv) s[i] = -FLT_MAX;
  }
  float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
  for (int i = 0; i < C::S_REGS; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], s[i]);
  float shift[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    correction[r] = exp2f((row_max[r] - tile_max[r]) * scale_log2);
    row_max[r] = tile_max[r];
    shift[r] = -tile_max[r] * scale_log2;
  }
  float sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // two partial sums per row: shorter dependency chains
#pragma unroll
  for (int i = 0; i < C::S_REGS; ++i) {
    s[i] = exp2f(fmaf(s[i], scale_log2, shift[(i >> 1) & 1]));
    sum[(i >> 1) & 1][(i >> 2) & 1] += s[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * correction[r] + (sum[r][0] + sum[r][1]);
}

// Probabilities (fp32 accumulator fragment of S) -> fp16 A fragments of P V, one per 16 keys.
template <class C>
__device__ __forceinline__ void to_fragments(uint32_t (&p)[C::BN / 16][4], const float (&s)[C::S_REGS]) {
#pragma unroll
  for (int kk = 0; kk < C::BN / 16; ++kk) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[kk][j] = pack_half2(s[p_source(kk, j, 0)], s[p_source(kk, j, 1)]);
  }
}

template <class C>
__device__ __forceinline__ void rescale(float (&o)[C::O_REGS], const float (&correction)[2]) {
#pragma unroll
  for (int i = 0; i < C::O_REGS; ++i) o[i] *= correction[(i >> 1) & 1];
}

// O / row sum -> fp16, 16-byte stores: a quad transpose gives each lane 8 consecutive columns.
template <class C>
__device__ __forceinline__ void store_output(const float (&o)[C::O_REGS], const float (&row_sum)[2], half* out,
                                             int64_t row_stride, int row0, int seq_q, int d, int lane) {
  const int chunks = d / 8;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = 1.f / sum;
    const int row = row0 + 8 * r;
#pragma unroll
    for (int q = 0; q < (C::O_CHUNKS + 3) / 4; ++q) {
      uint32_t x[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int c = 4 * q + k;
        x[k] = c < C::O_CHUNKS ? pack_half2(o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv) : 0u;
      }
#pragma unroll
      for (int bit = 1; bit <= 2; bit <<= 1) {
        uint32_t send[2], received[2];
        quad_send(x, lane, bit, send);
        received[0] = __shfl_xor_sync(0xffffffffu, send[0], bit);
        received[1] = __shfl_xor_sync(0xffffffffu, send[1], bit);
        quad_receive(x, lane, bit, received);
      }
      const int c = 4 * q + (lane & 3);
      if (row < seq_q && c < chunks)
        *reinterpret_cast<uint4*>(out + row * row_stride + 8 * c) = make_uint4(x[0], x[1], x[2], x[3]);
    }
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <class C>
__global__ void __launch_bounds__(C::THREADS, 1) attention_sm90_kernel(const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = base, sK = base + C::K_OFFSET, sV = base + C::V_OFFSET, bars = base + C::BAR_OFFSET;
  // mbarriers: q_full[QST], q_empty[QST], k_full[KVST], k_empty[KVST], v_full[KVST], v_empty[KVST]
  const auto q_full = [&](int i) { return bars + 8u * i; };
  const auto q_empty = [&](int i) { return bars + 8u * (C::QST + i); };
  const auto k_full = [&](int i) { return bars + 8u * (2 * C::QST + i); };
  const auto k_empty = [&](int i) { return bars + 8u * (2 * C::QST + C::KVST + i); };
  const auto v_full = [&](int i) { return bars + 8u * (2 * C::QST + 2 * C::KVST + i); };
  const auto v_empty = [&](int i) { return bars + 8u * (2 * C::QST + 3 * C::KVST + i); };
  constexpr int CONSUMER_THREADS = 128 * C::CONSUMERS;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < C::QST; ++i) {
      mbarrier_init(q_full(i), 1);
      mbarrier_init(q_empty(i), CONSUMER_THREADS);
    }
    for (int i = 0; i < C::KVST; ++i) {
      mbarrier_init(k_full(i), 1);
      mbarrier_init(k_empty(i), CONSUMER_THREADS);
      mbarrier_init(v_full(i), 1);
      mbarrier_init(v_empty(i), CONSUMER_THREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {  // ---- producer warpgroup: one thread issues every load ----
    registers_decrease<C::PRODUCER_REGISTERS>();
    if (warp != 0 || lane != 0) return;
    prefetch_tensor_map(&p.q_map);
    prefetch_tensor_map(&p.kv_map);
    ItemWalker walker(p.schedule, p.kv_tiles, blockIdx.x);
    Item it;
    while (walker.next(it)) {
      const int qs = it.q_index % C::QST;
      mbarrier_wait(q_empty(qs), ((it.q_index / C::QST) & 1) ^ 1);
      mbarrier_arrive_expect_tx(q_full(qs), C::Q_STAGE_BYTES);
#pragma unroll
      for (int blk = 0; blk < C::NBLK; ++blk)
        tma_load(sQ + qs * C::Q_STAGE_BYTES + blk * C::Q_BLOCK_BYTES, &p.q_map, q_full(qs), blk * C::W,
                 it.head * p.q_slot_mul, it.q_block * C::BM, it.batch);
      if (!it.fresh_kv) continue;
      for (int j = 0; j < p.kv_tiles; ++j) {
        const uint32_t idx = it.kv_first + j;
        const int st = idx % C::KVST;
        const uint32_t free_parity = ((idx / C::KVST) & 1) ^ 1;
        // K's stage, then V's (separate barriers, so QK^T can start before V lands)
        const auto load = [&](uint32_t tiles, uint32_t empty, uint32_t full, int slot) {
          mbarrier_wait(empty, free_parity);
          mbarrier_arrive_expect_tx(full, C::KV_STAGE_BYTES);
#pragma unroll
          for (int blk = 0; blk < C::NBLK; ++blk)
            tma_load(tiles + st * C::KV_STAGE_BYTES + blk * C::KV_BLOCK_BYTES, &p.kv_map, full, blk * C::W,
                     it.head * p.kv_slot_mul + slot, j * C::BN, it.batch);
        };
        load(sK, k_empty(st), k_full(st), p.k_slot);
        load(sV, v_empty(st), v_full(st), p.v_slot);
      }
    }
    return;
  }

  // ---- consumer warpgroups ----
  registers_increase<C::CONSUMER_REGISTERS>();
  const int wg = warp / 4 - 1, warp_in_wg = warp % 4;
  const int kv_tiles = p.kv_tiles;
  const bool ragged = p.seq_kv % C::BN != 0;
  const int key_lane = 2 * (lane & 3);
  bool wait_for_turn = wg == 1;  // warpgroup 0 takes the very first turn without waiting

  float s[C::S_REGS], o[C::O_REGS];
  uint32_t pf[C::BN / 16][4];
#pragma unroll
  for (int i = 0; i < C::S_REGS; ++i) s[i] = 0.f;

  ItemWalker walker(p.schedule, kv_tiles, blockIdx.x);
  Item it;
  while (walker.next(it)) {
    const int qs = it.q_index % C::QST;
    mbarrier_wait(q_full(qs), (it.q_index / C::QST) & 1);
    const uint32_t q_tile = sQ + qs * C::Q_STAGE_BYTES + wg * 64 * C::WB;

#pragma unroll
    for (int i = 0; i < C::O_REGS; ++i) o[i] = 0.f;
    float row_max[2] = {-FLT_MAX, -FLT_MAX}, row_sum[2] = {0.f, 0.f}, correction[2];

    // Tile 0: S_0, softmax, P_0.
    {
      const int st = it.kv_first % C::KVST;
      mbarrier_wait(k_full(st), (it.kv_first / C::KVST) & 1);
      issue_qk<C>(s, q_tile, sK + st * C::KV_STAGE_BYTES);
      wgmma_wait<0>();
      fence_registers(s);
      if (!it.keep_kv) mbarrier_arrive(k_empty(st));
      if (kv_tiles == 1) mbarrier_arrive(q_empty(qs));
      online_softmax<C>(s, key_lane, p.seq_kv, ragged && kv_tiles == 1, p.scale_log2, row_max, row_sum, correction);
      to_fragments<C>(pf, s);
    }
    for (int j = 1; j < kv_tiles; ++j) {
      const uint32_t idx = it.kv_first + j;
      const int st = idx % C::KVST, prev_st = (idx - 1) % C::KVST;
      mbarrier_wait(k_full(st), (idx / C::KVST) & 1);
      if (wait_for_turn) named_barrier_sync(1 + wg, CONSUMER_THREADS);
      wait_for_turn = true;
      issue_qk<C>(s, q_tile, sK + st * C::KV_STAGE_BYTES);
      rescale<C>(o, correction);
      mbarrier_wait(v_full(prev_st), ((idx - 1) / C::KVST) & 1);
      issue_pv<C>(o, pf, sV + prev_st * C::KV_STAGE_BYTES);
      // Hand the turn to the other warpgroup, except warpgroup 1 after its very last turn: every
      // sync then has exactly one matching arrive.
      if (wg == 0 || !(it.last && j == kv_tiles - 1)) named_barrier_arrive(1 + (wg ^ 1), CONSUMER_THREADS);
      wgmma_wait<1>();  // S_j is done; P_{j-1} V_{j-1} may still run
      fence_registers(s);
      mbarrier_arrive(k_empty(st));
      if (j == kv_tiles - 1) mbarrier_arrive(q_empty(qs));
      online_softmax<C>(s, j * C::BN + key_lane, p.seq_kv, ragged && j == kv_tiles - 1, p.scale_log2, row_max, row_sum,
                        correction);
      end_block(p.d);
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(pf);
      mbarrier_arrive(v_empty(prev_st));
      to_fragments<C>(pf, s);
    }
    // Last tile's P V.
    {
      const uint32_t idx = it.kv_first + kv_tiles - 1;
      const int st = idx % C::KVST;
      rescale<C>(o, correction);
      mbarrier_wait(v_full(st), (idx / C::KVST) & 1);
      issue_pv<C>(o, pf, sV + st * C::KV_STAGE_BYTES);
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(pf);
      if (!it.keep_kv) mbarrier_arrive(v_empty(st));
    }
    half* out = p.o + it.batch * p.o_batch + it.head * p.o_head;
    store_output<C>(o, row_sum, out, p.o_row, it.q_block * C::BM + wg * 64 + warp_in_wg * 16 + lane / 4, p.seq_q, p.d,
                    lane);
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace sm90
}  // namespace sdp
