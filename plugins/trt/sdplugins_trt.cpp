// The TensorRT plugin library: the nine plugins of the plugin-node contract (README, "TensorRT plugin
// library"), each a Spec for the adapter in plugin_adapter.h, and TensorRT's plugin-library entry points
// getPluginCreators and setLoggerFinder (IPluginRegistry::loadLibrary calls them).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>

#include "plugin_adapter.h"
#include "sdplugins.h"

namespace sdp_trt {
namespace {

static_assert(SDP_LAYOUT_NCHW == 0 && SDP_LAYOUT_NHWC == 1, "SDPSeq2Spatial's residual_layout is the ABI's layout");

std::string number(float value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
  return text;
}

std::string check_scale(float scale) {
  return std::isfinite(scale) && scale > 0.f ? "" : "scale must be a finite number > 0, got " + number(scale);
}

std::string check_epsilon(float epsilon) {
  return std::isfinite(epsilon) && epsilon >= 0.f ? "" : "epsilon must be a finite number >= 0, got " + number(epsilon);
}

int as_int(int64_t dim) { return static_cast<int>(dim); }  // the adapter has checked every volume fits

// ---- attention --------------------------------------------------------------------------------------

struct Fmha : NoWorkspace {
  static constexpr char kName[] = "SDPfMHA";
  struct Fields {
    float scale;
  };
  static constexpr std::array<Field<Fields>, 1> kFields{{float_field("scale", &Fields::scale)}};
  static int arity(Fields const&) { return 1; }
  static std::string check(Fields const& f) { return check_scale(f.scale); }

  // qkv [B, S, H, 3, D] -> [B, S, H, D]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    nv::DimsExprs const& qkv = in[0];
    if (qkv.nbDims != 5 || known_and_not(qkv.d[3], 3)) return "qkv must be [B, S, H, 3, D]";
    out.nbDims = 4;
    out.d[0] = qkv.d[0], out.d[1] = qkv.d[1], out.d[2] = qkv.d[2], out.d[3] = qkv.d[4];
    return {};
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const& qkv = in[0].dims;
    if (qkv.nbDims != 5 || qkv.d[3] != 3) return "qkv must be [B, S, H, 3, D], got " + shape_string(qkv);
    return kernel_status(sdp_fmha(inputs[0], out, as_int(qkv.d[0]), as_int(qkv.d[1]), as_int(qkv.d[2]),
                                  as_int(qkv.d[4]), f.scale, stream));
  }
};

struct Fmhca : NoWorkspace {
  static constexpr char kName[] = "SDPfMHCA";
  struct Fields {
    float scale;
  };
  static constexpr std::array<Field<Fields>, 1> kFields{{float_field("scale", &Fields::scale)}};
  static int arity(Fields const&) { return 2; }
  static std::string check(Fields const& f) { return check_scale(f.scale); }

  // q [B, Sq, H, D], kv [B, Skv, H, 2, D] -> [B, Sq, H, D]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    if (in[0].nbDims != 4 || in[1].nbDims != 5 || known_and_not(in[1].d[3], 2)) {
      return "q must be [B, Sq, H, D] and kv [B, Skv, H, 2, D]";
    }
    out = in[0];
    return {};
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const &q = in[0].dims, &kv = in[1].dims;
    if (q.nbDims != 4 || kv.nbDims != 5 || kv.d[0] != q.d[0] || kv.d[2] != q.d[2] || kv.d[3] != 2 ||
        kv.d[4] != q.d[3]) {
      return "q must be [B, Sq, H, D] and kv [B, Skv, H, 2, D], got " + shape_string(q) + " and " + shape_string(kv);
    }
    return kernel_status(sdp_fmhca(inputs[0], inputs[1], out, as_int(q.d[0]), as_int(q.d[1]), as_int(kv.d[1]),
                                   as_int(q.d[2]), as_int(q.d[3]), f.scale, stream));
  }
};

// ---- normalization ----------------------------------------------------------------------------------

struct GroupNorm {
  static constexpr char kName[] = "SDPGroupNorm";
  struct Fields {
    int32_t num_groups;
    float epsilon;
    int32_t silu;
  };
  static constexpr std::array<Field<Fields>, 3> kFields{{int_field("num_groups", &Fields::num_groups),
                                                         float_field("epsilon", &Fields::epsilon),
                                                         int_field("silu", &Fields::silu)}};
  static int arity(Fields const&) { return 3; }
  static std::string check(Fields const& f) {
    if (f.num_groups < 1) return "num_groups must be >= 1, got " + std::to_string(f.num_groups);
    if (f.silu != 0 && f.silu != 1) return "silu must be 0 or 1, got " + std::to_string(f.silu);
    return check_epsilon(f.epsilon);
  }

  // x [B, C, H, W], gamma [C], beta [C] -> [B, C, H, W]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    if (in[0].nbDims < 3) return "x must be [B, C, H, W]";
    out = in[0];
    return {};
  }

  // x in fp16 linear NCHW, or in kHWC8, the channels-last format TensorRT keeps next to fp16 convolutions (taking
  // it spares a reformat on each side; TensorRT picks by timing). kHWC8 moves the third-to-last dimension last,
  // padded to 8: our NHWC only for 4-D x with C a known multiple of 8, and a group count the NHWC kernel takes
  // (else its workspace size is 0). gamma and beta stay linear; y takes x's format, read from in_out[0].
  static bool supports_format(Fields const& f, int32_t pos, nv::PluginTensorDesc const* in_out, int32_t inputs) {
    nv::PluginTensorDesc const& desc = in_out[pos];
    if (pos == inputs) return desc.type == nv::DataType::kHALF && desc.format == in_out[0].format;
    if (pos == 0 && desc.type == nv::DataType::kHALF && desc.format == nv::TensorFormat::kHWC8) {
      const int64_t channels = desc.dims.nbDims == 4 ? desc.dims.d[1] : -1;
      return channels > 0 && channels % 8 == 0 &&
             sdp_group_norm_workspace_size(1, static_cast<int>(channels), 1, f.num_groups, SDP_LAYOUT_NHWC) > 0;
    }
    return fp16_linear(desc);
  }

  static int layout(nv::PluginTensorDesc const& x) {
    return x.format == nv::TensorFormat::kHWC8 ? SDP_LAYOUT_NHWC : SDP_LAYOUT_NCHW;
  }

  struct Shape {
    int batch, channels, hw;
  };
  static Shape shape(nv::Dims const& x) {
    const int64_t batch = x.d[0], channels = x.d[1];
    return {as_int(batch), as_int(channels), as_int(batch * channels > 0 ? volume(x) / (batch * channels) : 0)};
  }

  // TensorRT asks for enough for these (maximum) dimensions or any smaller problem. The kernel's chunking
  // gives fewer (batch, group) pairs more chunks each, so its size is not monotonic in the batch: take the
  // largest over every batch up to this one (it grows with H x W at a fixed batch), in x's layout.
  static size_t workspace(Fields const& f, nv::PluginTensorDesc const* in) {
    if (in[0].dims.nbDims < 3) return 0;
    const Shape s = shape(in[0].dims);
    size_t most = 0;
    for (int batch = 1; batch <= s.batch; ++batch) {
      most = std::max(most, sdp_group_norm_workspace_size(batch, s.channels, s.hw, f.num_groups, layout(in[0])));
    }
    return most;
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const& output, void* out, void* workspace, cudaStream_t stream) {
    nv::Dims const& x = in[0].dims;
    if (x.nbDims < 3) return "x must be [B, C, H, W], got " + shape_string(x);
    // The kernel writes y in x's layout (supports_format admits nothing else).
    if (output.format != in[0].format) {
      return "the output must have x's format, " + format_name(in[0].format) + ", got " + format_name(output.format);
    }
    const Shape s = shape(x);
    if (volume(in[1].dims) != s.channels || volume(in[2].dims) != s.channels) {
      return "gamma and beta must have C = " + std::to_string(s.channels) + " elements, got " +
             shape_string(in[1].dims) + " and " + shape_string(in[2].dims);
    }
    const int xy_layout = layout(in[0]);
    const size_t bytes = sdp_group_norm_workspace_size(s.batch, s.channels, s.hw, f.num_groups, xy_layout);
    return kernel_status(sdp_group_norm(inputs[0], inputs[1], inputs[2], out, workspace, bytes, s.batch, s.channels,
                                        s.hw, f.num_groups, f.epsilon, xy_layout, f.silu, stream));
  }
};

struct LayerNorm : NoWorkspace {
  static constexpr char kName[] = "SDPLayerNorm";
  struct Fields {
    float epsilon;
  };
  static constexpr std::array<Field<Fields>, 1> kFields{{float_field("epsilon", &Fields::epsilon)}};
  static int arity(Fields const&) { return 3; }
  static std::string check(Fields const& f) { return check_epsilon(f.epsilon); }

  // x [..., N], gamma [N], beta [N] -> [..., N]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    if (in[0].nbDims < 1) return "x must have at least one dimension";
    out = in[0];
    return {};
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const& x = in[0].dims;
    const int64_t n = x.nbDims ? x.d[x.nbDims - 1] : 0;
    if (n < 1) return "x must be [..., N] with N >= 1, got " + shape_string(x);
    if (volume(in[1].dims) != n || volume(in[2].dims) != n) {
      return "gamma and beta must have N = " + std::to_string(n) + " elements, got " + shape_string(in[1].dims) +
             " and " + shape_string(in[2].dims);
    }
    return kernel_status(
        sdp_layer_norm(inputs[0], inputs[1], inputs[2], out, volume(x) / n, as_int(n), f.epsilon, stream));
  }
};

// ---- feed-forward and transformer end ---------------------------------------------------------------

struct SplitGeLU : NoWorkspace {
  static constexpr char kName[] = "SDPSplitGeLU";
  struct Fields {};
  static constexpr std::array<Field<Fields>, 0> kFields{};
  static int arity(Fields const&) { return 2; }
  static std::string check(Fields const&) { return {}; }

  // x [..., 2N], bias [2N] -> [..., N]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder& builder,
                                 nv::DimsExprs& out) {
    nv::DimsExprs const& x = in[0];
    if (x.nbDims < 1) return "x must be [..., 2N]";
    nv::IDimensionExpr const* last = x.d[x.nbDims - 1];
    if (last->isConstant() && last->getConstantValue() % 2 != 0) return "the last dimension of x must be even";
    out = x;
    out.d[x.nbDims - 1] = builder.operation(nv::DimensionOperation::kFLOOR_DIV, *last, *builder.constant(2));
    return {};
  }

  static std::string enqueue(Fields const&, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const& x = in[0].dims;
    const int64_t width = x.nbDims ? x.d[x.nbDims - 1] : 0;
    if (width < 2 || width % 2 != 0) return "x must be [..., 2N] with N >= 1, got " + shape_string(x);
    if (volume(in[1].dims) != width) {
      return "bias must have 2N = " + std::to_string(width) + " elements, got " + shape_string(in[1].dims);
    }
    return kernel_status(sdp_split_gelu(inputs[0], inputs[1], out, volume(x) / width, as_int(width / 2), stream));
  }
};

struct Seq2Spatial : NoWorkspace {
  static constexpr char kName[] = "SDPSeq2Spatial";
  struct Fields {
    int32_t residual_layout;  // SDP_LAYOUT_NCHW: residual [B, C, H, W]; SDP_LAYOUT_NHWC: [B, HW, C]
  };
  static constexpr std::array<Field<Fields>, 1> kFields{{int_field("residual_layout", &Fields::residual_layout)}};
  // x, bias, residual; and with a sequence-layout residual, `spatial` for the output's H and W.
  static int arity(Fields const& f) { return f.residual_layout == SDP_LAYOUT_NHWC ? 4 : 3; }
  static std::string check(Fields const& f) {
    if (f.residual_layout == SDP_LAYOUT_NCHW || f.residual_layout == SDP_LAYOUT_NHWC) return {};
    return "residual_layout must be 0 (NCHW) or 1 (sequence), got " + std::to_string(f.residual_layout);
  }

  // x [B, HW, C] -> [B, C, H, W]: the residual's shape (NCHW), or H and W from `spatial` [B, C', H, W].
  static std::string output_dims(Fields const& f, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    nv::DimsExprs const& x = in[0];
    if (x.nbDims != 3) return "x must be [B, HW, C]";
    if (f.residual_layout == SDP_LAYOUT_NCHW) {
      if (in[2].nbDims != 4) return "residual must be [B, C, H, W]";
      out = in[2];
      return {};
    }
    nv::DimsExprs const& spatial = in[3];
    if (spatial.nbDims != 4) return "spatial must be [B, C', H, W]";
    out.nbDims = 4;
    out.d[0] = x.d[0], out.d[1] = x.d[2], out.d[2] = spatial.d[2], out.d[3] = spatial.d[3];
    return {};
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const& output, void* out, void*, cudaStream_t stream) {
    nv::Dims const &x = in[0].dims, &y = output.dims, &residual = in[2].dims;
    if (x.nbDims != 3 || y.nbDims != 4 || y.d[0] != x.d[0] || y.d[1] != x.d[2] || y.d[2] * y.d[3] != x.d[1]) {
      return "x must be [B, HW, C] and the output [B, C, H, W], got " + shape_string(x) + " and " + shape_string(y);
    }
    if (volume(in[1].dims) != x.d[2]) {
      return "bias must have C = " + std::to_string(x.d[2]) + " elements, got " + shape_string(in[1].dims);
    }
    nv::Dims const& expected = f.residual_layout == SDP_LAYOUT_NCHW ? y : x;
    if (!same_dims(residual, expected)) {
      return "residual must be " + shape_string(expected) + ", got " + shape_string(residual);
    }
    return kernel_status(sdp_seq2spatial(inputs[0], inputs[1], inputs[2], out, as_int(x.d[0]), as_int(x.d[1]),
                                         as_int(x.d[2]), f.residual_layout, stream));
  }
};

// ---- the SD3/Flux transformers' norms and activation -----------------------------------------------------

// "" or why `given` (a [N] constant beside x [..., N]) does not have N elements.
std::string check_vector(char const* name, nv::Dims const& given, int64_t n) {
  if (volume(given) == n) return {};
  return std::string(name) + " must have N = " + std::to_string(n) + " elements, got " + shape_string(given);
}

struct RMSNorm : NoWorkspace {
  static constexpr char kName[] = "SDPRMSNorm";
  struct Fields {
    float epsilon;
  };
  static constexpr std::array<Field<Fields>, 1> kFields{{float_field("epsilon", &Fields::epsilon)}};
  static int arity(Fields const&) { return 2; }
  static std::string check(Fields const& f) { return check_epsilon(f.epsilon); }

  // x [..., N], weight [N] -> [..., N]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    if (in[0].nbDims < 1) return "x must have at least one dimension";
    out = in[0];
    return {};
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const& x = in[0].dims;
    const int64_t n = x.nbDims ? x.d[x.nbDims - 1] : 0;
    if (n < 1) return "x must be [..., N] with N >= 1, got " + shape_string(x);
    std::string error = check_vector("weight", in[1].dims, n);
    if (!error.empty()) return error;
    return kernel_status(sdp_rms_norm(inputs[0], inputs[1], out, volume(x) / n, as_int(n), f.epsilon, stream));
  }
};

struct AdaLayerNorm : NoWorkspace {
  static constexpr char kName[] = "SDPAdaLayerNorm";
  struct Fields {
    float epsilon;
  };
  static constexpr std::array<Field<Fields>, 1> kFields{{float_field("epsilon", &Fields::epsilon)}};
  static int arity(Fields const&) { return 3; }
  static std::string check(Fields const& f) { return check_epsilon(f.epsilon); }

  // x [B, S, C], scale [B, C], shift [B, C] -> [B, S, C]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    if (in[0].nbDims != 3 || in[1].nbDims != 2 || in[2].nbDims != 2) {
      return "x must be [B, S, C] and scale, shift [B, C]";
    }
    out = in[0];
    return {};
  }

  static std::string enqueue(Fields const& f, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const &x = in[0].dims, &scale = in[1].dims, &shift = in[2].dims;
    const bool shapes = x.nbDims == 3 && scale.nbDims == 2 && scale.d[0] == x.d[0] && scale.d[1] == x.d[2] &&
                        same_dims(scale, shift);
    if (!shapes) {
      return "x must be [B, S, C] and scale, shift [B, C], got " + shape_string(x) + ", " + shape_string(scale) +
             " and " + shape_string(shift);
    }
    return kernel_status(sdp_ada_layer_norm(inputs[0], inputs[1], inputs[2], out, as_int(x.d[0]), x.d[1],
                                            as_int(x.d[2]), f.epsilon, stream));
  }
};

struct GeLU : NoWorkspace {
  static constexpr char kName[] = "SDPGeLU";
  struct Fields {};
  static constexpr std::array<Field<Fields>, 0> kFields{};
  static int arity(Fields const&) { return 2; }
  static std::string check(Fields const&) { return {}; }

  // x [..., N], bias [N] -> [..., N]
  static std::string output_dims(Fields const&, nv::DimsExprs const* in, nv::IExprBuilder&, nv::DimsExprs& out) {
    if (in[0].nbDims < 1) return "x must have at least one dimension";
    out = in[0];
    return {};
  }

  static std::string enqueue(Fields const&, nv::PluginTensorDesc const* in, void const* const* inputs,
                             nv::PluginTensorDesc const&, void* out, void*, cudaStream_t stream) {
    nv::Dims const& x = in[0].dims;
    const int64_t n = x.nbDims ? x.d[x.nbDims - 1] : 0;
    if (n < 1) return "x must be [..., N] with N >= 1, got " + shape_string(x);
    std::string error = check_vector("bias", in[1].dims, n);
    if (!error.empty()) return error;
    return kernel_status(sdp_gelu_tanh(inputs[0], inputs[1], out, volume(x) / n, as_int(n), stream));
  }
};

std::atomic<nv::ILoggerFinder*> logger_finder{nullptr};

}  // namespace

void set_logger_finder(nv::ILoggerFinder* finder) noexcept { logger_finder.store(finder); }

void log_error(std::string const& message) noexcept {
  nv::ILoggerFinder* finder = logger_finder.load();
  nv::ILogger* logger = finder ? finder->findLogger() : nullptr;
  if (logger) logger->log(nv::ILogger::Severity::kERROR, message.c_str());
  else std::fprintf(stderr, "[sdplugins_trt] ERROR: %s\n", message.c_str());
}

}  // namespace sdp_trt

#define SDP_TRT_EXPORT extern "C" __attribute__((visibility("default")))

SDP_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { sdp_trt::set_logger_finder(finder); }

SDP_TRT_EXPORT nvinfer1::IPluginCreator* const* getPluginCreators(int32_t& count) {
  using namespace sdp_trt;
  static Creator<Fmha> fmha;
  static Creator<Fmhca> fmhca;
  static Creator<GroupNorm> group_norm;
  static Creator<LayerNorm> layer_norm;
  static Creator<SplitGeLU> split_gelu;
  static Creator<Seq2Spatial> seq2spatial;
  static Creator<RMSNorm> rms_norm;
  static Creator<AdaLayerNorm> ada_layer_norm;
  static Creator<GeLU> gelu;
  static nvinfer1::IPluginCreator* const creators[] = {&fmha, &fmhca, &group_norm, &layer_norm, &split_gelu,
                                                       &seq2spatial, &rms_norm, &ada_layer_norm, &gelu};
  count = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}
