"""Bad input across the public API (docs/design.md section 8, "Python errors"): each row of the
table fails with its error type and a message naming the argument, the value and what is
allowed. Checks of one module's arguments are tested with that module too (TestBadArguments
in test_api.py and test_collectives.py, test_codec.py, test_policy.py, test_adaptive.py, and
the direct FFI calls in test_backends_ffi.py)."""

import jax
import jax.numpy as jnp
import pytest
from helpers import cpu_mesh
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx

NEAREST = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")


def in_shard_map(fn, num_devices=2):
    mesh = cpu_mesh(num_devices)
    mapped = jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh, in_specs=P("batch"),
                           out_specs=P("batch"))
    return jax.block_until_ready(jax.jit(mapped)(jnp.ones((num_devices, 100))))


# Each row: (what, call, error type, message regex).
BAD_INPUTS = [
    ("bits 0", lambda: cgx.Codec(bits=0), ValueError, r"bits must be an integer in 1\.\.8, got 0"),
    ("bits 9", lambda: cgx.Codec(bits=9), ValueError, r"bits must be .* got 9"),
    ("bits -1", lambda: cgx.Codec(bits=-1), ValueError, r"bits must be .* got -1"),
    ("bits 4.5", lambda: cgx.Codec(bits=4.5), TypeError, r"bits must be .* got 4\.5 of type float"),
    ("bits '4'", lambda: cgx.Codec(bits="4"), TypeError, r"bits must be .* got '4' of type str"),
    ("bucket 0", lambda: cgx.Codec(bucket_size=0), ValueError, r"bucket_size must be a positive multiple of 8.* got 0"),
    ("bucket -8", lambda: cgx.Codec(bucket_size=-8), ValueError, r"bucket_size .* got -8"),
    ("bucket 7", lambda: cgx.Codec(bucket_size=7), ValueError, r"bucket_size .* got 7"),
    ("bucket 12", lambda: cgx.Codec(bucket_size=12), ValueError, r"bucket_size .* got 12"),
    ("bucket 2**40", lambda: cgx.Codec(bucket_size=2**40), ValueError, r"no larger than 16777216, got 1099511627776"),
    ("rounding", lambda: cgx.Codec(rounding="up"), ValueError, r"rounding must be one of \('stochastic', 'nearest'\), got 'up'"),
    ("algorithm", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "batch", codec=NEAREST, algorithm="tree")),
     ValueError, r"algorithm must be one of .*got 'tree'"),
    ("backend", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "batch", codec=NEAREST, backend="tpu")),
     ValueError, r"backend must be one of \('ffi', 'jax'\), got 'tpu'"),
    ("quantize int32", lambda: cgx.quantize(jnp.arange(8), NEAREST), TypeError, r"x must be a float32, bfloat16 or float16 array, got dtype int32"),
    ("quantize bool", lambda: cgx.quantize(jnp.ones(8, bool), NEAREST), TypeError, r"got dtype bool"),
    ("quantize complex", lambda: cgx.quantize(jnp.ones(8, jnp.complex64), NEAREST), TypeError, r"got dtype complex64"),
    ("dequantize length", lambda: cgx.dequantize(jnp.zeros(10, jnp.uint8), NEAREST, (64,)), ValueError, r"packets must be uint8\[40\] for shape \(64,\)"),
    ("dequantize dtype", lambda: cgx.dequantize(jnp.zeros(40, jnp.int8), NEAREST, (64,)), ValueError, r"packets must be uint8\[40\].* got int8\[40\]"),
    ("dequantize out dtype", lambda: cgx.dequantize(jnp.zeros(40, jnp.uint8), NEAREST, (64,), jnp.int32), TypeError, r"dtype must be float32, bfloat16 or float16, got int32"),
    ("unbound axis", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "model", codec=NEAREST)),
     ValueError, r"axis_name 'model' is not bound"),
    ("policy matching nothing", lambda: in_shard_map(lambda x: cgx.compressed_psum(
        {"w": x}, "batch", policy=cgx.LayerPolicy(overrides={"decoder": NEAREST}))),
     ValueError, r"override regex 'decoder' matches no leaf; the paths are: \['w'\]"),
    ("key type", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "batch", codec=cgx.Codec(4, 64), key=7)),
     TypeError, r"key must be a JAX PRNG key"),
    ("missing key", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "batch", codec=cgx.Codec(4, 64))),
     ValueError, r"compressed_psum rounds stochastically and needs a PRNG key.*or let cgx.compressed_allreduce \(which "
                 r"keeps and splits a key in its state\) or cgx.value_and_grad\(..., step=...\) "
                 r"manage it"),
    ("policy type", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "batch", policy={"default": 4})),
     TypeError, r"policy must be a cgx_jax.LayerPolicy, got dict"),
]


@pytest.mark.parametrize("call,error,message", [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()
