// The nanobind side shared by the CPU and CUDA modules: both expose registrations(), a dict
// from FFI target name to handler capsule, which cgx_jax.kernels registers with
// jax.ffi.register_ffi_target for its platform.
#pragma once

#include <nanobind/nanobind.h>

namespace cgx {

inline nanobind::dict registrations(void* quantize, void* dequantize, void* reduce_requantize) {
  nanobind::dict targets;
  targets["cgx_quantize"] = nanobind::capsule(quantize);
  targets["cgx_dequantize"] = nanobind::capsule(dequantize);
  targets["cgx_reduce_requantize"] = nanobind::capsule(reduce_requantize);
  return targets;
}

}  // namespace cgx
