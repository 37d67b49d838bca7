// One adapter between TensorRT's plugin interfaces (IPluginV2DynamicExt, IPluginCreator) and our kernels.
//
// A plugin is described by a Spec (see sdplugins_trt.cpp), which states only
//   kName                    the plugin name (the ONNX op_type),
//   Fields, kFields          its fields: int32 and float members, each a PluginField of that type,
//   check(fields)            "" or why the field values are unusable,
//   arity(fields)            its input count,
//   output_dims(...)         its shape rule, through IExprBuilder,
//   enqueue(...)             the kernel call, returning "" or the error,
// by deriving from NoWorkspace or not, workspace(fields, inputs), and optionally
//   supports_format(fields, pos, in_out, inputs)   the formats it takes beyond fp16 linear (see below).
// Plugin<Spec> and Creator<Spec> do the rest once for all plugins: field parsing and validation,
// serialization, fp16 linear formats by default, error logging through TensorRT's logger.
#pragma once

#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "sdplugins.h"
#include "trt_api.h"

namespace sdp_trt {

constexpr char kPluginVersion[] = "1";
constexpr char kPluginNamespace[] = "sdplugins";

// Logs through the logger TensorRT hands the library (setLoggerFinder), else to stderr.
void set_logger_finder(nv::ILoggerFinder* finder) noexcept;
void log_error(std::string const& message) noexcept;

// ---- fields ---------------------------------------------------------------------------------------

// One plugin field: an int32 or a float member of a Spec's Fields (exactly one pointer is set).
// Serialized as 4 bytes, in kFields order.
template <class Fields>
struct Field {
  char const* name;
  int32_t Fields::*int_member;
  float Fields::*float_member;

  constexpr nv::PluginFieldType type() const {
    return int_member ? nv::PluginFieldType::kINT32 : nv::PluginFieldType::kFLOAT32;
  }
};

template <class Fields>
constexpr Field<Fields> int_field(char const* name, int32_t Fields::*member) {
  return {name, member, nullptr};
}

template <class Fields>
constexpr Field<Fields> float_field(char const* name, float Fields::*member) {
  return {name, nullptr, member};
}

static_assert(sizeof(float) == 4 && sizeof(int32_t) == 4, "fields serialize as 4 bytes each");

inline char const* type_name(nv::PluginFieldType type) {
  switch (type) {
    case nv::PluginFieldType::kINT32: return "kINT32";
    case nv::PluginFieldType::kFLOAT32: return "kFLOAT32";
    case nv::PluginFieldType::kFLOAT16: return "kFLOAT16";
    case nv::PluginFieldType::kFLOAT64: return "kFLOAT64";
    case nv::PluginFieldType::kINT8: return "kINT8";
    case nv::PluginFieldType::kINT16: return "kINT16";
    case nv::PluginFieldType::kCHAR: return "kCHAR";
    default: return "another type";
  }
}

template <class Spec>
constexpr size_t serialized_size() {
  return Spec::kFields.size() * 4;
}

template <class Spec>
void write_fields(typename Spec::Fields const& fields, char* out) {
  for (auto const& field : Spec::kFields) {
    if (field.int_member) std::memcpy(out, &(fields.*field.int_member), 4);
    else std::memcpy(out, &(fields.*field.float_member), 4);
    out += 4;
  }
}

template <class Spec>
typename Spec::Fields read_fields(char const* in) {
  typename Spec::Fields fields{};
  for (auto const& field : Spec::kFields) {
    if (field.int_member) std::memcpy(&(fields.*field.int_member), in, 4);
    else std::memcpy(&(fields.*field.float_member), in, 4);
    in += 4;
  }
  return fields;
}

// Every declared field exactly once, of its declared type and length 1; nothing else. "" or why not.
template <class Spec>
std::string parse_fields(nv::PluginFieldCollection const* given, typename Spec::Fields& fields) {
  std::array<bool, Spec::kFields.size()> seen{};
  const int32_t count = given ? given->nbFields : 0;
  if (count > 0 && !given->fields) return "the field collection has no fields";
  for (int32_t i = 0; i < count; ++i) {
    nv::PluginField const& field = given->fields[i];
    const std::string name = field.name ? field.name : "";
    size_t k = 0;
    while (k < Spec::kFields.size() && name != Spec::kFields[k].name) ++k;
    if (k == Spec::kFields.size()) {
      std::string known;
      for (auto const& declared : Spec::kFields) known += std::string(known.empty() ? "" : ", ") + declared.name;
      return "unknown field '" + name + "' (fields: " + (known.empty() ? "none" : known) + ")";
    }
    auto const& declared = Spec::kFields[k];
    if (seen[k]) return "field '" + name + "' given twice";
    if (field.type != declared.type() || field.length != 1 || !field.data) {
      return "field '" + name + "' must be one " + type_name(declared.type()) + " value, got " +
             std::to_string(field.length) + " of " + type_name(field.type);
    }
    if (declared.int_member) std::memcpy(&(fields.*declared.int_member), field.data, 4);
    else std::memcpy(&(fields.*declared.float_member), field.data, 4);
    seen[k] = true;
  }
  for (size_t k = 0; k < Spec::kFields.size(); ++k) {
    if (!seen[k]) return std::string("missing field '") + Spec::kFields[k].name + "'";
  }
  return Spec::check(fields);
}

// ---- helpers for the specs --------------------------------------------------------------------------

inline std::string shape_string(nv::Dims const& dims) {
  std::string s = "[";
  for (int32_t i = 0; i < dims.nbDims; ++i) s += (i ? ", " : "") + std::to_string(dims.d[i]);
  return s + "]";
}

inline int64_t volume(nv::Dims const& dims) {
  int64_t n = 1;
  for (int32_t i = 0; i < dims.nbDims; ++i) n *= dims.d[i];
  return n;
}

inline bool same_dims(nv::Dims const& a, nv::Dims const& b) {
  if (a.nbDims != b.nbDims) return false;
  for (int32_t i = 0; i < a.nbDims; ++i) {
    if (a.d[i] != b.d[i]) return false;
  }
  return true;
}

// True where the expression is a build-time constant other than `value`: a shape that cannot be right.
inline bool known_and_not(nv::IDimensionExpr const* dim, int32_t value) {
  return dim->isConstant() && dim->getConstantValue() != value;
}

inline std::string format_name(nv::TensorFormat format) {
  switch (format) {
    case nv::TensorFormat::kLINEAR: return "kLINEAR";
    case nv::TensorFormat::kHWC8: return "kHWC8";
    default: return "TensorFormat " + std::to_string(static_cast<int32_t>(format));
  }
}

inline bool fp16_linear(nv::PluginTensorDesc const& desc) {
  return desc.type == nv::DataType::kHALF && desc.format == nv::TensorFormat::kLINEAR;
}

inline std::string kernel_status(int code) { return code == 0 ? std::string() : std::string(sdp_last_error()); }

// Specs without a workspace derive from this.
struct NoWorkspace {
  template <class Fields>
  static size_t workspace(Fields const&, nv::PluginTensorDesc const*) {
    return 0;
  }
};

// A Spec that takes more than fp16 linear declares supports_format(fields, pos, in_out, inputs).
template <class Spec, class = void>
struct HasFormatRule : std::false_type {};
template <class Spec>
struct HasFormatRule<Spec, std::void_t<decltype(&Spec::supports_format)>> : std::true_type {};

// ---- the plugin -------------------------------------------------------------------------------------

template <class Spec>
class Plugin final : public nv::IPluginV2DynamicExt {
 public:
  using Fields = typename Spec::Fields;

  Plugin(std::string layer, Fields const& fields) : layer_(std::move(layer)), fields_(fields) {}

  // IPluginV2
  nv::AsciiChar const* getPluginType() const noexcept override { return Spec::kName; }
  nv::AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t initialize() noexcept override { return 0; }
  void terminate() noexcept override {}
  size_t getSerializationSize() const noexcept override { return serialized_size<Spec>(); }
  void serialize(void* buffer) const noexcept override { write_fields<Spec>(fields_, static_cast<char*>(buffer)); }
  void destroy() noexcept override { delete this; }
  void setPluginNamespace(nv::AsciiChar const* name) noexcept override {
    try {
      namespace_ = name ? name : "";
    } catch (std::exception const& e) {
      report(e.what());
    }
  }
  nv::AsciiChar const* getPluginNamespace() const noexcept override { return namespace_.c_str(); }

  // IPluginV2Ext
  nv::DataType getOutputDataType(int32_t, nv::DataType const* input_types, int32_t) const noexcept override {
    return input_types[0];
  }

  // IPluginV2DynamicExt
  nv::IPluginV2DynamicExt* clone() const noexcept override {
    try {
      return new Plugin(*this);
    } catch (std::exception const& e) {
      report(e.what());
      return nullptr;
    }
  }

  nv::DimsExprs getOutputDimensions(int32_t index, nv::DimsExprs const* inputs, int32_t count,
                                    nv::IExprBuilder& builder) noexcept override {
    try {
      std::string error;
      nv::DimsExprs out{};
      if (index != 0) error = "has one output, not " + std::to_string(index + 1);
      else if (count != Spec::arity(fields_)) error = arity_error(count);
      else error = Spec::output_dims(fields_, inputs, builder, out);
      if (error.empty()) return out;
      report(error);
    } catch (std::exception const& e) {
      report(e.what());
    }
    return nv::DimsExprs{};
  }

  // The kernels are fp16-only and read every tensor contiguously, gamma/beta/bias constants included, unless
  // the Spec's supports_format admits more. TensorRT asks about pos with in_out[0..pos-1] already chosen, so a
  // rule reads no position above pos. A wrong input count admits no format at all, so the build fails
  // (getOutputDimensions says why).
  bool supportsFormatCombination(int32_t pos, nv::PluginTensorDesc const* in_out, int32_t inputs,
                                 int32_t outputs) noexcept override {
    if (inputs != Spec::arity(fields_) || outputs != 1) return false;
    if constexpr (HasFormatRule<Spec>::value) return Spec::supports_format(fields_, pos, in_out, inputs);
    else return fp16_linear(in_out[pos]);
  }

  void configurePlugin(nv::DynamicPluginTensorDesc const*, int32_t, nv::DynamicPluginTensorDesc const*,
                       int32_t) noexcept override {}

  size_t getWorkspaceSize(nv::PluginTensorDesc const* inputs, int32_t, nv::PluginTensorDesc const*,
                          int32_t) const noexcept override {
    return Spec::workspace(fields_, inputs);
  }

  int32_t enqueue(nv::PluginTensorDesc const* input_desc, nv::PluginTensorDesc const* output_desc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override {
    try {
      std::string error = sizes_fit(input_desc, output_desc[0]);
      if (error.empty()) error = Spec::enqueue(fields_, input_desc, inputs, output_desc[0], outputs[0], workspace, stream);
      if (error.empty()) return 0;
      report(error);
    } catch (std::exception const& e) {
      report(e.what());
    }
    return 1;
  }

 private:
  void report(std::string const& error) const noexcept {
    log_error(std::string(Spec::kName) + " '" + layer_ + "': " + error);
  }

  std::string arity_error(int32_t count) const {
    return "takes " + std::to_string(Spec::arity(fields_)) + " inputs with these fields, got " + std::to_string(count);
  }

  // The kernels take element counts and dimensions as 32-bit ints: refuse what would wrap.
  std::string sizes_fit(nv::PluginTensorDesc const* inputs, nv::PluginTensorDesc const& output) const {
    for (int32_t i = 0; i <= Spec::arity(fields_); ++i) {
      nv::Dims const& dims = i < Spec::arity(fields_) ? inputs[i].dims : output.dims;
      if (volume(dims) > INT_MAX) return "tensor " + shape_string(dims) + " has more than 2^31 - 1 elements";
    }
    return {};
  }

  std::string layer_;
  Fields fields_;
  std::string namespace_ = kPluginNamespace;
};

// ---- the creator ------------------------------------------------------------------------------------

template <class Spec>
class Creator final : public nv::IPluginCreator {
 public:
  Creator() {
    for (size_t k = 0; k < Spec::kFields.size(); ++k) {
      declared_[k] = nv::PluginField(Spec::kFields[k].name, nullptr, Spec::kFields[k].type(), 1);
    }
    collection_.nbFields = static_cast<int32_t>(Spec::kFields.size());
    collection_.fields = declared_.data();
  }

  nv::AsciiChar const* getPluginName() const noexcept override { return Spec::kName; }
  nv::AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
  nv::PluginFieldCollection const* getFieldNames() noexcept override { return &collection_; }

  nv::IPluginV2* createPlugin(nv::AsciiChar const* name, nv::PluginFieldCollection const* given) noexcept override {
    try {
      typename Spec::Fields fields{};
      const std::string error = parse_fields<Spec>(given, fields);
      if (error.empty()) return make(name, fields);
      log_error(label(name) + ": " + error);
    } catch (std::exception const& e) {
      log_error(label(name) + ": " + e.what());
    }
    return nullptr;
  }

  nv::IPluginV2* deserializePlugin(nv::AsciiChar const* name, void const* data, size_t length) noexcept override {
    try {
      std::string error;
      if (length != serialized_size<Spec>() || (length && !data)) {
        error = "serialized data is " + std::to_string(data ? length : 0) + " bytes, expected " +
                std::to_string(serialized_size<Spec>()) + " (an engine from another version of this library?)";
      } else {
        const typename Spec::Fields fields = read_fields<Spec>(static_cast<char const*>(data));
        error = Spec::check(fields);
        if (error.empty()) return make(name, fields);
      }
      log_error(label(name) + ": cannot deserialize: " + error);
    } catch (std::exception const& e) {
      log_error(label(name) + ": " + e.what());
    }
    return nullptr;
  }

  void setPluginNamespace(nv::AsciiChar const* name) noexcept override {
    try {
      namespace_ = name ? name : "";
    } catch (std::exception const& e) {
      log_error(label(nullptr) + ": " + e.what());
    }
  }
  nv::AsciiChar const* getPluginNamespace() const noexcept override { return namespace_.c_str(); }

 private:
  static std::string label(nv::AsciiChar const* name) {
    return std::string(Spec::kName) + " '" + (name ? name : "") + "'";
  }

  nv::IPluginV2* make(nv::AsciiChar const* name, typename Spec::Fields const& fields) const {
    auto* plugin = new Plugin<Spec>(name ? name : "", fields);
    plugin->setPluginNamespace(namespace_.c_str());
    return plugin;
  }

  std::array<nv::PluginField, Spec::kFields.size()> declared_{};
  nv::PluginFieldCollection collection_{};
  std::string namespace_ = kPluginNamespace;
};

}  // namespace sdp_trt
