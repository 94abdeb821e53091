"""memory.py (docs/design.md section 5): a process that opts in (``cgx.keep_freed_memory()``,
as ``launch.initialize`` does) reuses freed host blocks instead of page-faulting fresh
mappings every step; CGX_JAX_KEEP_FREED_MEMORY=0 keeps glibc's defaults; using the
compressed collectives alone changes nothing in the process. Checked in fresh processes by
counting the page faults of touching a 64 MiB block malloc'd again after a free (what
XLA:CPU does with a large output buffer every call)."""

import os
import subprocess
import sys
import textwrap

import pytest

import cgx_jax as cgx

SCRIPT = textwrap.dedent("""
    import ctypes, resource, sys
    import cgx_jax, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import numpy as np
    if OPT_IN:
        cgx_jax.keep_freed_memory()
    # One compressed collective, traced and run as in training.
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    f = jax.jit(jax.shard_map(lambda x: cgx_jax.compressed_psum(
        x, "d", codec=cgx_jax.Codec(rounding="nearest")), mesh=mesh, in_specs=P("d"),
        out_specs=P("d")))
    f(jnp.ones((1, 1 << 16)))
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    def touch_fresh_block():
        block = libc.malloc(size)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(block, 1, size)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        libc.free(ctypes.c_void_p(block))
        return faults
    touch_fresh_block()
    print(touch_fresh_block())
""")


def faults_of_last_call(script, setting, **variables):
    """The page faults of the last call ``script`` prints, run in a fresh CPU process."""
    env = dict(os.environ, **variables)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"  # the setting is for CPU processes (none on a GPU backend)
    if setting is not None:
        env["CGX_JAX_KEEP_FREED_MEMORY"] = setting
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_blocks_are_reused_where_asked_and_only_there():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    opted_in, left_alone = "OPT_IN = True\n" + SCRIPT, "OPT_IN = False\n" + SCRIPT
    assert faults_of_last_call(opted_in, None) < pages // 100  # warm pages: next to no faults
    assert faults_of_last_call(opted_in, "0") > pages // 2  # glibc's fresh mmap: every page
    assert faults_of_last_call(left_alone, None) > pages // 2  # the kernels set nothing


WORKER_THREAD = textwrap.dedent("""
    import ctypes, resource, threading
    import os, cgx_jax
    if os.environ["ONE_ARENA"] == "1":  # as launch.initialize does for one CPU device
        cgx_jax.keep_freed_memory(one_arena=True)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    faults = []
    def touch_fresh_blocks():  # as an XLA worker thread allocates a large output
        for _ in range(2):
            block = libc.malloc(size)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ctypes.memset(block, 1, size)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            libc.free(ctypes.c_void_p(block))
    worker = threading.Thread(target=touch_fresh_blocks)
    worker.start()
    worker.join()
    print(faults[-1])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_one_arena_reaches_threads_started_later():
    # A thread's own glibc arena maps blocks this large afresh every call (its heaps hold at
    # most 64 MiB); with one arena they come from the main heap, which keeps them.
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults_of_last_call(WORKER_THREAD, None, ONE_ARENA="1") < pages // 100
    assert faults_of_last_call(WORKER_THREAD, None, ONE_ARENA="0") > pages // 2
    assert faults_of_last_call(WORKER_THREAD, "0", ONE_ARENA="1") > pages // 2  # opted out


def test_what_launch_applies_is_judged_before_jax_starts():
    cases = {"cpu": True, "cpu,cuda": True, "cuda,cpu": False, "tpu": False}
    script = textwrap.dedent(f"""
        import jax
        from cgx_jax._src import memory
        for platforms in {list(cases)!r}:  # no backend has started in this process
            jax.config.update("jax_platforms", platforms)
            print(memory.jax_runs_on_cpu_only())
        print(memory.cpu_devices_per_process())
        jax.config.update("jax_num_cpu_devices", 3)
        print(memory.cpu_devices_per_process())
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(v) for v in cases.values()] + ["8", "3"]


def test_bad_threshold_is_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threshold must be a positive int"):
            cgx.keep_freed_memory(bad)
