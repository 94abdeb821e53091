"""Hardening: every bad input over the public API fails with a clear error (one row each),
replicas never drift over long runs, a NaN gradient is skipped rather than hidden, and
many calls with fresh keys do not grow the process's memory."""

import resource

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import cgx_jax as cgx
from conftest import cpu_mesh

CPU = jax.devices("cpu")
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
     ValueError, r"stochastic rounding needs a PRNG key"),
    ("policy type", lambda: in_shard_map(lambda x: cgx.compressed_psum(x, "batch", policy={"default": 4})),
     TypeError, r"policy must be a cgx_jax.LayerPolicy, got dict"),
]


@pytest.mark.parametrize("call,error,message", [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_raises_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("shape", [(), (0,), (5, 0)], ids=str)
def test_empty_arrays_and_scalars_work(shape):
    x = jnp.full(shape, 1.5, jnp.float32)
    packet = cgx.quantize(x, NEAREST)
    np.testing.assert_array_equal(cgx.dequantize(packet, NEAREST, shape), x)
    summed = jax.pmap(lambda v: cgx.compressed_psum(v, "batch", codec=NEAREST),
                      axis_name="batch", devices=CPU[:2])(jnp.stack([x, x]))
    np.testing.assert_array_equal(summed[1], np.full(shape, 3.0, np.float32))


def test_replicas_identical_after_1000_allreduce_steps():
    """SGD on per-device data with 2-bit stochastic all-reduce inside one program: if any
    replica decoded different bytes even once, its parameters would differ ever after."""
    codec = cgx.Codec(bits=2, bucket_size=64)
    data = jax.random.normal(jax.random.key(0), (8, 300))

    def run(x, key):
        def step(i, params):
            grads = params - x  # pulls each replica toward its own data
            reduced = cgx.compressed_pmean(grads, "batch", codec=codec,
                                           key=jax.random.fold_in(key, i))
            return params - 0.1 * reduced
        return jax.lax.fori_loop(0, 1000, step, jnp.zeros_like(x))

    params = jax.pmap(run, axis_name="batch", in_axes=(0, None), devices=CPU)(
        data, jax.random.key(1))
    params = np.asarray(params)
    for replica in params[1:]:
        np.testing.assert_array_equal(replica.view(np.uint32), params[0].view(np.uint32))
    # It converged to the mean of the data, within the 2-bit noise.
    assert np.max(np.abs(params[0] - np.asarray(data).mean(0))) < 0.5


def test_training_with_apply_if_finite_skips_the_nan_step():
    tx = optax.chain(cgx.compressed_allreduce("batch", policy=cgx.LayerPolicy(
        default=cgx.Codec(bits=4, bucket_size=64), min_size=64)),
        optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3))

    def step(params, state, x, poison):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        grads = {"w": jnp.where(poison, jnp.nan, 1.0) * grads["w"]}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p_step = jax.pmap(step, axis_name="batch", devices=CPU)
    params = {"w": jnp.broadcast_to(jnp.eye(16), (8, 16, 16))}
    state = jax.pmap(tx.init, devices=CPU)(params)
    x = jax.random.normal(jax.random.key(2), (8, 32, 16))
    history = []
    for i in range(4):
        poison = jnp.arange(8) == 5 if i == 2 else jnp.zeros(8, bool)  # one replica, one step
        params, state = p_step(params, state, x, poison)
        history.append(np.asarray(params["w"]))
    np.testing.assert_array_equal(history[2], history[1])  # the NaN step changed nothing
    assert not np.array_equal(history[3], history[2])  # training went on
    assert np.all(np.isfinite(history[3]))
    assert np.all(np.asarray(state[1].total_notfinite) == 1)


def test_memory_does_not_grow_over_10000_calls_with_fresh_keys():
    codec = cgx.Codec(bits=4, bucket_size=64)
    step = jax.pmap(lambda x, k: cgx.compressed_psum(x, "batch", codec=codec, key=k),
                    axis_name="batch", in_axes=(0, None), devices=CPU[:2])
    x = jnp.ones((2, 1000)) * jnp.arange(1000.0)
    keys = jax.random.split(jax.random.key(0), 10_000)

    def max_rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    for i in range(500):  # warm up: compile, allocator pools
        step(x, keys[i]).block_until_ready()
    before = max_rss_mb()
    for i in range(500, 10_000):
        step(x, keys[i]).block_until_ready()  # one program in flight at a time
    growth = max_rss_mb() - before
    print(f"peak RSS growth over 9,500 calls: {growth:.1f} MB")
    assert growth < 64, growth
