// TensorRT's plugin API as this library uses it, compiled against TensorRT 8.6 through 11.x headers.
//
// The library implements IPluginV2DynamicExt and IPluginCreator: the one plugin interface that loads in
// TensorRT 8.6 (which has no IPluginV3) and still loads in 10.x and 11.x, where it is deprecated. Every
// translation unit that includes this header implements or uses that deprecated interface, so the
// deprecation warnings are switched off here, for those files only.
#pragma once

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#include <NvInferRuntime.h>

namespace sdp_trt {
namespace nv = nvinfer1;
}  // namespace sdp_trt
