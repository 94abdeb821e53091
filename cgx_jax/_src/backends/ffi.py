"""Typed wrappers around the XLA FFI targets of ``xla_ffi/`` and their registration.

The CPU module ``_cgx_cpu`` is always built; the CUDA module ``_cgx_cuda`` is optional and
imported only when JAX has a GPU backend, so a CPU-only install never fails on import.
Every wrapper works on ``[rows, n]`` arrays with ``n`` a multiple of the bucket size, whose
last row may be short (flat, read as if padded with the last value); other padding and
flattening belong to the callers (``cgx_jax._src.api``, ``cgx_jax._src.collectives``).
The contract of each operation is in docs/design.md section 3.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.codec import Codec, packet_bytes

TARGETS = ("cgx_quantize", "cgx_quantize_with_residual", "cgx_dequantize",
           "cgx_reduce_requantize", "cgx_reduce_requantize_with_sum", "cgx_reduce_sum")


def _jax_has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _import_cuda_module():
    try:
        from cgx_jax import _cgx_cuda
    except ImportError:
        return None
    return _cgx_cuda


def has_cuda_support() -> bool:
    """Whether this build of cgx_jax contains the CUDA kernels (module ``_cgx_cuda``).

    Returns:
      True when ``cgx_jax._cgx_cuda`` was built and imports.

    Example:
        >>> import cgx_jax as cgx
        >>> isinstance(cgx.has_cuda_support(), bool)
        True
    """
    return _import_cuda_module() is not None


def running_ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI API version of the running jaxlib, read from the FFI headers it ships
    (``jax.ffi.include_dir()``); ``None`` where they cannot be read."""
    try:
        path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
        with open(path, encoding="utf-8") as header:
            text = header.read()
    except (AttributeError, OSError):
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text)
             for part in ("MAJOR", "MINOR")]
    return None if None in found else (int(found[0].group(1)), int(found[1].group(1)))


def check_ffi_api_version(module) -> None:
    """``RuntimeError`` when ``module`` was built against a newer XLA FFI API than the
    running jaxlib's: XLA would refuse its handlers at the first call with an
    INVALID_ARGUMENT that does not say what to do."""
    built, running = tuple(module.ffi_api_version()), running_ffi_api_version()
    if running is None or built <= running:
        return
    import jaxlib
    raise RuntimeError(
        f"{module.__name__} was built against XLA FFI API {built[0]}.{built[1]}, but the "
        f"running jaxlib {jaxlib.__version__} has API {running[0]}.{running[1]}, and XLA only "
        f"runs handlers built for its own API version or an older one. Install a newer "
        f"jaxlib (pip install -U jax jaxlib), or rebuild cgx_jax against this one: "
        f"pip install --no-build-isolation --force-reinstall --no-deps <cgx_jax source>")


def _cuda_version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def check_cuda_versions(module) -> None:
    """``RuntimeError`` when the CUDA module cannot run beside this JAX: built for another
    CUDA major than JAX's CUDA plugin (an untested mix of two runtimes in one process), or
    for a newer CUDA major than the installed driver supports (its kernels would fail to
    launch at the first step)."""
    from cgx_jax._src.collectives.jax_compat import jax_cuda_runtime_version  # (import cycle)

    built, driver = module.cuda_versions()
    jax_runtime = jax_cuda_runtime_version()
    fixes = ("Install the jax CUDA plugin of the module's major (pip install -U "
             f"'jax[cuda{built // 1000}]'), or build cgx_jax from source against your CUDA "
             "toolkit (CGX_JAX_CUDA=ON pip install --no-binary cgx_jax cgx_jax, docs/install.md),"
             " or pass backend='jax' to use the pure-JAX codec.")
    if jax_runtime is not None and jax_runtime // 1000 != built // 1000:
        raise RuntimeError(
            f"cgx_jax's CUDA module was built with CUDA {_cuda_version_text(built)}, but JAX "
            f"runs CUDA {_cuda_version_text(jax_runtime)}. {fixes}")
    if driver and driver // 1000 < built // 1000:
        raise RuntimeError(
            f"cgx_jax's CUDA module was built with CUDA {_cuda_version_text(built)}, but the "
            f"installed NVIDIA driver supports CUDA {_cuda_version_text(driver)} at most. "
            f"Upgrade the driver, or: {fixes}")


@functools.cache
def _register() -> None:
    """Registers the targets once, on first use: "cpu" always, "CUDA" when JAX has a GPU.
    Nothing else: no process-wide setting (host memory reuse is ``launch.initialize``'s and
    ``cgx.keep_freed_memory``'s, docs/design.md section 5)."""
    from cgx_jax import _cgx_cpu

    check_ffi_api_version(_cgx_cpu)
    for name, capsule in _cgx_cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if not _jax_has_gpu():
        return
    cuda = _import_cuda_module()
    if cuda is None:
        if jax.default_backend() == "gpu":
            raise RuntimeError(
                "JAX runs on a GPU but this cgx_jax build has no CUDA kernels. Rebuild with "
                "the CUDA toolkit installed: CGX_JAX_CUDA=ON pip install --force-reinstall "
                "--no-deps cgx_jax (or pass backend='jax' to use the pure-JAX codec)."
            )
        return
    check_ffi_api_version(cuda)
    check_cuda_versions(cuda)
    for name, capsule in cuda.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _codec_attrs(codec: Codec) -> dict:
    return dict(bits=np.int64(codec.bits), bucket_size=np.int64(codec.bucket_size))


def quantize_rows(x: jax.Array, seed: jax.Array, codec: Codec, skip_row=None,
                  n: int | None = None, *, with_residual: bool = False):
    """Encodes each row of ``x`` ``[rows, n]`` (f32/bf16/f16) as one packet -> ``uint8 [rows, P]``.
    ``seed`` is ``uint32[2]``; the stochastic noise of element ``(r, j)`` is keyed by the seed
    and the flat index ``r * n + j``. Row ``skip_row`` (an int32 scalar, may be traced; a
    value outside ``[0, rows)`` skips nothing) is not encoded and comes back as zero bytes:
    SRA never sends its own row, so it need not pay for encoding it.

    With ``n`` given, ``x`` may be flat and its last row short (``ceil(x.size / n)`` rows):
    the missing values are read as ``x``'s last one, so the packets are those of ``x`` padded
    with ``codec.pad_to_multiple``, without the padded copy.

    ``with_residual``: returns ``(packets, residual)``, ``residual`` f32 of ``x``'s shape
    holding what the encoding lost, ``x - dequantize_rows(packets)`` bit for bit (0 in row
    ``skip_row``), written by the same kernel while the packet is in cache (error feedback's
    residual).
    """
    _register()
    rows, n = _row_shape(x, n)
    skip_row = jnp.asarray(-1 if skip_row is None else skip_row, jnp.int32)
    packets = jax.ShapeDtypeStruct((rows, packet_bytes(n, codec)), jnp.uint8)
    if with_residual:
        call = jax.ffi.ffi_call("cgx_quantize_with_residual",
                                (packets, jax.ShapeDtypeStruct(x.shape, jnp.float32)),
                                vmap_method="sequential")
    else:
        call = jax.ffi.ffi_call("cgx_quantize", packets, vmap_method="sequential")
    return call(x, seed, skip_row, stochastic=codec.stochastic, n=np.int64(n),
                **_codec_attrs(codec))


def _row_shape(x, n):
    """(rows, n) of ``x``: its shape ``[rows, n]``, or with ``n`` given ``ceil(size / n)`` rows
    (the last possibly short)."""
    if n is None:
        return x.shape
    return -(-x.size // n), n


def dequantize_rows(packets: jax.Array, codec: Codec, n: int, dtype,
                    offset: int = 0, size: int | None = None, divisor: int = 1) -> jax.Array:
    """Decodes packets of ``n`` values each -> ``[rows, n]`` of ``dtype``. Row ``r``'s packet
    is ``packets[r, offset:offset + P]`` of ``packets uint8 [rows, W]`` (a wire row carrying
    several segments' packets is read in place, not sliced into a copy). With ``size``, the
    result is flat ``[size]``: the first ``size`` values (the last row short), no copy.
    ``divisor`` (an int in ``[1, 2^24]``): each value is multiplied by ``1 / divisor``
    rounded to f32 (as XLA:CPU computes ``x / divisor``) before it is narrowed to ``dtype``,
    so a mean costs no extra pass."""
    _register()
    shape = (packets.shape[0], n) if size is None else (size,)
    out = jax.ShapeDtypeStruct(shape, dtype)
    call = jax.ffi.ffi_call("cgx_dequantize", out, vmap_method="sequential")
    return call(packets, offset=np.int64(offset), n=np.int64(n), divisor=np.int64(divisor),
                **_codec_attrs(codec))


def _own_operand(own):
    """``own`` for the kernels: an empty buffer stands for no own chunk."""
    return jnp.zeros((0,), jnp.float32) if own is None else own


def reduce_requantize(peers, own, own_index, seed, codec: Codec, n: int, *, offset: int = 0):
    """The peer-to-peer reduction: decodes the ``N`` packets ``peers[:, offset:offset + P]``
    (of ``peers uint8 [N, W]``) of one chunk of ``n`` values, sums them in f32 in peer order
    0..N-1 (peer ``own_index`` replaced by the raw ``own`` chunk unless ``own`` is None) and
    re-encodes the sum as one packet (noise keyed by ``seed``, ``uint32[2]``). ``own`` is
    the ``[n]`` chunk or all ``N`` rows of ``n`` (any shape, the last row possibly short: a
    missing value reads as the last one), of which the kernel reads row ``own_index`` (so a
    caller holding the rows passes them without slicing out a copy).

    Returns the packet, ``uint8[P]``.
    """
    _register()
    packet = jax.ShapeDtypeStruct((packet_bytes(n, codec),), jnp.uint8)
    call = jax.ffi.ffi_call("cgx_reduce_requantize", packet, vmap_method="sequential")
    return call(peers, _own_operand(own), jnp.asarray(own_index, jnp.int32), seed,
                stochastic=codec.stochastic, n=np.int64(n), offset=np.int64(offset),
                **_codec_attrs(codec))


def reduce_requantize_with_sum(peers, own, own_index, seed, codec: Codec, n: int, *,
                               offset: int = 0):
    """``reduce_requantize`` that also returns the f32 sum the packet encodes (the ring's
    error feedback reads what re-encoding it lost).

    Returns ``(packet uint8[P], sum f32[n])``.
    """
    _register()
    outs = (jax.ShapeDtypeStruct((packet_bytes(n, codec),), jnp.uint8),
            jax.ShapeDtypeStruct((n,), jnp.float32))
    call = jax.ffi.ffi_call("cgx_reduce_requantize_with_sum", outs, vmap_method="sequential")
    return call(peers, _own_operand(own), jnp.asarray(own_index, jnp.int32), seed,
                stochastic=codec.stochastic, n=np.int64(n), offset=np.int64(offset),
                **_codec_attrs(codec))


def reduce_sum(peers, own, own_index, codec: Codec, n: int, *, offset: int = 0,
               size: int | None = None, divisor: int = 1):
    """The sum ``reduce_requantize`` encodes, returned instead of encoded: f32 ``[n]``, or
    its first ``size`` values, times ``1 / divisor`` rounded to f32 (as in
    ``dequantize_rows``). Deterministic: no seed.
    """
    _register()
    total = jax.ShapeDtypeStruct((n if size is None else size,), jnp.float32)
    call = jax.ffi.ffi_call("cgx_reduce_sum", total, vmap_method="sequential")
    return call(peers, _own_operand(own), jnp.asarray(own_index, jnp.int32), n=np.int64(n),
                offset=np.int64(offset), divisor=np.int64(divisor), **_codec_attrs(codec))
