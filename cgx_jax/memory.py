"""Host memory reuse for XLA:CPU processes (docs/design.md section 5).

XLA:CPU allocates every output and temporary buffer of a computation with ``malloc`` and
frees it afterwards. glibc serves blocks above its mmap threshold (at most 32 MiB by
default) with a fresh ``mmap``, so a training step whose gradients or fused buffers exceed
it page-faults and zeroes every page of them again on every call: a 16M-value f32
all-reduce result alone is 16,384 page faults per call, about 80 ms of a 270 ms compressed
all-reduce measured across 4 processes on 2 cores. Raising the mmap and trim thresholds
keeps freed blocks in the process, so the next step reuses warm pages.

The library does this itself, once per process, when a compressed collective is traced on
the CPU backend (and ``cgx_jax.launch.initialize`` does it before the first computation, so
exact baselines in a launched process get the same allocator). It only changes when freed
memory goes back to the system: the peak stays what the program needs, and the process keeps
up to ``threshold`` bytes of freed blocks instead of unmapping them. Set the environment
variable ``CGX_JAX_KEEP_FREED_MEMORY=0`` to keep glibc's defaults. Nothing happens off
Linux/glibc or on GPU and TPU backends, whose large buffers are not host ``malloc`` blocks.
"""

from __future__ import annotations

import ctypes
import os

ENV = "CGX_JAX_KEEP_FREED_MEMORY"
DEFAULT_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_applied = False


def keep_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Makes glibc keep freed blocks of up to ``threshold`` bytes in the process (``mallopt``
    mmap and trim thresholds) instead of unmapping them; returns whether it was applied
    (False off glibc, or when ``CGX_JAX_KEEP_FREED_MEMORY=0``).

    Example:
        >>> import cgx_jax as cgx
        >>> cgx.keep_freed_memory() in (True, False)
        True
    """
    global _applied
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
        raise ValueError(f"threshold must be a positive int of bytes, got {threshold!r}")
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # mallopt returns 1 on success (0 for a value glibc does not accept).
    _applied = bool(mallopt(_M_TRIM_THRESHOLD, threshold)) and bool(
        mallopt(_M_MMAP_THRESHOLD, threshold))
    return _applied


def keep_freed_memory_on_cpu() -> None:
    """``keep_freed_memory()`` once per process when JAX's default backend is the CPU."""
    if _applied:
        return
    import jax

    if jax.default_backend() == "cpu":
        keep_freed_memory()
