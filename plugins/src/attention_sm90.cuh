// Host interface of the Hopper (sm_90a) attention kernels, for the dispatcher in attention.cu. The
// kernels are compiled only when CMake builds them (option SDPLUGINS_SM90A, which defines
// SDP_HAVE_SM90A for the library); otherwise available() is false and the dispatcher never asks.
#pragma once

#include <cuda_runtime.h>

namespace sdp {
namespace sm90 {

// Q of head h is slot h * q_slot_mul of q [B, Sq, q_slots, D]; K and V of head h are slots
// h * kv_slot_mul + k_slot and + v_slot of kv [B, Skv, kv_slots, D]; out is [B, Sq, H, D].
// Self-attention: q = kv = qkv with 3H slots (Q 3h, K 3h + 1, V 3h + 2). Cross-attention: q with H
// slots, kv with 2H (K 2h, V 2h + 1).
struct Problem {
  const void* q;
  int q_slots, q_slot_mul;
  const void* kv;
  int kv_slots, kv_slot_mul, k_slot, v_slot;
  void* out;
  int batch, seq_q, seq_kv, heads, head_dim;
  float scale_log2;
};

#ifdef SDP_HAVE_SM90A
constexpr bool available() { return true; }
// Launches on `stream` (compute capability 9.0 only). SDP_OK, or an error code with the message
// recorded. *not_launched is set when it failed before any launch (the driver could not encode a
// tensor map), where the caller may fall back to another kernel.
int run(const Problem& problem, cudaStream_t stream, bool* not_launched);
#else
constexpr bool available() { return false; }
inline int run(const Problem&, cudaStream_t, bool* not_launched) {
  *not_launched = true;
  return 2;  // SDP_CUDA_ERROR; never reached: the dispatcher checks available() first
}
#endif

}  // namespace sm90
}  // namespace sdp
