// Loads libsdplugins_trt.so the way TensorRT's IPluginRegistry::loadLibrary does (dlopen, setLoggerFinder,
// getPluginCreators) and checks the six plugins of the plugin-node contract without TensorRT's library or a
// GPU: creator names, version, namespace and field lists; plugins created from fields, serialized,
// deserialized through their creator; output dimensions through a constant-folding IExprBuilder; formats;
// the workspace; and that bad fields, bad serialized data and kernel errors fail loudly through the logger.
// Compiled against TensorRT 8.6's headers by tests/test_trt_plugin_build.py.
// Usage: trt_plugin_roundtrip <path to libsdplugins_trt.so>; exit status 0 when every check passed.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <NvInferRuntime.h>

namespace nv = nvinfer1;

namespace {

int checks = 0, failures = 0;

#define CHECK(cond, what)                                                  \
  do {                                                                     \
    ++checks;                                                              \
    if (!(cond)) {                                                         \
      ++failures;                                                          \
      std::printf("FAIL line %d: %s\n", __LINE__, std::string(what).c_str()); \
    }                                                                      \
  } while (0)

// ---- logging: what the library reports, through the logger TensorRT would hand it ---------------------

struct RecordingLogger : nv::ILogger {
  std::vector<std::string> errors;
  void log(Severity severity, nv::AsciiChar const* message) noexcept override {
    if (severity <= Severity::kERROR) errors.emplace_back(message);
  }
  bool logged(char const* phrase) const {
    for (auto const& e : errors) {
      if (e.find(phrase) != std::string::npos) return true;
    }
    return false;
  }
};

struct Finder : nv::ILoggerFinder {
  nv::ILogger* logger;
  explicit Finder(nv::ILogger* l) : logger(l) {}
  nv::ILogger* findLogger() override { return logger; }
};

RecordingLogger logger;

// ---- a constant-folding IExprBuilder (TensorRT's own needs libnvinfer) -----------------------------

class Constant final : public nv::IDimensionExpr {
 public:
  explicit Constant(int32_t value) : impl_(value) { mImpl = &impl_; }

 private:
  struct Impl final : nv::apiv::VDimensionExpr {
    explicit Impl(int32_t v) : value(v) {}
    bool isConstant() const override { return true; }
    int32_t getConstantValue() const override { return value; }
    int32_t value;
  };
  Impl impl_;
};

class FoldingBuilder final : public nv::IExprBuilder {
 public:
  FoldingBuilder() : impl_(*this) { mImpl = &impl_; }

  nv::IDimensionExpr const* make(int32_t value) {
    exprs_.push_back(std::make_unique<Constant>(value));
    return exprs_.back().get();
  }

  nv::DimsExprs dims(std::initializer_list<int32_t> values) {
    nv::DimsExprs out{};
    for (int32_t v : values) out.d[out.nbDims++] = make(v);
    return out;
  }

 private:
  struct Impl final : nv::apiv::VExprBuilder {
    explicit Impl(FoldingBuilder& b) : builder(b) {}
    nv::IDimensionExpr const* constant(int32_t value) override { return builder.make(value); }
    nv::IDimensionExpr const* operation(nv::DimensionOperation op, nv::IDimensionExpr const& a,
                                        nv::IDimensionExpr const& b) override {
      CHECK(op == nv::DimensionOperation::kFLOOR_DIV, "the plugins use only kFLOOR_DIV");
      return builder.make(a.getConstantValue() / b.getConstantValue());  // non-negative sizes
    }
    FoldingBuilder& builder;
  };
  Impl impl_;
  std::deque<std::unique_ptr<Constant>> exprs_;
};

std::vector<int32_t> values(nv::DimsExprs const& dims) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < dims.nbDims; ++i) out.push_back(dims.d[i]->isConstant() ? dims.d[i]->getConstantValue() : -1);
  return out;
}

std::string str(std::vector<int32_t> const& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// ---- fields -----------------------------------------------------------------------------------------

// A field value as the ONNX parser passes it: int attributes as one kINT32, float ones as one kFLOAT32.
struct Value {
  std::string name;
  nv::PluginFieldType type;
  int32_t i;
  float f;
};
Value i32(char const* name, int32_t v) { return {name, nv::PluginFieldType::kINT32, v, 0.f}; }
Value f32(char const* name, float v) { return {name, nv::PluginFieldType::kFLOAT32, 0, v}; }

nv::IPluginV2DynamicExt* create(nv::IPluginCreator* creator, std::vector<Value> const& given) {
  std::vector<nv::PluginField> fields;
  for (auto const& v : given) {
    void const* data = v.type == nv::PluginFieldType::kINT32 ? static_cast<void const*>(&v.i) : &v.f;
    fields.emplace_back(v.name.c_str(), data, v.type, 1);
  }
  nv::PluginFieldCollection collection{static_cast<int32_t>(fields.size()), fields.data()};
  return static_cast<nv::IPluginV2DynamicExt*>(creator->createPlugin("node", &collection));
}

// The serialized form: each field's 4 bytes, in the contract's field order.
std::vector<char> encode(std::vector<Value> const& given) {
  std::vector<char> out;
  for (auto const& v : given) {
    char bytes[4];
    if (v.type == nv::PluginFieldType::kINT32) std::memcpy(bytes, &v.i, 4);
    else std::memcpy(bytes, &v.f, 4);
    out.insert(out.end(), bytes, bytes + 4);
  }
  return out;
}

std::vector<char> serialized(nv::IPluginV2DynamicExt const* plugin) {
  std::vector<char> out(plugin->getSerializationSize());
  plugin->serialize(out.data());
  return out;
}

// Expects `call` to fail (return false) and to log an error containing `phrase`.
void expect_error(std::string const& what, char const* phrase, std::function<bool()> const& call) {
  logger.errors.clear();
  const bool succeeded = call();
  CHECK(!succeeded, what + ": should fail");
  CHECK(logger.logged(phrase), what + ": should log an error containing '" + phrase + "'");
}

nv::PluginTensorDesc desc(std::initializer_list<int32_t> dims, nv::DataType type = nv::DataType::kHALF,
                          nv::TensorFormat format = nv::TensorFormat::kLINEAR) {
  nv::PluginTensorDesc d{};
  for (int32_t v : dims) d.dims.d[d.dims.nbDims++] = v;
  d.type = type, d.format = format, d.scale = 1.f;
  return d;
}

// ---- the contract, at Stable Diffusion shapes -------------------------------------------------------

struct Case {
  char const* plugin;
  std::vector<Value> fields;  // in the contract's order
  std::vector<std::vector<int32_t>> inputs;
  std::vector<int32_t> output;
};

using Dims = std::vector<int32_t>;

const std::vector<Case> kCases = {
    {"SDPfMHA", {f32("scale", 0.158f)}, {{2, 4096, 8, 3, 40}}, {2, 4096, 8, 40}},
    {"SDPfMHCA", {f32("scale", 0.125f)}, {{2, 4096, 8, 40}, {2, 77, 8, 2, 40}}, {2, 4096, 8, 40}},
    {"SDPGroupNorm", {i32("num_groups", 32), f32("epsilon", 1e-6f), i32("silu", 1)},
     {{2, 320, 64, 64}, {320}, {320}}, {2, 320, 64, 64}},
    {"SDPLayerNorm", {f32("epsilon", 1e-6f)}, {{2, 4096, 320}, {320}, {320}}, {2, 4096, 320}},
    {"SDPSplitGeLU", {}, {{2, 4096, 2560}, {2560}}, {2, 4096, 1280}},
    {"SDPSeq2Spatial", {i32("residual_layout", 0)}, {{2, 4096, 320}, {320}, {2, 320, 64, 64}}, {2, 320, 64, 64}},
    // H and W from `spatial` (here 32 x 128, 4 channels), C from x.
    {"SDPSeq2Spatial", {i32("residual_layout", 1)}, {{2, 4096, 320}, {320}, {2, 4096, 320}, {2, 4, 32, 128}},
     {2, 320, 32, 128}},
    // SD3.5 Medium: the Q/K norm of 24 heads of 64, the AdaLN modulation of 1536 channels, the 4 x 1536 GeLU.
    {"SDPRMSNorm", {f32("epsilon", 1e-6f)}, {{2, 4429, 24, 64}, {64}}, {2, 4429, 24, 64}},
    {"SDPAdaLayerNorm", {f32("epsilon", 1e-6f)}, {{2, 4096, 1536}, {2, 1536}, {2, 1536}}, {2, 4096, 1536}},
    {"SDPGeLU", {}, {{2, 4429, 6144}, {6144}}, {2, 4429, 6144}},
};

const std::map<std::string, std::vector<std::pair<std::string, nv::PluginFieldType>>> kFieldLists = {
    {"SDPfMHA", {{"scale", nv::PluginFieldType::kFLOAT32}}},
    {"SDPfMHCA", {{"scale", nv::PluginFieldType::kFLOAT32}}},
    {"SDPGroupNorm",
     {{"num_groups", nv::PluginFieldType::kINT32}, {"epsilon", nv::PluginFieldType::kFLOAT32},
      {"silu", nv::PluginFieldType::kINT32}}},
    {"SDPLayerNorm", {{"epsilon", nv::PluginFieldType::kFLOAT32}}},
    {"SDPSplitGeLU", {}},
    {"SDPSeq2Spatial", {{"residual_layout", nv::PluginFieldType::kINT32}}},
    {"SDPRMSNorm", {{"epsilon", nv::PluginFieldType::kFLOAT32}}},
    {"SDPAdaLayerNorm", {{"epsilon", nv::PluginFieldType::kFLOAT32}}},
    {"SDPGeLU", {}},
};

std::vector<int32_t> output_of(nv::IPluginV2DynamicExt* plugin, std::vector<std::vector<int32_t>> const& inputs) {
  FoldingBuilder builder;
  std::vector<nv::DimsExprs> in;
  for (auto const& shape : inputs) {
    nv::DimsExprs d{};
    for (int32_t v : shape) d.d[d.nbDims++] = builder.make(v);
    in.push_back(d);
  }
  return values(plugin->getOutputDimensions(0, in.data(), static_cast<int32_t>(in.size()), builder));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::printf("usage: %s <libsdplugins_trt.so>\n", argv[0]);
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    std::printf("FAIL dlopen: %s\n", dlerror());
    return 1;
  }
  using GetCreators = nv::IPluginCreator* const* (*)(int32_t&);
  using SetLoggerFinder = void (*)(nv::ILoggerFinder*);
  using WorkspaceSize = size_t (*)(int, int, int, int, int);
  auto get_creators = reinterpret_cast<GetCreators>(dlsym(library, "getPluginCreators"));
  auto set_logger_finder = reinterpret_cast<SetLoggerFinder>(dlsym(library, "setLoggerFinder"));
  auto kernel_workspace = reinterpret_cast<WorkspaceSize>(dlsym(library, "sdp_group_norm_workspace_size"));
  if (!get_creators || !set_logger_finder || !kernel_workspace) {
    std::printf("FAIL: getPluginCreators, setLoggerFinder or sdp_group_norm_workspace_size not found\n");
    return 1;
  }
  Finder finder(&logger);
  set_logger_finder(&finder);

  // Creators: the nine names, version "1", namespace "sdplugins", the contract's field lists.
  int32_t count = 0;
  nv::IPluginCreator* const* list = get_creators(count);
  std::map<std::string, nv::IPluginCreator*> creators;
  for (int32_t i = 0; i < count; ++i) creators[list[i]->getPluginName()] = list[i];
  CHECK(count == 9 && creators.size() == 9, "nine creators, got " + std::to_string(count));
  for (auto const& [name, expected] : kFieldLists) {
    CHECK(creators.count(name), "creator " + name);
    if (!creators.count(name)) continue;
    nv::IPluginCreator* creator = creators[name];
    CHECK(std::string(creator->getPluginVersion()) == "1", name + " version");
    CHECK(std::string(creator->getPluginNamespace()) == "sdplugins", name + " namespace");
    nv::PluginFieldCollection const* fields = creator->getFieldNames();
    CHECK(fields && fields->nbFields == static_cast<int32_t>(expected.size()), name + " field count");
    for (int32_t k = 0; fields && k < fields->nbFields && k < static_cast<int32_t>(expected.size()); ++k) {
      CHECK(fields->fields[k].name == expected[k].first && fields->fields[k].type == expected[k].second,
            name + " field " + std::to_string(k) + " should be " + expected[k].first);
    }
  }
  if (failures) return 1;

  // Each plugin: created from fields, output dims, serialized, deserialized through its creator, cloned.
  for (Case const& c : kCases) {
    const std::string what = std::string(c.plugin) + " " + str(c.output);
    nv::IPluginCreator* creator = creators[c.plugin];
    logger.errors.clear();
    nv::IPluginV2DynamicExt* plugin = create(creator, c.fields);
    CHECK(plugin && logger.errors.empty(), what + ": created without errors");
    if (!plugin) continue;
    CHECK(std::string(plugin->getPluginType()) == c.plugin && std::string(plugin->getPluginVersion()) == "1" &&
              std::string(plugin->getPluginNamespace()) == "sdplugins" && plugin->getNbOutputs() == 1,
          what + ": type, version, namespace, one output");
    CHECK(output_of(plugin, c.inputs) == c.output, what + ": output dims " + str(output_of(plugin, c.inputs)));
    const std::vector<char> bytes = serialized(plugin);
    CHECK(bytes == encode(c.fields), what + ": serialized fields");
    auto* restored = static_cast<nv::IPluginV2DynamicExt*>(creator->deserializePlugin("node", bytes.data(), bytes.size()));
    CHECK(restored, what + ": deserialized");
    if (restored) {
      CHECK(serialized(restored) == encode(c.fields), what + ": restored fields");
      CHECK(output_of(restored, c.inputs) == c.output, what + ": restored output dims");
      CHECK(std::string(restored->getPluginNamespace()) == "sdplugins", what + ": restored namespace");
      nv::IPluginV2DynamicExt* copy = restored->clone();
      CHECK(copy && serialized(copy) == bytes && output_of(copy, c.inputs) == c.output, what + ": clone");
      if (copy) copy->destroy();
      restored->destroy();
    }

    // fp16 linear for every tensor, constants included; no fp32; kHWC8 only at GroupNorm's x (more below).
    std::vector<nv::PluginTensorDesc> io;
    for (auto const& shape : c.inputs) {
      nv::PluginTensorDesc d = desc({});
      for (int32_t v : shape) d.dims.d[d.dims.nbDims++] = v;
      io.push_back(d);
    }
    io.push_back(desc({}));
    const auto inputs = static_cast<int32_t>(c.inputs.size());
    for (int32_t pos = 0; pos <= inputs; ++pos) {
      CHECK(plugin->supportsFormatCombination(pos, io.data(), inputs, 1), what + ": fp16 linear at " + std::to_string(pos));
      nv::PluginTensorDesc saved = io[pos];
      io[pos].type = nv::DataType::kFLOAT;
      CHECK(!plugin->supportsFormatCombination(pos, io.data(), inputs, 1), what + ": no fp32 at " + std::to_string(pos));
      io[pos] = saved;
      io[pos].format = nv::TensorFormat::kHWC8;
      const bool channels_last = std::string(c.plugin) == "SDPGroupNorm" && pos == 0;
      CHECK(plugin->supportsFormatCombination(pos, io.data(), inputs, 1) == channels_last,
            what + (channels_last ? ": HWC8 at " : ": no HWC8 at ") + std::to_string(pos));
      io[pos] = saved;
    }
    CHECK(!plugin->supportsFormatCombination(0, io.data(), inputs - 1, 1), what + ": one input too few admits nothing");
    plugin->destroy();
  }

  nv::IPluginCreator* group_norm = creators["SDPGroupNorm"];
  nv::IPluginCreator* layer_norm = creators["SDPLayerNorm"];
  nv::IPluginCreator* fmha = creators["SDPfMHA"];
  nv::IPluginCreator* seq2spatial = creators["SDPSeq2Spatial"];
  nv::IPluginCreator* rms_norm = creators["SDPRMSNorm"];
  nv::IPluginCreator* ada_layer_norm = creators["SDPAdaLayerNorm"];
  nv::IPluginCreator* gelu = creators["SDPGeLU"];
  auto fails = [](nv::IPluginCreator* creator, std::vector<Value> fields) {
    return [creator, fields] {
      nv::IPluginV2DynamicExt* plugin = create(creator, fields);
      if (plugin) plugin->destroy();
      return plugin != nullptr;
    };
  };

  // Missing or ill-typed fields are errors, never defaults; so are values the kernels cannot take.
  expect_error("GroupNorm without epsilon", "missing field 'epsilon'",
               fails(group_norm, {i32("num_groups", 32), i32("silu", 0)}));
  expect_error("fMHA with an int scale", "field 'scale' must be one kFLOAT32 value",
               fails(fmha, {i32("scale", 1)}));
  expect_error("LayerNorm with a misspelt field", "unknown field 'eps'", fails(layer_norm, {f32("eps", 1e-5f)}));
  expect_error("GroupNorm with silu 2", "silu must be 0 or 1",
               fails(group_norm, {i32("num_groups", 32), f32("epsilon", 1e-5f), i32("silu", 2)}));
  expect_error("GroupNorm with 0 groups", "num_groups must be >= 1",
               fails(group_norm, {i32("num_groups", 0), f32("epsilon", 1e-5f), i32("silu", 0)}));
  expect_error("fMHA with scale 0", "scale must be a finite number > 0", fails(fmha, {f32("scale", 0.f)}));
  expect_error("fMHA with a NaN scale", "scale must be a finite number > 0",
               fails(fmha, {f32("scale", std::numeric_limits<float>::quiet_NaN())}));
  expect_error("LayerNorm with epsilon -1", "epsilon must be a finite number >= 0",
               fails(layer_norm, {f32("epsilon", -1.f)}));
  expect_error("RMSNorm with epsilon -1", "epsilon must be a finite number >= 0",
               fails(rms_norm, {f32("epsilon", -1.f)}));
  expect_error("AdaLayerNorm without epsilon", "missing field 'epsilon'", fails(ada_layer_norm, {}));
  expect_error("GeLU with a field", "unknown field 'approximate' (fields: none)", fails(gelu, {i32("approximate", 1)}));
  expect_error("Seq2Spatial with layout 2", "residual_layout must be 0 (NCHW) or 1 (sequence)",
               fails(seq2spatial, {i32("residual_layout", 2)}));
  expect_error("GroupNorm with num_groups twice", "given twice",
               fails(group_norm, {i32("num_groups", 32), f32("epsilon", 1e-5f), i32("silu", 0), i32("num_groups", 8)}));

  // Serialized data of the wrong length, or with a value the plugin cannot take, is refused.
  const std::vector<char> short_data = encode({i32("num_groups", 32), f32("epsilon", 1e-5f)});
  expect_error("GroupNorm from 8 bytes", "serialized data is 8 bytes, expected 12", [&] {
    return group_norm->deserializePlugin("node", short_data.data(), short_data.size()) != nullptr;
  });
  const std::vector<char> bad_layout = encode({i32("residual_layout", 7)});
  expect_error("Seq2Spatial from layout 7", "residual_layout must be", [&] {
    return seq2spatial->deserializePlugin("node", bad_layout.data(), bad_layout.size()) != nullptr;
  });

  // Wrong arity and impossible shapes are reported by getOutputDimensions.
  nv::IPluginV2DynamicExt* sequence = create(seq2spatial, {i32("residual_layout", 1)});
  expect_error("Seq2Spatial layout 1 with 3 inputs", "takes 4 inputs", [&] {
    return !output_of(sequence, {{2, 4096, 320}, {320}, {2, 4096, 320}}).empty();
  });
  nv::IPluginV2DynamicExt* attention = create(fmha, {f32("scale", 0.1f)});
  expect_error("fMHA with K/V count 4", "qkv must be [B, S, H, 3, D]",
               [&] { return !output_of(attention, {{2, 64, 8, 4, 40}}).empty(); });

  // GroupNorm: x in kHWC8 (NHWC where C % 8 == 0) with the output in x's format, gamma and beta linear. Each
  // position is asked with the positions before it chosen, as TensorRT does.
  nv::IPluginV2DynamicExt* norm = create(group_norm, {i32("num_groups", 32), f32("epsilon", 1e-5f), i32("silu", 1)});
  const nv::DataType half = nv::DataType::kHALF;
  const nv::TensorFormat linear = nv::TensorFormat::kLINEAR, hwc8 = nv::TensorFormat::kHWC8;
  auto admits = [](nv::IPluginV2DynamicExt* plugin, std::vector<nv::PluginTensorDesc> io, int32_t pos) {
    return plugin->supportsFormatCombination(pos, io.data(), 3, 1);
  };
  const std::vector<nv::PluginTensorDesc> nhwc = {desc({2, 320, 64, 64}, half, hwc8), desc({320}), desc({320}),
                                                  desc({2, 320, 64, 64}, half, hwc8)};
  CHECK(admits(norm, nhwc, 0) && admits(norm, nhwc, 1) && admits(norm, nhwc, 2) && admits(norm, nhwc, 3),
        "GroupNorm: HWC8 x and output, linear gamma and beta");
  auto with = [](std::vector<nv::PluginTensorDesc> io, size_t pos, nv::DataType type, nv::TensorFormat format) {
    io[pos].type = type, io[pos].format = format;
    return io;
  };
  CHECK(!admits(norm, with(nhwc, 3, half, linear), 3), "GroupNorm: no linear output after an HWC8 x");
  CHECK(!admits(norm, with(nhwc, 0, half, linear), 3), "GroupNorm: no HWC8 output after a linear x");
  CHECK(!admits(norm, with(nhwc, 3, nv::DataType::kFLOAT, hwc8), 3), "GroupNorm: no fp32 HWC8 output");
  CHECK(!admits(norm, with(nhwc, 0, nv::DataType::kFLOAT, hwc8), 0), "GroupNorm: no fp32 HWC8 x");
  CHECK(!admits(norm, with(nhwc, 1, half, hwc8), 1) && !admits(norm, with(nhwc, 2, half, hwc8), 2),
        "GroupNorm: no HWC8 gamma or beta");
  // kHWC8 is our NHWC only for 4-D x with a known C that is a multiple of 8 (else padded, or another dimension's).
  nv::IPluginV2DynamicExt* norm4 = create(group_norm, {i32("num_groups", 4), f32("epsilon", 1e-5f), i32("silu", 0)});
  auto x_only = [](nv::IPluginV2DynamicExt* plugin, nv::PluginTensorDesc const& x) {
    const std::vector<nv::PluginTensorDesc> io = {x, desc({}), desc({}), x};
    return plugin->supportsFormatCombination(0, io.data(), 3, 1);
  };
  CHECK(x_only(norm4, desc({2, 12, 8, 8})) && !x_only(norm4, desc({2, 12, 8, 8}, half, hwc8)),
        "GroupNorm: C = 12 linear only");
  CHECK(x_only(norm4, desc({2, -1, 8, 8})) && !x_only(norm4, desc({2, -1, 8, 8}, half, hwc8)),
        "GroupNorm: dynamic C linear only");
  CHECK(x_only(norm, desc({2, 320, 4096})) && !x_only(norm, desc({2, 320, 4096}, half, hwc8)),
        "GroupNorm: 3-D x linear only");
  CHECK(x_only(norm, desc({-1, 320, -1, -1}, half, hwc8)), "GroupNorm: HWC8 with dynamic B, H, W");
  // The NHWC kernel keeps at most 1024 groups' sums in shared memory.
  nv::IPluginV2DynamicExt* norm2048 =
      create(group_norm, {i32("num_groups", 2048), f32("epsilon", 1e-5f), i32("silu", 0)});
  CHECK(x_only(norm2048, desc({1, 4096, 2, 2})) && !x_only(norm2048, desc({1, 4096, 2, 2}, half, hwc8)),
        "GroupNorm: 2048 groups linear only");

  // The GroupNorm workspace is the kernel's largest over every batch up to this one, in x's layout; the others
  // need none.
  auto largest = [&](int layout) {
    size_t most = 0;
    for (int batch = 1; batch <= 2; ++batch) most = std::max(most, kernel_workspace(batch, 320, 4096, 32, layout));
    return most;
  };
  const std::vector<nv::PluginTensorDesc> nchw = with(with(nhwc, 0, half, linear), 3, half, linear);
  const size_t nchw_workspace = norm->getWorkspaceSize(nchw.data(), 3, nchw.data() + 3, 1);
  const size_t nhwc_workspace = norm->getWorkspaceSize(nhwc.data(), 3, nhwc.data() + 3, 1);
  CHECK(nchw_workspace == largest(0) && nchw_workspace > 0,
        "GroupNorm NCHW workspace " + std::to_string(nchw_workspace) + ", expected " + std::to_string(largest(0)));
  CHECK(nhwc_workspace == largest(1) && nhwc_workspace != nchw_workspace,
        "GroupNorm HWC8 workspace " + std::to_string(nhwc_workspace) + ", expected " + std::to_string(largest(1)));
  nv::PluginTensorDesc attention_io[] = {desc({2, 64, 8, 3, 40}), desc({2, 64, 8, 40})};
  CHECK(attention->getWorkspaceSize(attention_io, 1, attention_io + 1, 1) == 0, "fMHA needs no workspace");

  // enqueue: shape mismatches and kernel rejections return nonzero and log why (all before any CUDA call).
  void* fake = reinterpret_cast<void*>(256);  // never dereferenced
  void const* fake_inputs[] = {fake, fake, fake, fake};
  void* fake_outputs[] = {fake};
  nv::PluginTensorDesc bad_head[] = {desc({1, 8, 1, 3, 12}), desc({1, 8, 1, 12})};
  expect_error("fMHA enqueue with D = 12", "head_dim must be a multiple of 8", [&] {
    return attention->enqueue(bad_head, bad_head + 1, fake_inputs, fake_outputs, nullptr, nullptr) == 0;
  });
  nv::PluginTensorDesc short_gamma[] = {desc({2, 320, 8, 8}), desc({160}), desc({320}), desc({2, 320, 8, 8})};
  expect_error("GroupNorm enqueue with 160 gammas", "gamma and beta must have C = 320 elements", [&] {
    return norm->enqueue(short_gamma, short_gamma + 3, fake_inputs, fake_outputs, fake, nullptr) == 0;
  });
  nv::PluginTensorDesc odd_groups[] = {desc({2, 30, 8, 8}), desc({30}), desc({30}), desc({2, 30, 8, 8})};
  expect_error("GroupNorm enqueue with 32 groups of 30 channels", "groups (32) must divide channels (30)", [&] {
    return norm->enqueue(odd_groups, odd_groups + 3, fake_inputs, fake_outputs, fake, nullptr) == 0;
  });
  nv::PluginTensorDesc mixed[] = {desc({2, 320, 8, 8}, half, hwc8), desc({320}), desc({320}), desc({2, 320, 8, 8})};
  expect_error("GroupNorm enqueue with an HWC8 x and a linear output",
               "the output must have x's format, kHWC8, got kLINEAR",
               [&] { return norm->enqueue(mixed, mixed + 3, fake_inputs, fake_outputs, fake, nullptr) == 0; });
  // An HWC8 x reaches the kernel as NHWC: 2048 groups are refused there (NCHW would take them).
  nv::PluginTensorDesc many_groups[] = {desc({1, 4096, 2, 2}, half, hwc8), desc({4096}), desc({4096}),
                                        desc({1, 4096, 2, 2}, half, hwc8)};
  expect_error("GroupNorm enqueue of an HWC8 x with 2048 groups", "NHWC supports at most 1024 groups", [&] {
    return norm2048->enqueue(many_groups, many_groups + 3, fake_inputs, fake_outputs, fake, nullptr) == 0;
  });
  nv::PluginTensorDesc nchw_residual[] = {desc({2, 64, 32}), desc({32}), desc({2, 32, 8, 8}), desc({2, 4, 8, 8}),
                                          desc({2, 32, 8, 8})};
  expect_error("Seq2Spatial layout 1 enqueue with an NCHW residual", "residual must be [2, 64, 32]", [&] {
    return sequence->enqueue(nchw_residual, nchw_residual + 4, fake_inputs, fake_outputs, nullptr, nullptr) == 0;
  });
  // The transformer plugins: their constants must match x's last dimension, AdaLayerNorm's modulation its batch.
  nv::IPluginV2DynamicExt* rms = create(rms_norm, {f32("epsilon", 1e-6f)});
  nv::PluginTensorDesc short_weight[] = {desc({2, 77, 24, 64}), desc({128}), desc({2, 77, 24, 64})};
  expect_error("RMSNorm enqueue with 128 weights for D = 64", "weight must have N = 64 elements, got [128]", [&] {
    return rms->enqueue(short_weight, short_weight + 2, fake_inputs, fake_outputs, nullptr, nullptr) == 0;
  });
  nv::IPluginV2DynamicExt* ada = create(ada_layer_norm, {f32("epsilon", 1e-6f)});
  nv::PluginTensorDesc other_batch[] = {desc({2, 77, 64}), desc({1, 64}), desc({1, 64}), desc({2, 77, 64})};
  expect_error("AdaLayerNorm enqueue with one modulation row for a batch of 2", "scale, shift [B, C], got", [&] {
    return ada->enqueue(other_batch, other_batch + 3, fake_inputs, fake_outputs, nullptr, nullptr) == 0;
  });
  expect_error("AdaLayerNorm with a 2-D x", "x must be [B, S, C] and scale, shift [B, C]",
               [&] { return !output_of(ada, {{77, 64}, {2, 64}, {2, 64}}).empty(); });
  nv::IPluginV2DynamicExt* activation = create(gelu, {});
  nv::PluginTensorDesc short_bias[] = {desc({2, 77, 6144}), desc({1536}), desc({2, 77, 6144})};
  expect_error("GeLU enqueue with 1536 biases for N = 6144", "bias must have N = 6144 elements, got [1536]", [&] {
    return activation->enqueue(short_bias, short_bias + 2, fake_inputs, fake_outputs, nullptr, nullptr) == 0;
  });
  expect_error("GeLU without its bias", "takes 2 inputs", [&] { return !output_of(activation, {{2, 77, 6144}}).empty(); });
  for (nv::IPluginV2DynamicExt* p : {sequence, attention, norm, norm4, norm2048, rms, ada, activation}) p->destroy();

  std::printf("checks: %d, failures: %d\n", checks, failures);
  return failures ? 1 : 0;
}
