"""The codec's operations, ``quantize_rows``, ``dequantize_rows`` and the reductions
``reduce_requantize``, ``reduce_requantize_with_sum`` and ``reduce_sum``, in two
implementations with one contract (docs/design.md section 3):
``"ffi"`` (``cgx_jax._src.backends.ffi``, whose docstrings state it): the C++/CUDA kernels as XLA
FFI custom calls; ``"jax"`` (``cgx_jax._src.backends.pure_jax``): the same format in
``jax.numpy``, for TPU or builds without kernels, with the same signatures
(tests/test_backends_pure_jax.py compares them). Rows are whole buckets; padding belongs to the
callers.
"""

from __future__ import annotations

from types import ModuleType

from cgx_jax._src.backends import ffi, pure_jax
from cgx_jax._src.validation import check_choice

BACKENDS = {"ffi": ffi, "jax": pure_jax}


def get_backend(name: str) -> ModuleType:
    """The module implementing backend ``name`` ("ffi" or "jax").

    Example:
        >>> get_backend("jax").__name__
        'cgx_jax._src.backends.pure_jax'
    """
    check_choice("backend", name, BACKENDS)
    return BACKENDS[name]
