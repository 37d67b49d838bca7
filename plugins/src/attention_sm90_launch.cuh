// Host side of one Hopper attention instantiation: tensor maps, schedule, launch. Included by the
// attention_sm90*.cu files, each of which instantiates a few head sizes (they compile in parallel).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <string>

#include "attention_sm90.cuh"
#include "attention_sm90_kernel.cuh"
#include "common.cuh"

namespace sdp {
namespace sm90 {

// cuTensorMapEncodeTiled from the driver, looked up once through the runtime (no -lcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// Encodes the map of a [batch, seq, slots, d] fp16 tensor with a (w, 1, rows, 1) box. Host-only
// and allocation-free (safe during stream capture).
inline CUresult encode_tensor_map(CUtensorMap* map, const void* base, int batch, int seq, int slots, int d, int w,
                                  int rows) {
  const TensorMapGeometry g = tensor_map_geometry(batch, seq, slots, d, w, rows);
  const cuuint64_t dims[4] = {g.dims[0], g.dims[1], g.dims[2], g.dims[3]};
  const cuuint64_t strides[3] = {g.strides[0], g.strides[1], g.strides[2]};
  const cuuint32_t box[4] = {g.box[0], g.box[1], g.box[2], g.box[3]};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return tensor_map_encoder()(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, const_cast<void*>(base), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              w == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
                              : w == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                        : CU_TENSOR_MAP_SWIZZLE_32B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

template <class C>
int launch(const Problem& pr, cudaStream_t stream, bool* not_launched) {
  *not_launched = true;
  if (!tensor_map_encoder())
    return fail(SDP_CUDA_ERROR, "sm90 attention: the driver has no cuTensorMapEncodeTiled (CUDA 12 driver needed)");
  static const cudaError_t attr =
      cudaFuncSetAttribute(attention_sm90_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
  if (attr != cudaSuccess) return fail(SDP_CUDA_ERROR, std::string("sm90 attention smem: ") + cudaGetErrorString(attr));

  KernelParams kp{};
  CUresult r = encode_tensor_map(&kp.q_map, pr.q, pr.batch, pr.seq_q, pr.q_slots, pr.head_dim, C::W, C::BM);
  if (r == CUDA_SUCCESS)
    r = encode_tensor_map(&kp.kv_map, pr.kv, pr.batch, pr.seq_kv, pr.kv_slots, pr.head_dim, C::W, C::BN);
  if (r != CUDA_SUCCESS)
    return fail(SDP_CUDA_ERROR, "sm90 attention: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) + ")");

  const int64_t q_blocks = (pr.seq_q + C::BM - 1) / C::BM;
  const int64_t items = q_blocks * pr.heads * pr.batch;
  if (items > INT32_MAX) return fail(SDP_INVALID_ARGUMENT, "sm90 attention: too many query blocks");
  kp.o = static_cast<half*>(pr.out);
  kp.o_row = int64_t(pr.heads) * pr.head_dim;
  kp.o_batch = kp.o_row * pr.seq_q;
  kp.o_head = pr.head_dim;
  kp.seq_q = pr.seq_q;
  kp.seq_kv = pr.seq_kv;
  kp.d = pr.head_dim;
  kp.q_slot_mul = pr.q_slot_mul;
  kp.kv_slot_mul = pr.kv_slot_mul;
  kp.k_slot = pr.k_slot;
  kp.v_slot = pr.v_slot;
  kp.kv_tiles = (pr.seq_kv + C::BN - 1) / C::BN;
  kp.scale_log2 = pr.scale_log2;

  // One resident block per multiprocessor. A single K/V tile (short keys, e.g. 77 text tokens):
  // each block takes a run of consecutive items, which mostly share a head and so keep K/V loaded.
  // Longer keys: items dealt round-robin, so the blocks running at once share heads and read each
  // K/V tile from L2.
  const int sms = multiprocessors();
  Schedule& sc = kp.schedule;
  sc.items = int(items);
  sc.q_blocks = int(q_blocks);
  sc.heads = pr.heads;
  sc.contiguous = kp.kv_tiles == 1;
  if (sc.contiguous) {
    sc.per_cta = int((items + sms - 1) / sms);
    sc.grid = int((items + sc.per_cta - 1) / sc.per_cta);
  } else {
    sc.grid = int(std::min<int64_t>(items, sms));
    sc.per_cta = int((items + sc.grid - 1) / sc.grid);
  }
  *not_launched = false;
  attention_sm90_kernel<C><<<sc.grid, C::THREADS, C::SMEM_BYTES, stream>>>(kp);
  return check_launch("sm90 attention kernel");
}

// Instantiations, by head size: SD's in attention_sm90.cu, the rest in attention_sm90_generic.cu
// (two files, so a parallel build compiles them side by side).
int run_generic(const Problem& problem, cudaStream_t stream, bool* not_launched);

}  // namespace sm90
}  // namespace sdp
