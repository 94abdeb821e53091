"""Host memory reuse for XLA:CPU processes (docs/design.md section 5 has the measurements).

XLA:CPU allocates every output and temporary buffer of a computation with ``malloc`` and
frees it afterwards. glibc serves blocks above its mmap threshold (at most 32 MiB by
default) with a fresh ``mmap``, so a step whose gradients or fused buffers exceed it
page-faults and zeroes every page of them again on every call. Raising the mmap and trim
thresholds keeps freed blocks in the process, so the next step reuses warm pages. XLA's
worker threads allocate from glibc's per-thread arenas, whose heaps are too small for such
blocks; one arena for the whole process fixes that for threads that have not allocated yet
(so before JAX starts its backend), at the cost of one allocator lock for all threads.

``cgx_jax.launch.initialize`` applies the thresholds, and the arena limit where the process
has one CPU device (the data-parallel layout across processes). Elsewhere it is the user's
choice: ``cgx.keep_freed_memory()`` before the first step. Importing cgx_jax or registering
its kernels changes nothing in the process. The peak stays what the program needs; the
process keeps up to ``threshold`` bytes of freed blocks instead of unmapping them.
``CGX_JAX_KEEP_FREED_MEMORY=0`` makes it a no-op. Nothing happens off Linux/glibc or on GPU
and TPU backends, whose large buffers are not host ``malloc`` blocks.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil
import re

ENV = "CGX_JAX_KEEP_FREED_MEMORY"
DEFAULT_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_applied = False


def keep_freed_memory(threshold: int = DEFAULT_THRESHOLD, *, one_arena: bool = False) -> bool:
    """Makes glibc keep freed blocks of up to ``threshold`` bytes in the process (``mallopt``
    mmap and trim thresholds) instead of unmapping them; with ``one_arena``, also serve every
    thread from that one heap (threads that already allocated keep their arena, so call it
    before JAX's first computation; all threads then share one allocator lock). Returns
    whether it was applied (False off glibc, or when ``CGX_JAX_KEEP_FREED_MEMORY=0``).

    Args:
      threshold: the largest block, in bytes, kept instead of unmapped.
      one_arena: also serve every thread from one heap.

    Returns:
      Whether the setting was applied.

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
    settings = [(_M_TRIM_THRESHOLD, threshold), (_M_MMAP_THRESHOLD, threshold)]
    if one_arena:
        settings.append((_M_ARENA_MAX, 1))
    _applied = all([mallopt(option, value) for option, value in settings])
    return _applied


def keep_freed_memory_on_cpu() -> None:
    """``keep_freed_memory()`` once per process when JAX's default backend is the CPU."""
    if _applied:
        return
    import jax

    if jax.default_backend() == "cpu":
        keep_freed_memory()


def jax_runs_on_cpu_only() -> bool:
    """Whether JAX will run on the CPU, judged without starting a backend: ``jax_platforms``
    (``JAX_PLATFORMS``) puts cpu first, or it is unset and no accelerator is installed (no
    JAX plugin, as the CUDA and ROCm ones are, and no ``libtpu``)."""
    import jax

    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    try:
        import jax_plugins
    except ImportError:
        pass
    else:
        if any(pkgutil.iter_modules(jax_plugins.__path__)):
            return False
    return importlib.util.find_spec("libtpu") is None


def cpu_devices_per_process() -> int:
    """The CPU devices this process will have, read without starting a backend
    (``jax_num_cpu_devices``, else ``--xla_force_host_platform_device_count`` in
    ``XLA_FLAGS``, else 1)."""
    import jax

    if jax.config.jax_num_cpu_devices > 0:
        return jax.config.jax_num_cpu_devices
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                      os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 1


def keep_freed_memory_before_jax_starts() -> None:
    """What ``launch.initialize`` applies before JAX starts, where JAX runs on the CPU only:
    the thresholds, and one arena when the process has one CPU device."""
    if jax_runs_on_cpu_only():
        keep_freed_memory(one_arena=cpu_devices_per_process() == 1)
