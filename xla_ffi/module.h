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

// One platform's handler of each target (cgx_jax._src.backends.ffi.TARGETS).
struct Handlers {
  XLA_FFI_Handler* quantize;
  XLA_FFI_Handler* quantize_with_residual;
  XLA_FFI_Handler* dequantize;
  XLA_FFI_Handler* reduce_requantize;
  XLA_FFI_Handler* reduce_requantize_with_sum;
  XLA_FFI_Handler* reduce_sum;
};

inline nanobind::dict registrations(const Handlers& h) {
  const std::pair<const char*, XLA_FFI_Handler*> targets[] = {
      {"cgx_quantize", h.quantize},
      {"cgx_quantize_with_residual", h.quantize_with_residual},
      {"cgx_dequantize", h.dequantize},
      {"cgx_reduce_requantize", h.reduce_requantize},
      {"cgx_reduce_requantize_with_sum", h.reduce_requantize_with_sum},
      {"cgx_reduce_sum", h.reduce_sum},
  };
  nanobind::dict out;
  for (const auto& [name, handler] : targets)
    out[name] = nanobind::capsule(reinterpret_cast<void*>(handler));
  return out;
}

inline std::pair<int, int> ffi_api_version() { return {XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR}; }

inline void define_common(nanobind::module_& m) {
  m.def("ffi_api_version", &ffi_api_version,
        "(major, minor): the XLA FFI API version this module was built against.");
}

}  // namespace cgx
