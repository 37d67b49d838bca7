/* C ABI of the sdplugins CUDA kernels.
 *
 * All tensors are fp16 device pointers, contiguous in the layouts named below, 16-byte aligned;
 * arithmetic accumulates in fp32. Every call returns SDP_OK or an error code; sdp_last_error()
 * then names the problem (per thread). No call silently does nothing: arguments a kernel cannot
 * handle are rejected with a message. Kernels run on the given stream.
 */
#ifndef SDPLUGINS_H
#define SDPLUGINS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* sdp_stream_t; /* cudaStream_t */

enum { SDP_OK = 0, SDP_INVALID_ARGUMENT = 1, SDP_CUDA_ERROR = 2 };
enum { SDP_LAYOUT_NCHW = 0, SDP_LAYOUT_NHWC = 1 };

const char* sdp_last_error(void);
int sdp_version(void);

/* Self-attention. qkv [B, S, H, 3, D] -> out [B, S, H, D]; out = softmax(scale * Q K^T) V.
 * D a multiple of 8 in [8, 256]; fast paths for D = 40, 64, 80, 160.
 *
 * Attention kernels (sdp_fmha and sdp_fmhca): on compute capability 9.0 (H100, H200) warp-specialized
 * wgmma + TMA kernels built for sm_90a; on 7.5-8.9, or where the library was built without them
 * (CMake -DSDPLUGINS_SM90A=OFF), mma.sync kernels. The environment variable SDPLUGINS_ATTENTION, read
 * at every call, picks: "auto" (or unset, the default) as above; "mma" the mma.sync kernels on any GPU;
 * "wgmma" the Hopper kernels, SDP_INVALID_ARGUMENT where they cannot run. Any other value is
 * SDP_INVALID_ARGUMENT. Both paths are graph-capture safe (no allocation, no synchronization). */
int sdp_fmha(const void* qkv, void* out, int batch, int seq, int heads, int head_dim, float scale,
             sdp_stream_t stream);

/* Cross-attention. q [B, Sq, H, D], kv [B, Skv, H, 2, D] -> out [B, Sq, H, D]; any Skv >= 1. */
int sdp_fmhca(const void* q, const void* kv, void* out, int batch, int seq_q, int seq_kv, int heads,
              int head_dim, float scale, sdp_stream_t stream);

/* GroupNorm over x [B, C, HW] (NCHW) or [B, HW, C] (NHWC); groups must divide C.
 * gamma, beta [C]; y = (x - mean) / sqrt(var + eps) * gamma + beta, then SiLU if silu != 0.
 * Needs a device workspace of sdp_group_norm_workspace_size() bytes. */
size_t sdp_group_norm_workspace_size(int batch, int channels, int hw, int groups, int layout);
int sdp_group_norm(const void* x, const void* gamma, const void* beta, void* y, void* workspace,
                   size_t workspace_bytes, int batch, int channels, int hw, int groups, float eps,
                   int layout, int silu, sdp_stream_t stream);

/* LayerNorm over the last dimension: x [rows, N] -> y [rows, N]; gamma, beta [N]. */
int sdp_layer_norm(const void* x, const void* gamma, const void* beta, void* y, int64_t rows, int n,
                   float eps, sdp_stream_t stream);

/* SplitGeLU: x [rows, 2N] (+ bias [2N] if bias != NULL) -> y [rows, N] = x[:, :N] * gelu_erf(x[:, N:]). */
int sdp_split_gelu(const void* x, const void* bias, void* y, int64_t rows, int n, sdp_stream_t stream);

/* Seq2Spatial: y [B, C, HW] (NCHW) = transpose(x [B, HW, C] + bias [C]) + residual, the residual in
 * residual_layout: SDP_LAYOUT_NCHW, [B, C, HW] (added after the transpose), or SDP_LAYOUT_NHWC,
 * [B, HW, C] like x (the sequence layout, added before the transpose). */
int sdp_seq2spatial(const void* x, const void* bias, const void* residual, void* y, int batch, int hw,
                    int channels, int residual_layout, sdp_stream_t stream);

/* RMSNorm over the last dimension (the SD3/Flux Q/K norms): x [rows, N] -> y [rows, N] =
 * x * rsqrt(mean(x^2) + eps) * weight; weight [N]. Any N >= 1; fastest for N a multiple of 8 up to 4096. */
int sdp_rms_norm(const void* x, const void* weight, void* y, int64_t rows, int n, float eps, sdp_stream_t stream);

/* The modulated LayerNorm of AdaLN blocks: x [B, S, C] -> y [B, S, C] =
 * (x - mean) / sqrt(var + eps) * (1 + scale[b]) + shift[b], over C; scale, shift [B, C]. */
int sdp_ada_layer_norm(const void* x, const void* scale, const void* shift, void* y, int batch, int64_t seq,
                       int channels, float eps, sdp_stream_t stream);

/* GeLU, tanh approximation: x [rows, N] (+ bias [N] if bias != NULL) -> y [rows, N] = gelu_tanh(x + bias). */
int sdp_gelu_tanh(const void* x, const void* bias, void* y, int64_t rows, int n, sdp_stream_t stream);

#ifdef __cplusplus
}
#endif
#endif
