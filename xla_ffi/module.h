// The nanobind side shared by the CPU and CUDA modules: both expose registrations(), a dict
// from FFI target name to handler capsule, which cgx_jax._src.backends.ffi registers with
// jax.ffi.register_ffi_target for its platform, and ffi_api_version(), the XLA FFI API
// version of the headers the module was built against (XLA runs a handler only if its
// version is at most the running jaxlib's).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include <initializer_list>
#include <utility>

#include "xla/ffi/api/c_api.h"

namespace cgx {

// Each (target name, handler) pair: one target per operation, every output it declares
// written (validate.h).
inline nanobind::dict registrations(
    std::initializer_list<std::pair<const char*, XLA_FFI_Handler*>> handlers) {
  nanobind::dict targets;
  for (const auto& [name, handler] : handlers)
    targets[name] = nanobind::capsule(reinterpret_cast<void*>(handler));
  return targets;
}

inline std::pair<int, int> ffi_api_version() { return {XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR}; }

inline void define_common(nanobind::module_& m) {
  m.def("ffi_api_version", &ffi_api_version,
        "(major, minor): the XLA FFI API version this module was built against.");
}

}  // namespace cgx
