// CPU self-check of the Hopper attention kernel's index logic (plugins/src/attention_sm90_layout.cuh),
// built and run by tests/test_attention_sm90_build.py. No GPU involved: it checks the layout code
// against independent models of the hardware as documented (CUTLASS's canonical GMMA layouts, the
// TMA swizzle patterns, the wgmma register fragments), and simulates the mbarrier pipeline.
//
//   1. Descriptors: for every instantiation, every element that a wgmma reads through the kernel's
//      descriptors (Q and K for S = Q K^T, V for O += P V) is at the shared-memory address where the
//      TMA box put the element the math needs.
//   2. Fragments: P's A fragments are built from the right S accumulator elements.
//   3. The epilogue's quad transpose.
//   4. The tensor-map geometry addresses [B, S, slots, D] row-major.
//   5. The pipeline: producer and two consumer warpgroups, mbarrier phases and parities exactly as
//      the kernel uses them, run under many random interleavings: no deadlock, every tile a consumer
//      reads is the one it expects, no load overwrites a stage still in use.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "attention_sm90_layout.cuh"

using namespace sdp::sm90;

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      if (failures++ < 20) {              \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);         \
        std::printf("\n");                \
      }                                   \
    }                                     \
  } while (0)

// ---- models of the hardware -----------------------------------------------------------------------

// TMA (and GMMA) swizzle of a shared-memory byte address: the 16-byte chunk index (address bits 4..)
// is XORed with the bits from 7 up: Swizzle<3,4,3> for 128 B, <2,4,3> for 64 B.
static uint32_t swizzle(uint32_t address, int span_bytes) {
  const uint32_t bits = span_bytes == 128 ? 7u : span_bytes == 64 ? 3u : 1u;
  return address ^ (((address >> 7) & bits) << 4);
}

// Where a TMA load of a (w columns) x (rows) box with span-byte swizzle puts element (row, col),
// relative to the (1024-aligned) destination.
static uint32_t tma_address(uint32_t destination, int row, int col, int w) {
  return swizzle(destination + uint32_t(row) * (2 * w) + uint32_t(col) * 2, 2 * w);
}

struct Descriptor {
  uint32_t start, lbo, sbo;
  int mode;
};

static Descriptor decode(uint64_t d) {
  return {uint32_t(d & 0x3FFF) << 4, uint32_t((d >> 16) & 0x3FFF) << 4, uint32_t((d >> 32) & 0x3FFF) << 4,
          int(d >> 62)};
}

static int span_of(int mode) { return mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0; }

// CUTLASS's canonical GMMA layouts (cute/atom/mma_traits_sm90_gmma.hpp), in bytes for 16-bit
// elements. K-major, swizzled: ((8, m), (8 elements, 2)) : ((span, SBO), (2 B, 16 B)).
static uint32_t gmma_k_major(const Descriptor& d, int mn, int k) {
  const int span = span_of(d.mode);
  return swizzle(d.start + uint32_t(mn % 8) * span + uint32_t(mn / 8) * d.sbo + uint32_t(k / 8) * 16 + uint32_t(k % 8) * 2,
                 span);
}

// MN-major, swizzled: ((8 elements, span / 16, n), (8, k)) : ((2 B, 16 B, LBO), (span, SBO)).
static uint32_t gmma_mn_major(const Descriptor& d, int mn, int k) {
  const int span = span_of(d.mode), chunks = span / 16;
  return swizzle(d.start + uint32_t(mn % 8) * 2 + uint32_t((mn / 8) % chunks) * 16 + uint32_t(mn / (8 * chunks)) * d.lbo +
                     uint32_t(k % 8) * span + uint32_t(k / 8) * d.sbo,
                 span);
}

// ---- 1. descriptors against TMA placement ----------------------------------------------------------

template <class C>
static void check_descriptors(const char* name) {
  static_assert(C::SMEM_BYTES <= 227 * 1024, "");
  const uint32_t base = 1024 * 3;  // any 1024-aligned shared-memory address
  CHECK(base + C::BAR_OFFSET + 8 * C::BARRIERS + 1023 <= base + C::SMEM_BYTES, "%s: shared memory budget", name);
  for (int qs = 0; qs < C::QST; ++qs) {
    for (int wg = 0; wg < 2; ++wg) {
      const uint32_t q_tile = base + qs * C::Q_STAGE_BYTES + wg * 64 * C::WB;  // as the kernel computes it
      for (int ks = 0; ks < C::QK_K / 16; ++ks) {
        const Descriptor d = decode(k_major_descriptor<C>(q_tile + k_step_offset<C>(ks, C::Q_BLOCK_BYTES)));
        CHECK(d.mode == C::SWIZZLE_MODE && span_of(d.mode) == C::WB, "%s: Q swizzle mode", name);
        for (int m = 0; m < 64; ++m)
          for (int k = 0; k < 16; ++k) {
            const int row = 64 * wg + m, col = 16 * ks + k, blk = col / C::W;
            const uint32_t want = tma_address(base + qs * C::Q_STAGE_BYTES + blk * C::Q_BLOCK_BYTES, row, col % C::W, C::W);
            CHECK(gmma_k_major(d, m, k) == want, "%s: Q element (%d, %d) wg %d", name, row, col, wg);
          }
      }
    }
  }
  for (int st = 0; st < C::KVST; ++st) {
    const uint32_t k_tile = base + C::K_OFFSET + st * C::KV_STAGE_BYTES;
    const uint32_t v_tile = base + C::V_OFFSET + st * C::KV_STAGE_BYTES;
    for (int ks = 0; ks < C::QK_K / 16; ++ks) {
      const Descriptor d = decode(k_major_descriptor<C>(k_tile + k_step_offset<C>(ks, C::KV_BLOCK_BYTES)));
      for (int n = 0; n < C::BN; ++n)
        for (int k = 0; k < 16; ++k) {
          const int col = 16 * ks + k, blk = col / C::W;
          const uint32_t want = tma_address(k_tile + blk * C::KV_BLOCK_BYTES, n, col % C::W, C::W);
          CHECK(gmma_k_major(d, n, k) == want, "%s: K element (%d, %d)", name, n, col);
        }
    }
    for (int kk = 0; kk < C::BN / 16; ++kk) {
      const Descriptor d = decode(mn_major_descriptor<C>(v_tile + kk * 16 * C::WB));
      CHECK(d.mode == C::SWIZZLE_MODE, "%s: V swizzle mode", name);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < C::DP; ++n) {
          const int key = 16 * kk + k, blk = n / C::W;
          const uint32_t want = tma_address(v_tile + blk * C::KV_BLOCK_BYTES, key, n % C::W, C::W);
          CHECK(gmma_mn_major(d, n, k) == want, "%s: V element (key %d, col %d)", name, key, n);
        }
    }
  }
  // The tiles the math reads stay inside their stage, and stages and barriers do not overlap.
  CHECK(C::QK_K <= C::NBLK * C::W && C::DP <= C::NBLK * C::W, "%s: columns", name);
  CHECK(C::K_OFFSET == C::QST * C::Q_STAGE_BYTES && C::V_OFFSET == C::K_OFFSET + C::KVST * C::KV_STAGE_BYTES &&
            C::BAR_OFFSET == C::V_OFFSET + C::KVST * C::KV_STAGE_BYTES,
        "%s: regions", name);
}

static void check_descriptor_bits() {
  const uint64_t d = smem_descriptor(0x12340, 0x2000, 0x400, 2);
  const Descriptor x = decode(d);
  CHECK(x.start == 0x12340 && x.lbo == 0x2000 && x.sbo == 0x400 && x.mode == 2, "descriptor fields round trip");
  CHECK(((d >> 49) & 7) == 0, "base offset 0");
  CHECK((d & 0xC000ull) == 0 && (d & (0xC000ull << 16)) == 0, "reserved bits clear");
}

// ---- 2. fragments ----------------------------------------------------------------------------------

static void check_fragments() {
  // CUTLASS CLayout_64xN: thread t = (t0 in 4, t1 in 8, t2 in 4), value v = (v0 in 2, v1 in 2, v2 in N/8)
  // -> (m, n) with m + 64 n = 128 t0 + t1 + 16 t2 + 64 v0 + 8 v1 + 512 v2.
  // CUTLASS ALayout_64x16: (t0, t1, t2), (v0, v1, v2 in 2) -> m + 64 k = 128 t0 + t1 + 16 t2 + 64 v0 + 8 v1 + 512 v2.
  for (int warp = 0; warp < 4; ++warp)
    for (int lane = 0; lane < 32; ++lane) {
      const int t0 = lane % 4, t1 = lane / 4, t2 = warp;
      for (int e = 0; e < 128; ++e) {  // N = 256
        const int v0 = e % 2, v1 = (e / 2) % 2, v2 = e / 4;
        const int lin = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2;
        CHECK(acc_row(warp, lane, e) == lin % 64 && acc_col(lane, e) == lin / 64, "accumulator element %d", e);
      }
      for (int kk = 0; kk < 8; ++kk)
        for (int j = 0; j < 4; ++j)
          for (int h = 0; h < 2; ++h) {
            const int v = 2 * j + h, v0 = v % 2, v1 = (v / 2) % 2, v2 = v / 4;
            const int lin = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2;
            const int a_row = lin % 64, a_col = 16 * kk + lin / 64;  // A element this half of the register holds
            const int e = p_source(kk, j, h);                         // S element the kernel puts there
            CHECK(acc_row(warp, lane, e) == a_row && acc_col(lane, e) == a_col, "P fragment kk %d reg %d half %d", kk,
                  j, h);
          }
    }
}

// ---- 3. quad transpose -----------------------------------------------------------------------------

static void check_quad_transpose() {
  uint32_t x[4][4];
  for (int t = 0; t < 4; ++t)
    for (int k = 0; k < 4; ++k) x[t][k] = 100u * t + k;  // lane t: columns (2t, 2t+1) of chunk k
  for (int bit = 1; bit <= 2; bit <<= 1) {
    uint32_t sent[4][2];
    for (int t = 0; t < 4; ++t) quad_send(x[t], t, bit, sent[t]);
    for (int t = 0; t < 4; ++t) quad_receive(x[t], t, bit, sent[t ^ bit]);
  }
  for (int t = 0; t < 4; ++t)
    for (int s = 0; s < 4; ++s) CHECK(x[t][s] == 100u * s + t, "quad transpose lane %d slot %d", t, s);
}

// ---- 4. tensor-map geometry ------------------------------------------------------------------------

static void check_tensor_map_geometry() {
  const int batch = 3, seq = 77, slots = 24, d = 40;
  const TensorMapGeometry g = tensor_map_geometry(batch, seq, slots, d, 64, 128);
  CHECK(g.dims[0] == uint64_t(d) && g.dims[1] == uint64_t(slots) && g.dims[2] == uint64_t(seq) &&
            g.dims[3] == uint64_t(batch),
        "dims");
  CHECK(g.box[0] == 64 && g.box[1] == 1 && g.box[2] == 128 && g.box[3] == 1, "box");
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < seq; s += 7)
      for (int sl = 0; sl < slots; sl += 5)
        for (int c = 0; c < d; c += 3) {
          const uint64_t address = 2ull * c + g.strides[0] * sl + g.strides[1] * s + g.strides[2] * b;
          const uint64_t want = 2ull * (((uint64_t(b) * seq + s) * slots + sl) * d + c);
          CHECK(address == want, "tensor map address");
        }
  for (int i = 0; i < 3; ++i) CHECK(g.strides[i] % 16 == 0, "TMA strides are multiples of 16 bytes");
}

// ---- 5. pipeline protocol --------------------------------------------------------------------------

struct Barrier {
  int expected, pending = 0;
  uint32_t phase = 0;  // completed phases
  bool try_wait(uint32_t parity) const { return (phase & 1) != parity; }
  void arrive() {
    if (++pending == expected) {
      pending = 0;
      ++phase;
    }
  }
};

struct Op {
  enum Kind { WAIT, ARRIVE, LOAD, READ, RELEASE, NAMED_SYNC, NAMED_ARRIVE } kind;
  int barrier;     // WAIT / ARRIVE / LOAD: mbarrier; NAMED_*: named barrier (0 or 1)
  uint32_t parity;
  int stage;       // LOAD / READ / RELEASE: shared-memory stage (Q stages first, then K, then V)
  long tag;        // LOAD: what is loaded; READ: what the math needs
};

// Barrier indices as in the kernel: q_full[QST], q_empty[QST], k_full, k_empty, v_full, v_empty.
struct Layout {
  int qst, kvst;
  int q_full(int i) const { return i; }
  int q_empty(int i) const { return qst + i; }
  int k_full(int i) const { return 2 * qst + i; }
  int k_empty(int i) const { return 2 * qst + kvst + i; }
  int v_full(int i) const { return 2 * qst + 2 * kvst + i; }
  int v_empty(int i) const { return 2 * qst + 3 * kvst + i; }
  int q_stage(int i) const { return i; }
  int k_stage(int i) const { return qst + i; }
  int v_stage(int i) const { return qst + kvst + i; }
};

static long tag(int kind, int hb, int tile) { return (long(kind) << 40) | (long(hb) << 16) | tile; }

// The producer thread's program, in the kernel's order.
static std::vector<Op> producer_program(const Schedule& sc, int kv_tiles, int cta, const Layout& L) {
  std::vector<Op> ops;
  ItemWalker walker(sc, kv_tiles, cta);
  Item it;
  while (walker.next(it)) {
    const int qs = it.q_index % L.qst;
    ops.push_back({Op::WAIT, L.q_empty(qs), ((it.q_index / L.qst) & 1) ^ 1, 0, 0});
    ops.push_back({Op::LOAD, L.q_full(qs), 0, L.q_stage(qs), tag(0, it.hb, it.q_block)});
    if (!it.fresh_kv) continue;
    for (int j = 0; j < kv_tiles; ++j) {
      const uint32_t idx = it.kv_first + j;
      const int st = idx % L.kvst;
      const uint32_t free_parity = ((idx / L.kvst) & 1) ^ 1;
      ops.push_back({Op::WAIT, L.k_empty(st), free_parity, 0, 0});
      ops.push_back({Op::LOAD, L.k_full(st), 0, L.k_stage(st), tag(1, it.hb, j)});
      ops.push_back({Op::WAIT, L.v_empty(st), free_parity, 0, 0});
      ops.push_back({Op::LOAD, L.v_full(st), 0, L.v_stage(st), tag(2, it.hb, j)});
    }
  }
  return ops;
}

// One consumer warpgroup's program, in the kernel's order (READ: the tensor cores read a stage;
// RELEASE: the matching read has completed).
static std::vector<Op> consumer_program(const Schedule& sc, int kv_tiles, int cta, int wg, const Layout& L) {
  std::vector<Op> ops;
  ItemWalker walker(sc, kv_tiles, cta);
  Item it;
  bool wait_for_turn = wg == 1;
  while (walker.next(it)) {
    const int qs = it.q_index % L.qst;
    ops.push_back({Op::WAIT, L.q_full(qs), (it.q_index / L.qst) & 1, 0, 0});
    const long q_tag = tag(0, it.hb, it.q_block);
    {
      const int st = it.kv_first % L.kvst;
      ops.push_back({Op::WAIT, L.k_full(st), (it.kv_first / L.kvst) & 1, 0, 0});
      ops.push_back({Op::READ, 0, 0, L.q_stage(qs), q_tag});
      ops.push_back({Op::READ, 0, 0, L.k_stage(st), tag(1, it.hb, 0)});
      ops.push_back({Op::RELEASE, 0, 0, L.k_stage(st), 0});
      ops.push_back({Op::RELEASE, 0, 0, L.q_stage(qs), 0});
      if (!it.keep_kv) ops.push_back({Op::ARRIVE, L.k_empty(st), 0, 0, 0});
      if (kv_tiles == 1) ops.push_back({Op::ARRIVE, L.q_empty(qs), 0, 0, 0});
    }
    for (int j = 1; j < kv_tiles; ++j) {
      const uint32_t idx = it.kv_first + j;
      const int st = idx % L.kvst, prev_st = (idx - 1) % L.kvst;
      ops.push_back({Op::WAIT, L.k_full(st), (idx / L.kvst) & 1, 0, 0});
      if (wait_for_turn) ops.push_back({Op::NAMED_SYNC, wg, 0, 0, 0});
      wait_for_turn = true;
      ops.push_back({Op::READ, 0, 0, L.q_stage(qs), q_tag});
      ops.push_back({Op::READ, 0, 0, L.k_stage(st), tag(1, it.hb, j)});
      ops.push_back({Op::WAIT, L.v_full(prev_st), ((idx - 1) / L.kvst) & 1, 0, 0});
      ops.push_back({Op::READ, 0, 0, L.v_stage(prev_st), tag(2, it.hb, j - 1)});
      if (wg == 0 || !(it.last && j == kv_tiles - 1)) ops.push_back({Op::NAMED_ARRIVE, wg ^ 1, 0, 0, 0});
      ops.push_back({Op::RELEASE, 0, 0, L.k_stage(st), 0});
      ops.push_back({Op::RELEASE, 0, 0, L.q_stage(qs), 0});
      ops.push_back({Op::ARRIVE, L.k_empty(st), 0, 0, 0});
      if (j == kv_tiles - 1) ops.push_back({Op::ARRIVE, L.q_empty(qs), 0, 0, 0});
      ops.push_back({Op::RELEASE, 0, 0, L.v_stage(prev_st), 0});
      ops.push_back({Op::ARRIVE, L.v_empty(prev_st), 0, 0, 0});
    }
    {
      const uint32_t idx = it.kv_first + kv_tiles - 1;
      const int st = idx % L.kvst;
      ops.push_back({Op::WAIT, L.v_full(st), (idx / L.kvst) & 1, 0, 0});
      ops.push_back({Op::READ, 0, 0, L.v_stage(st), tag(2, it.hb, kv_tiles - 1)});
      ops.push_back({Op::RELEASE, 0, 0, L.v_stage(st), 0});
      if (!it.keep_kv) ops.push_back({Op::ARRIVE, L.v_empty(st), 0, 0, 0});
    }
  }
  return ops;
}

// Runs the three programs under a random interleaving; TMA completions are delayed at random.
static bool simulate(const Schedule& sc, int kv_tiles, int cta, int qst, int kvst, unsigned seed, std::string* error) {
  const Layout L{qst, kvst};
  std::vector<Barrier> bars;
  for (int i = 0; i < qst; ++i) bars.push_back({1});
  for (int i = 0; i < qst; ++i) bars.push_back({2});
  for (int i = 0; i < kvst; ++i) bars.push_back({1});
  for (int i = 0; i < kvst; ++i) bars.push_back({2});
  for (int i = 0; i < kvst; ++i) bars.push_back({1});
  for (int i = 0; i < kvst; ++i) bars.push_back({2});
  std::vector<long> content(qst + 2 * kvst, -1);
  std::vector<int> readers(qst + 2 * kvst, 0);  // consumers between READ and RELEASE of a stage
  std::vector<std::vector<Op>> prog = {producer_program(sc, kv_tiles, cta, L),
                                       consumer_program(sc, kv_tiles, cta, 0, L),
                                       consumer_program(sc, kv_tiles, cta, 1, L)};
  std::vector<size_t> pc(3, 0);
  std::vector<std::vector<int>> holding(3, std::vector<int>(qst + 2 * kvst, 0));
  struct Pending { int barrier, stage; long tag; };
  std::deque<Pending> in_flight;  // TMA loads issued, not yet complete
  int named_pending[2] = {0, 0};  // arrivals (in warpgroups) waiting on named barrier 0 / 1
  int named_waiting[2] = {0, 0};
  std::mt19937 rng(seed);
  for (long steps = 0; steps < 10000000; ++steps) {
    bool done = true;
    for (int a = 0; a < 3; ++a) done &= pc[a] == prog[a].size();
    if (done && in_flight.empty()) return true;
    std::vector<int> ready;
    for (int a = 0; a < 3; ++a) {
      if (pc[a] == prog[a].size()) continue;
      const Op& op = prog[a][pc[a]];
      if (op.kind == Op::WAIT && !bars[op.barrier].try_wait(op.parity)) continue;
      if (op.kind == Op::NAMED_SYNC && named_pending[op.barrier] == 0) continue;
      ready.push_back(a);
    }
    if (!in_flight.empty()) ready.push_back(3);  // the TMA unit completing its oldest load
    if (ready.empty()) {
      *error = "deadlock";
      return false;
    }
    const int a = ready[rng() % ready.size()];
    if (a == 3) {
      const Pending p = in_flight.front();
      in_flight.pop_front();
      content[p.stage] = p.tag;
      bars[p.barrier].arrive();  // the transaction bytes complete the phase (expect_tx arrive counted at LOAD)
      continue;
    }
    const Op& op = prog[a][pc[a]++];
    switch (op.kind) {
      case Op::WAIT: break;
      case Op::ARRIVE: bars[op.barrier].arrive(); break;
      case Op::LOAD:
        if (readers[op.stage] != 0) {
          *error = "load into a stage that a consumer is still reading";
          return false;
        }
        content[op.stage] = -2;  // being overwritten
        in_flight.push_back({op.barrier, op.stage, op.tag});
        break;
      case Op::READ:
        if (content[op.stage] != op.tag) {
          *error = "consumer read the wrong tile";
          return false;
        }
        ++readers[op.stage];
        ++holding[a][op.stage];
        break;
      case Op::RELEASE:
        --readers[op.stage];
        --holding[a][op.stage];
        break;
      case Op::NAMED_SYNC: --named_pending[op.barrier]; break;
      case Op::NAMED_ARRIVE:
        if (named_pending[op.barrier] != 0) {
          *error = "second arrive on a named barrier before its sync";
          return false;
        }
        ++named_pending[op.barrier];
        break;
    }
  }
  (void)named_waiting;
  *error = "did not finish";
  return false;
}

static void check_pipeline() {
  struct Case { int items_q_blocks, heads, batch, kv_tiles, qst, kvst, sms; };
  const Case cases[] = {
      {32, 8, 2, 32, 2, 3, 132},   // SD 1.5 512^2 self-attention, D = 40
      {32, 8, 2, 32, 2, 2, 132},   // D = 80
      {32, 8, 2, 1, 2, 2, 132},    // cross-attention, Skv = 77: resident K/V, contiguous items
      {33, 7, 3, 1, 2, 3, 132},    // runs of items crossing heads, three K/V stages
      {2, 8, 2, 2, 1, 2, 132},     // D = 160, S = 256: one Q stage
      {1, 1, 1, 1, 2, 2, 132},     // S = 1
      {33, 2, 1, 33, 2, 2, 4},     // S = 4097 on a few blocks
      {5, 3, 2, 1, 2, 2, 4},       // single tile, items spanning heads within a block
      {7, 1, 3, 3, 1, 2, 2},       // several items per block, three tiles each
      {7, 1, 3, 4, 2, 3, 2},
      {6, 2, 2, 1, 1, 3, 3},
      {3, 4, 1, 2, 2, 2, 5},
  };
  int runs = 0;
  for (const Case& c : cases) {
    Schedule sc{};
    sc.q_blocks = c.items_q_blocks;
    sc.heads = c.heads;
    sc.items = c.items_q_blocks * c.heads * c.batch;
    sc.contiguous = c.kv_tiles == 1;
    if (sc.contiguous) {
      sc.per_cta = (sc.items + c.sms - 1) / c.sms;
      sc.grid = (sc.items + sc.per_cta - 1) / sc.per_cta;
    } else {
      sc.grid = sc.items < c.sms ? sc.items : c.sms;
      sc.per_cta = (sc.items + sc.grid - 1) / sc.grid;
    }
    // Every item is owned by exactly one block.
    std::vector<int> owner(sc.items, 0);
    for (int cta = 0; cta < sc.grid; ++cta)
      for (int n = 0; sc.item(cta, n) < sc.items; ++n) ++owner[sc.item(cta, n)];
    for (int i = 0; i < sc.items; ++i) CHECK(owner[i] == 1, "item %d owned by %d blocks", i, owner[i]);
    for (int cta = 0; cta < sc.grid && cta < 6; ++cta)
      for (unsigned seed = 1; seed <= 40; ++seed) {
        std::string error;
        const bool ok = simulate(sc, c.kv_tiles, cta, c.qst, c.kvst, seed, &error);
        CHECK(ok, "pipeline (q blocks %d, heads %d, batch %d, tiles %d, QST %d, block %d, seed %u): %s",
              c.items_q_blocks, c.heads, c.batch, c.kv_tiles, c.qst, cta, seed, error.c_str());
        ++runs;
      }
  }
  std::printf("pipeline: %d simulated runs\n", runs);
}

int main() {
  check_descriptor_bits();
  check_descriptors<Config<40, 48, 128, 2, 3>>("D40");
  check_descriptors<Config<64, 64, 128, 2, 3>>("D64");
  check_descriptors<Config<80, 80, 128, 2>>("D80");
  check_descriptors<Config<160, 160, 128, 1>>("D160");
  check_descriptors<Config<32, 32, 128, 2, 3>>("D32");
  check_descriptors<Config<96, 96, 128, 2>>("D96");
  check_descriptors<Config<128, 128, 128, 2>>("D128");
  check_descriptors<Config<192, 192, 64, 2>>("D192");
  check_descriptors<Config<256, 256, 64, 1>>("D256");
  check_fragments();
  check_quad_transpose();
  check_tensor_map_geometry();
  check_pipeline();
  if (failures) {
    std::printf("%d checks failed\n", failures);
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}
