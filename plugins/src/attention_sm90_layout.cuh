// Hopper attention (sm_90a): tile geometry, shared-memory layout and the small pieces of index logic
// that the kernel (attention_sm90_kernel.cuh) and the host launcher share. Plain C++ apart from the
// __host__ __device__ markers, so tests/attention_sm90_selfcheck.cpp can compile it on a CPU and check
// it against an independent model of what TMA writes and what wgmma reads.
#pragma once

#include <cstdint>

#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif

namespace sdp {
namespace sm90 {

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }
constexpr int max_of(int a, int b) { return a > b ? a : b; }

// Widest swizzle span (in halves: 64, 32 or 16) that divides n.
constexpr int swizzle_width(int n) { return n % 64 == 0 ? 64 : n % 32 == 0 ? 32 : 16; }

// One kernel instantiation.
//   D_QK  largest head size it serves; Q K^T reduces over QK_K = D_QK rounded up to 16 (k16 steps).
//   DP    output columns of P V (the wgmma N; >= D, a multiple of 16).
//   BN    keys per K/V tile (the wgmma N of Q K^T).
//   QST   Q stages (2: the next work item's Q loads while this one computes).
//   KVST  K/V stages.
// Shared memory holds Q, K and V as the TMA boxes write them: per tensor, NBLK column blocks of W
// halves, W the swizzle span (64 -> 128-byte, 32 -> 64-byte, 16 -> 32-byte swizzle), each block
// [rows][W] with 16-byte chunks XOR-swizzled. W divides DP, so P V's B operand (V, MN-major) covers
// whole swizzle atoms, the canonical layout. Columns past the real D are zeros (TMA out-of-bounds
// fill), so padded k-steps add nothing and padded output columns are never stored.
template <int D_QK_, int DP_, int BN_, int QST_, int KVST_ = 2>
struct Config {
  static constexpr int D_QK = D_QK_, DP = DP_, BN = BN_, QST = QST_, KVST = KVST_;
  static constexpr int BM = 128;                  // query rows per work item: two consumer warpgroups x 64
  static constexpr int CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);  // + the producer warpgroup
  // Registers per thread after setmaxnreg: the producer warpgroup gives up what the consumers take
  // (launch: 65536 / 384 -> 168 each; 128 x (168 - 24) = 256 x (240 - 168)).
  static constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
  static constexpr int QK_K = round_up(D_QK, 16);
  static constexpr int W = swizzle_width(DP);
  static constexpr int COLS = round_up(max_of(QK_K, DP), W);
  static constexpr int WB = 2 * W;                // bytes per row of one column block = swizzle span
  static constexpr int NBLK = COLS / W;
  static constexpr int SWIZZLE_MODE = W == 64 ? 1 : W == 32 ? 2 : 3;  // descriptor layout type
  static constexpr int Q_BLOCK_BYTES = BM * WB, Q_STAGE_BYTES = NBLK * Q_BLOCK_BYTES;
  static constexpr int KV_BLOCK_BYTES = BN * WB, KV_STAGE_BYTES = NBLK * KV_BLOCK_BYTES;
  // Offsets from the 1024-byte aligned base: Q stages, K stages, V stages, then the mbarriers.
  static constexpr int K_OFFSET = QST * Q_STAGE_BYTES;
  static constexpr int V_OFFSET = K_OFFSET + KVST * KV_STAGE_BYTES;
  static constexpr int BAR_OFFSET = V_OFFSET + KVST * KV_STAGE_BYTES;
  static constexpr int BARRIERS = 2 * QST + 4 * KVST;  // q full/empty, k full/empty, v full/empty
  static constexpr int SMEM_BYTES = 1024 /* alignment slack */ + BAR_OFFSET + 8 * BARRIERS;
  static constexpr int S_REGS = BN / 2, O_REGS = DP / 2;  // fp32 accumulators per thread
  static constexpr int O_CHUNKS = DP / 8;                 // 8-column output chunks

  static_assert(DP % 16 == 0 && DP % W == 0 && DP <= 256 && DP >= D_QK, "output tile: whole swizzle atoms");
  static_assert(BN % 16 == 0 && BN <= 256, "keys per tile: whole k16 steps of P V, a TMA box of <= 256 rows");
  static_assert(QK_K <= COLS && DP <= COLS, "Q/K/V tiles cover both GEMMs");
  static_assert(Q_BLOCK_BYTES % 1024 == 0 && KV_BLOCK_BYTES % 1024 == 0,
                "every column block starts on a swizzle-pattern boundary");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per block");
};

// ---- wgmma shared-memory matrix descriptors ------------------------------------------------------
// Bits 0-13 start address >> 4, 16-29 leading-dimension byte offset >> 4, 32-45 stride-dimension byte
// offset >> 4, 49-51 base offset (0: every block is swizzle-aligned), 62-63 swizzle mode.
__host__ __device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t lbo, uint32_t sbo, int mode) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(mode) << 62);
}

// K-major operand (Q as A, K as B of Q K^T): rows of WB bytes, 8-row groups SBO = 8 * WB apart; the
// leading offset is unused for swizzled K-major layouts (1 by convention). `address` points at the
// k16 step: block base + (16 * ks mod W) * 2 bytes.
template <class C>
__host__ __device__ __forceinline__ uint64_t k_major_descriptor(uint32_t address) {
  return smem_descriptor(address, 16, 8 * C::WB, C::SWIZZLE_MODE);
}

// MN-major operand (V as B of P V, N = head columns contiguous): 8 key rows of WB bytes form one
// swizzle atom, the next 8 keys SBO = 8 * WB further; the next W columns live in the next column
// block, LBO = BN * WB further. `address` points at key 16 * kk of column block 0.
template <class C>
__host__ __device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t address) {
  return smem_descriptor(address, C::KV_BLOCK_BYTES, 8 * C::WB, C::SWIZZLE_MODE);
}

// Byte offset of Q K^T's k16 step `ks` inside a tile (column block, then 32-byte step inside it).
template <class C>
__host__ __device__ constexpr uint32_t k_step_offset(int ks, int block_bytes) {
  return uint32_t((16 * ks) / C::W * block_bytes + (16 * ks) % C::W * 2);
}

// ---- accumulator fragments (wgmma m64nNk16, fp32) -----------------------------------------------
// Thread `lane` of warp `w` (of the warpgroup) holds, for each 8-column chunk i, elements 4i + e:
// row 16 w + lane / 4 + 8 (e / 2), column 8 i + 2 (lane % 4) + e % 2.
__host__ __device__ constexpr int acc_row(int warp, int lane, int e) { return 16 * warp + lane / 4 + 8 * ((e & 3) >> 1); }
__host__ __device__ constexpr int acc_col(int lane, int e) { return 8 * (e >> 2) + 2 * (lane & 3) + (e & 1); }

// ---- epilogue: 4x4 transpose of 32-bit values across the 4 lanes of a quad ------------------------
// Before: lane t holds x[k] = columns (2t, 2t + 1) of chunk k. After: lane t holds x[s] = columns
// (2s, 2s + 1) of chunk t, i.e. all 8 columns of chunk t, for one 16-byte store. Two butterfly
// steps (lane bit 0 <-> element bit 0, then bit 1), each: send two values, receive two values.
__host__ __device__ __forceinline__ void quad_send(const uint32_t (&x)[4], int lane, int bit, uint32_t (&out)[2]) {
  if (bit == 1) {
    const bool odd = lane & 1;
    out[0] = odd ? x[0] : x[1];
    out[1] = odd ? x[2] : x[3];
  } else {
    const bool high = lane & 2;
    out[0] = high ? x[0] : x[2];
    out[1] = high ? x[1] : x[3];
  }
}

__host__ __device__ __forceinline__ void quad_receive(uint32_t (&x)[4], int lane, int bit, const uint32_t (&in)[2]) {
  if (bit == 1) {
    if (lane & 1) {
      x[0] = in[0];
      x[2] = in[1];
    } else {
      x[1] = in[0];
      x[3] = in[1];
    }
  } else {
    if (lane & 2) {
      x[0] = in[0];
      x[1] = in[1];
    } else {
      x[2] = in[0];
      x[3] = in[1];
    }
  }
}

// ---- tensor maps --------------------------------------------------------------------------------
// A contiguous fp16 tensor [batch, seq, slots, d] as TMA sees it: dimensions innermost first
// (d, slots, seq, batch), byte strides of the outer three, and a box of `w` columns x 1 slot x `rows`
// rows x 1 batch. The box may reach past d and past seq: those elements load as zeros.
struct TensorMapGeometry {
  uint64_t dims[4];
  uint64_t strides[3];
  uint32_t box[4];
};

inline TensorMapGeometry tensor_map_geometry(int batch, int seq, int slots, int d, int w, int rows) {
  const uint64_t row = uint64_t(slots) * d * 2;
  return {{uint64_t(d), uint64_t(slots), uint64_t(seq), uint64_t(batch)},
          {uint64_t(d) * 2, row, row * uint64_t(seq)},
          {uint32_t(w), 1u, uint32_t(rows), 1u}};
}

// ---- work items ---------------------------------------------------------------------------------
// A work item is one BM-row query block of one (batch, head); items are numbered query block first,
// then head, then batch. Block `cta` takes items cta, cta + grid, ... (`contiguous` = 0: the blocks
// running at once share heads, so each K/V tile comes from L2 after the first read) or the run
// [cta * per_cta, (cta + 1) * per_cta) (`contiguous` = 1, with a single K/V tile: consecutive items
// of one head keep the K/V tile loaded).
struct Schedule {
  int items, per_cta, grid, contiguous, q_blocks, heads;
  __host__ __device__ int item(int cta, int n) const {
    const int i = contiguous ? (n < per_cta ? cta * per_cta + n : items) : cta + n * grid;
    return i < items ? i : items;
  }
};

// One work item and where its tiles sit in the pipelines. Pipeline slots are used in a fixed order:
// Q stage use q_index -> stage q_index % QST, mbarrier phase parity (q_index / QST) & 1; K/V tile j
// of the item -> ring index kv_first + j, stage % KVST, parity (index / KVST) & 1.
struct Item {
  int q_block, head, batch, hb;  // hb = head + heads * batch
  bool fresh_kv;   // the producer loads this item's K/V tiles (else the one resident tile is reused)
  bool keep_kv;    // a single K/V tile that the block's next item reuses: consumers do not release it
  bool last;       // the block's last item
  uint32_t q_index, kv_first;
};

// The sequence of items of one block. The producer thread and every consumer thread walk the same
// sequence with their own walker, so they agree on every stage and parity without talking.
struct ItemWalker {
  Schedule schedule;
  int kv_tiles, cta;
  int n = 0, previous_hb = -1;
  uint32_t q_count = 0, kv_count = 0;

  __host__ __device__ ItemWalker(const Schedule& s, int tiles, int block) : schedule(s), kv_tiles(tiles), cta(block) {}

  __host__ __device__ bool next(Item& it) {
    const int item = schedule.item(cta, n);
    if (item >= schedule.items) return false;
    const int following = schedule.item(cta, n + 1);
    it.q_block = item % schedule.q_blocks;
    it.hb = item / schedule.q_blocks;
    it.head = it.hb % schedule.heads;
    it.batch = it.hb / schedule.heads;
    it.last = following >= schedule.items;
    it.fresh_kv = kv_tiles > 1 || it.hb != previous_hb;
    it.keep_kv = kv_tiles == 1 && !it.last && following / schedule.q_blocks == it.hb;
    it.q_index = q_count++;
    it.kv_first = it.fresh_kv ? kv_count : kv_count - 1;
    if (it.fresh_kv) kv_count += uint32_t(kv_tiles);
    previous_hb = it.hb;
    ++n;
    return true;
  }
};

// Index of the S accumulator element that becomes half `h` of register `j` of P's A fragment for
// k-step kk (the m64nNk16 accumulator and A fragments line up: no data moves between threads).
__host__ __device__ constexpr int p_source(int kk, int j, int h) { return 8 * kk + 2 * j + h; }

}  // namespace sm90
}  // namespace sdp
