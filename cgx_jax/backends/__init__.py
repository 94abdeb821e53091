"""The codec's three operations, in two implementations with one contract
(docs/design.md section 3):

- ``quantize_rows(x [rows, n], seed, codec, skip_row=None) -> uint8 [rows, P]``
- ``dequantize_rows(packets [rows, P], codec, n, dtype) -> [rows, n]``
- ``reduce_requantize(peers [N, P], own, own_index, seed, codec, n, *, emit_packet=True,
  emit_sum=False) -> (packet or None, f32 sum or None)``

``"ffi"`` (``cgx_jax.backends.ffi``): the C++/CUDA kernels as XLA FFI custom calls.
``"jax"`` (``cgx_jax.backends.pure_jax``): the same format in ``jax.numpy``, for TPU or
builds without kernels. Rows are whole buckets; padding belongs to the callers.
"""

from __future__ import annotations

from types import ModuleType

from cgx_jax.backends import ffi, pure_jax
from cgx_jax.validation import check_choice

BACKENDS = {"ffi": ffi, "jax": pure_jax}


def get_backend(name: str) -> ModuleType:
    """The module implementing backend ``name`` ("ffi" or "jax").

    Example:
        >>> get_backend("jax").__name__
        'cgx_jax.backends.pure_jax'
    """
    check_choice("backend", name, BACKENDS)
    return BACKENDS[name]
