"""Plain helpers shared by the test modules (conftest.py has set up the 8 CPU devices before
any test module imports this): CPU meshes and sharded runs; the codec comparisons of the
kernel, jnp backend and public quantize tests, whose oracle is the numpy model
(tests/numpy_model.py, docs/design.md section 2). Nothing here imports flax (the GPU check
runs the backend tests without it); the Flax model and the training data are in models.py,
real processes and network namespaces in processes.py."""

import functools
import importlib.util
import os
import sys

import jax
import ml_dtypes
import numpy as np
import numpy_model as model
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from cgx_jax._src.backends import ffi, pure_jax
from cgx_jax._src.codec import Codec

REPO = os.path.join(os.path.dirname(__file__), os.pardir)


def load_script(relative_path, name):
    """The script at ``relative_path`` (from the repository root: an example or a tool)
    imported as the module ``name`` (registered in ``sys.modules``, where dataclasses look
    their module up)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relative_path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def usage_error(main, args, capsys) -> str:
    """What ``main(args)`` (a command line's entry point) wrote to stderr, checked to have
    exited with argparse's usage error (status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------------
# Meshes and sharded runs
# ---------------------------------------------------------------------------

def cpu_mesh(num_devices: int, axis_names=("batch",), shape=None) -> Mesh:
    """A mesh over the first ``num_devices`` CPU devices (on a GPU machine too), of the given
    shape; by default 1-D, or (2, num_devices // 2) for two axis names."""
    devices = np.array(jax.devices("cpu")[:num_devices])
    if shape is None:
        shape = (num_devices,) if len(axis_names) == 1 else (2, num_devices // 2)
    return Mesh(devices.reshape(shape), axis_names)


def run_sharded(fn, stacked, num_devices, *args):
    """Runs fn(per_device_value, *args) under shard_map over `num_devices` CPU devices and
    returns the per-device outputs stacked on a new leading axis. The same ``fn`` is compiled
    once per shape (a loop over keys passes them as ``args``)."""
    out = _sharded_program(fn, num_devices, len(args))(stacked, *args)
    return jax.block_until_ready(out)


@functools.lru_cache(maxsize=64)
def _sharded_program(fn, num_devices, num_args):
    return jax.jit(jax.shard_map(
        lambda x, *a: jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], x), *a)),
        mesh=cpu_mesh(num_devices), in_specs=(P("batch"),) + (P(),) * num_args,
        out_specs=P("batch")))


def run_2d(fn, stacked, outer, inner, *args):
    """fn(per_device_value, *args) under shard_map over an (outer, inner) mesh of axes
    "outer" and "inner"; device (o, i) gets row o * inner + i; returns the per-device outputs
    stacked the same way."""
    spec = P(("outer", "inner"))
    mapped = jax.shard_map(
        lambda x, *a: jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], x), *a)),
        mesh=cpu_mesh(outer * inner, ("outer", "inner"), (outer, inner)),
        in_specs=(spec,) + (P(),) * len(args), out_specs=spec)
    return jax.block_until_ready(jax.jit(mapped)(stacked, *args))


# ---------------------------------------------------------------------------
# Codec comparisons (kernels, jnp backend, public quantize) on the CPU device
# ---------------------------------------------------------------------------

CPU = jax.devices("cpu")[0]
F32, BF16, F16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
DTYPES = (F32, BF16, F16)
ROUNDINGS = ("nearest", "stochastic")
BITS = tuple(range(1, 9))
EPS = 2.0**-24  # unit roundoff of f32


def on_cpu(a):
    return jax.device_put(a, CPU)


# Jitted once per static codec/shape: eager dispatch of each codec would compile just the same.
ffi_quantize = jax.jit(ffi.quantize_rows, static_argnums=2)
ffi_dequantize = jax.jit(ffi.dequantize_rows, static_argnums=(1, 2, 3))
jnp_quantize = jax.jit(pure_jax.quantize_rows, static_argnums=2)
jnp_dequantize = jax.jit(pure_jax.dequantize_rows, static_argnums=(1, 2, 3))


def reduce_outputs(backend, peers, own, own_index, seed, codec, n, *, emit_packet=True,
                   emit_sum=False, offset=0, size=None, divisor=1):
    """``(packet or None, sum or None)`` from the backend's reduce operation that gives them
    (``reduce_requantize``, ``reduce_requantize_with_sum``, ``reduce_sum``; a packet with a
    scaled or shortened sum from two calls)."""
    if emit_packet and emit_sum and size is None and divisor == 1:
        return backend.reduce_requantize_with_sum(peers, own, own_index, seed, codec, n,
                                                  offset=offset)
    packet = (backend.reduce_requantize(peers, own, own_index, seed, codec, n, offset=offset)
              if emit_packet else None)
    total = (backend.reduce_sum(peers, own, own_index, codec, n, offset=offset, size=size,
                                divisor=divisor) if emit_sum else None)
    return packet, total


@functools.partial(jax.jit, static_argnames=("backend", "codec", "n", "emit_packet", "emit_sum"))
def jit_reduce(peers, own, own_index, seed, *, backend, codec, n, emit_packet=True,
               emit_sum=False):
    """``reduce_outputs`` (backend: the module ffi or pure_jax), jitted."""
    return reduce_outputs(backend, peers, own, own_index, seed, codec, n,
                          emit_packet=emit_packet, emit_sum=emit_sum)


def quantize(x, seed, codec):
    return np.asarray(ffi_quantize(on_cpu(x), on_cpu(np.asarray(seed, np.uint32)), codec))


def dequantize(packets, codec, n, dtype):
    return np.asarray(ffi_dequantize(on_cpu(packets), codec, n, np.dtype(dtype)))


def codec_of(bits, bucket_size, rounding):
    return Codec(bits=bits, bucket_size=bucket_size, rounding=rounding)


def realistic(rng, rows, n, bucket_size, spread=2.0):
    """Normal values with a different scale (10^-spread..10^spread) and offset per bucket."""
    nb = n // bucket_size
    scale = 10.0 ** rng.uniform(-spread, spread, (rows, nb, 1))
    offset = rng.standard_normal((rows, nb, 1)) * scale * rng.choice([0.0, 0.5, 4.0], (rows, nb, 1))
    x = rng.standard_normal((rows, nb, bucket_size)) * scale + offset
    return x.reshape(rows, n).astype(np.float32)


def _large(dtype):
    # Wide, but with unit below 2^126 at every bits so 1/unit stays a normal float (see
    # test_backends_ffi.py's test_huge_bucket_matches_model for wider buckets).
    return 6e4 if dtype == F16 else 3e37


SPECIAL_KINDS = ("constant", "zeros", "nan", "+inf", "-inf", "large", "one_off")


def with_specials(x, bucket_size, dtype, rng):
    """Puts one bucket of each special kind into x [rows, n] (spread over the rows)."""
    buckets = x.reshape(-1, bucket_size)
    step = max(1, (buckets.shape[0] - 1) // len(SPECIAL_KINDS))
    for k, kind in enumerate(SPECIAL_KINDS):
        i = 1 + k * step
        if i >= buckets.shape[0]:
            break
        j = rng.integers(bucket_size)
        if kind == "constant":
            buckets[i] = -2.75
        elif kind == "zeros":
            buckets[i] = 0.0
        elif kind == "nan":
            buckets[i, j] = np.nan
        elif kind in ("+inf", "-inf"):
            buckets[i, j] = float(kind[0] + "inf")
        elif kind == "large":
            buckets[i] = rng.uniform(-1, 1, bucket_size) * _large(dtype)
            buckets[i, j] = -_large(dtype)
        elif kind == "one_off":
            buckets[i] = 1.5
            buckets[i, j] = 1.25
    return x


def as_dtype(x, dtype):
    """x in `dtype` and the same values exactly in f32 (the model's input)."""
    xd = np.asarray(x, np.float32).astype(dtype)
    return xd, xd.astype(np.float32)


def float_bits(a):
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_bytes_equal(got, want, what=""):
    got = np.asarray(got)
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} bytes differ, first at flat "
                           f"{bad[:4]}: got {got.ravel()[bad[:4]]}, want {want.ravel()[bad[:4]]}")


def assert_same_floats(got, want, what=""):
    """Bit-identical floats, except that any NaN equals any NaN."""
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    got_nan, want_nan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    same = (float_bits(got) == float_bits(want)) | (got_nan & want_nan)
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} values differ, first at "
                           f"{bad[:4]}: got {got.ravel()[bad[:4]]}, want {want.ravel()[bad[:4]]}")


def model_decoded(packets, codec, n, dtype):
    out = model.dequantize_rows(packets, codec.bits, codec.bucket_size, n)
    return out.astype(dtype)
