// The nanobind side shared by the CPU and CUDA modules: both expose registrations(), a dict
// from FFI target name to handler capsule, which cgx_jax._src.backends.ffi registers with
// jax.ffi.register_ffi_target for its platform, and ffi_api_version(), the XLA FFI API
// version of the headers the module was built against (XLA runs a handler only if its
// version is at most the running jaxlib's).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include <utility>

#include "xla/ffi/api/c_api.h"

namespace cgx {

inline nanobind::dict registrations(void* quantize, void* dequantize, void* reduce_requantize) {
  nanobind::dict targets;
  targets["cgx_quantize"] = nanobind::capsule(quantize);
  targets["cgx_dequantize"] = nanobind::capsule(dequantize);
  targets["cgx_reduce_requantize"] = nanobind::capsule(reduce_requantize);
  return targets;
}

inline std::pair<int, int> ffi_api_version() { return {XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR}; }

inline void define_common(nanobind::module_& m) {
  m.def("ffi_api_version", &ffi_api_version,
        "(major, minor): the XLA FFI API version this module was built against.");
}

}  // namespace cgx
