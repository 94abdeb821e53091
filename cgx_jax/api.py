"""Public entry points: ``compressed_psum``/``compressed_pmean`` over arrays and pytrees, and
``quantize``/``dequantize`` of single arrays.

A pytree is reduced in groups: the leaves that share a codec are flattened into one f32
buffer (each leaf padded to whole buckets, so no bucket mixes two layers) and go through one
set of collectives; the leaves left exact go through one ``lax.psum``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cgx_jax import jax_backend, kernels
from cgx_jax.codec import Codec, padded_length, packet_bytes
from cgx_jax.collectives import (ALGORITHM_FUNCTIONS, ALGORITHMS, hierarchical_reduce,
                                 num_phases, padding_multiple, resolve_algorithm)
from cgx_jax.policy import LayerPolicy, is_compressible, path_name

BACKENDS = {"ffi": kernels, "jax": jax_backend}


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------

def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _check_codec(codec) -> None:
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a cgx_jax.Codec, got {codec!r} of type {type(codec).__name__}")


def _seed_bits(key, name: str = "key"):
    """uint32[2] from a JAX PRNG key (typed ``jax.random.key`` or legacy ``PRNGKey``)."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.bits(key, (2,), jnp.uint32)
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.bits(key, (2,), jnp.uint32)
    raise TypeError(
        f"{name} must be a JAX PRNG key (jax.random.key(0) or jax.random.PRNGKey(0)), got "
        f"{key!r:.80} of type {type(key).__name__}")


def _fold(key, *data):
    for d in data:
        key = jax.random.fold_in(key, d)
    return key


def _axis_size(axis_name, argument: str = "axis_name") -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"{argument} {axis_name!r} is not bound here: call compressed_psum inside "
            f"jax.pmap(..., axis_name=...) or jax.shard_map over a mesh with that axis ({err})"
        ) from None


def _axis_tuple(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _check_inner_axis(axis_name, inner_axis_name) -> int:
    """The size of the inner axis; ValueError when it is unbound or overlaps ``axis_name``."""
    shared = set(_axis_tuple(axis_name)) & set(_axis_tuple(inner_axis_name))
    if shared:
        raise ValueError(
            f"inner_axis_name {inner_axis_name!r} must differ from axis_name {axis_name!r} "
            f"(both name {sorted(map(str, shared))}): the inner axis is reduced exactly and "
            f"the outer one compressed, each device belongs to one of each")
    return _axis_size(inner_axis_name, "inner_axis_name")


# ---------------------------------------------------------------------------
# quantize / dequantize of one array
# ---------------------------------------------------------------------------

def quantize(x, codec: Codec, key=None, *, backend: str = "ffi"):
    """Encodes a floating array (any shape, f32/bf16/f16) as one ``uint8`` packet.

    The flattened array is padded to whole buckets by repeating its last value. Stochastic
    rounding needs ``key``.

    Example:
        >>> import cgx_jax as cgx, jax, jax.numpy as jnp
        >>> codec = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")
        >>> packet = cgx.quantize(jnp.linspace(-1, 1, 100), codec)
        >>> packet.shape, packet.dtype
        ((80,), dtype('uint8'))
    """
    _check_codec(codec)
    _check_choice("backend", backend, BACKENDS)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float64:
        raise TypeError(f"x must be a float32, bfloat16 or float16 array, got dtype {x.dtype}")
    seed = _rounding_seed(codec, key)
    flat = _pad_to(x.reshape(-1), codec.bucket_size)
    return BACKENDS[backend].quantize_rows(flat.reshape(1, -1), seed, codec)[0]


def dequantize(packets, codec: Codec, shape, dtype=jnp.float32, *, backend: str = "ffi"):
    """Decodes a packet made by ``quantize`` back into an array of ``shape`` and ``dtype``.

    Example:
        >>> import cgx_jax as cgx, jax.numpy as jnp
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> x = jnp.linspace(-1, 1, 100)
        >>> y = cgx.dequantize(cgx.quantize(x, codec), codec, x.shape)
        >>> bool(jnp.max(jnp.abs(x - y)) <= 2 / 255 / 2 + 1e-7)
        True
    """
    _check_codec(codec)
    _check_choice("backend", backend, BACKENDS)
    shape = tuple(shape)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    n = int(np.prod(shape, dtype=np.int64))
    padded = padded_length(n, codec.bucket_size)
    expected = packet_bytes(padded, codec)
    packets = jnp.asarray(packets)
    if packets.dtype != jnp.uint8 or packets.shape != (expected,):
        raise ValueError(
            f"packets must be uint8[{expected}] for shape {shape} and {codec}, got "
            f"{packets.dtype}{list(packets.shape)}")
    if padded == 0:
        return jnp.zeros(shape, dtype)
    values = BACKENDS[backend].dequantize_rows(packets.reshape(1, -1), codec, padded, dtype)
    return values.reshape(-1)[:n].reshape(shape)


def _rounding_seed(codec: Codec, key):
    if codec.stochastic:
        if key is None:
            raise ValueError(
                "stochastic rounding needs a PRNG key: pass key=jax.random.key(...) or use "
                "Codec(rounding='nearest')")
        return _seed_bits(key)
    return jnp.zeros((2,), jnp.uint32)


def _pad_to(flat, multiple: int):
    """Pads a 1-D array to a multiple by repeating its last value, so padding never widens a
    bucket's range (and a constant tensor stays exact)."""
    n = flat.shape[0]
    extra = padded_length(n, multiple) - n
    if extra == 0 or n == 0:
        return flat
    return jnp.concatenate([flat, jnp.broadcast_to(flat[-1], (extra,))])


# ---------------------------------------------------------------------------
# The compressed all-reduce of one fused buffer, differentiable as a psum
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    axis_name: Hashable
    codec: Codec
    algorithm: str
    backend: str
    num_participants: int
    local_error: bool
    inner_axis_name: Hashable = None

    @property
    def all_axes(self):
        if self.inner_axis_name is None:
            return self.axis_name
        return _axis_tuple(self.axis_name) + _axis_tuple(self.inner_axis_name)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _allreduce_buffer(buf, seeds, plan: _Plan):
    """(f32 sum, local compression error or an empty array)."""
    index = lax.axis_index(plan.axis_name)
    if plan.inner_axis_name is None:
        reduce = ALGORITHM_FUNCTIONS[plan.algorithm]
        total, error = reduce(buf, plan.axis_name, index, plan.num_participants, seeds,
                              plan.codec, BACKENDS[plan.backend], local_error=plan.local_error)
    else:
        total, error = hierarchical_reduce(
            buf, plan.axis_name, plan.inner_axis_name, index, plan.num_participants, seeds,
            plan.codec, BACKENDS[plan.backend], plan.algorithm, local_error=plan.local_error)
    return total, (jnp.zeros((0,), jnp.float32) if error is None else error)


@_allreduce_buffer.defjvp
def _allreduce_buffer_jvp(plan, primals, tangents):
    # Straight-through: the derivative of a (compressed) sum is the exact sum of tangents,
    # whose transpose is again a psum, so jax.grad works through compressed_psum.
    buf, seeds = primals
    total, error = _allreduce_buffer(buf, seeds, plan)
    # Under shard_map both are typed invariant over the reduced axes (the algorithms end in
    # an invariant gather), so jax.grad of a per-participant loss counts it once, as for psum.
    tangent = lax.psum(tangents[0], plan.all_axes)
    return (total, error), (tangent, jnp.zeros_like(error))


# ---------------------------------------------------------------------------
# compressed_psum / compressed_pmean
# ---------------------------------------------------------------------------

def _reduce_tree(x, axis_name, *, codec, policy, key, algorithm, backend, mean,
                 local_error=False, inner_axis_name=None):
    """The compressed all-reduce of a pytree; with ``local_error`` also the tree of what this
    participant's own compression lost (f32 leaves of the input's shapes, zero where exact)."""
    _check_choice("algorithm", algorithm, ALGORITHMS)
    _check_choice("backend", backend, BACKENDS)
    if codec is not None and policy is not None:
        raise ValueError("pass codec= or policy=, not both")
    if codec is not None:
        _check_codec(codec)
    elif policy is None:
        policy = LayerPolicy()
    elif not isinstance(policy, LayerPolicy):
        raise TypeError(f"policy must be a cgx_jax.LayerPolicy, got {type(policy).__name__}")
    num_participants = _axis_size(axis_name)
    inner_size = 1 if inner_axis_name is None else _check_inner_axis(axis_name, inner_axis_name)
    algorithm = resolve_algorithm(algorithm, num_participants)
    all_axes = (axis_name if inner_axis_name is None
                else _axis_tuple(axis_name) + _axis_tuple(inner_axis_name))

    flat_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [jnp.asarray(leaf) for _, leaf in flat_with_paths]
    if codec is not None:
        codecs = [codec if is_compressible(leaf) else None for leaf in leaves]
    else:
        codecs = policy.resolve_leaves(jax.tree_util.tree_unflatten(treedef, leaves))
    groups: dict[Codec, list[int]] = {}
    for i, (c, leaf) in enumerate(zip(codecs, leaves)):
        if c is not None and leaf.size > 0:
            groups.setdefault(c, []).append(i)
    exact = [i for i in range(len(leaves)) if all(i not in g for g in groups.values())]

    if any(c.stochastic for c in groups) and key is None:
        paths = [path_name(p) for p, _ in flat_with_paths]
        stochastic = [paths[i] for c, g in groups.items() if c.stochastic for i in g]
        raise ValueError(
            "stochastic rounding needs a PRNG key: pass key=jax.random.key(...) (a fresh one "
            "each step) or use Codec(rounding='nearest'); leaves rounded stochastically: "
            f"{stochastic[:8]}")
    if key is not None and groups:
        _seed_bits(key)  # validates the key type before it is folded
        index = lax.axis_index(axis_name)
        if inner_axis_name is not None:  # one noise stream per device
            index = index * inner_size + lax.axis_index(inner_axis_name)

    out = list(leaves)
    errors = [jnp.zeros(leaf.shape, jnp.float32) for leaf in leaves] if local_error else None
    if exact:
        reduce_exact = lax.pmean if mean else lax.psum
        for i, value in zip(exact, reduce_exact([leaves[i] for i in exact], all_axes)):
            out[i] = value
    for group_number, (group_codec, members) in enumerate(groups.items()):
        plan = _Plan(axis_name, group_codec, algorithm, backend, num_participants, local_error,
                     inner_axis_name)
        phases = num_phases(algorithm, num_participants)
        if group_codec.stochastic:
            group_key = _fold(key, group_number, index)
            seeds = jnp.stack([_seed_bits(_fold(group_key, phase)) for phase in range(phases)])
        else:
            seeds = jnp.zeros((phases, 2), jnp.uint32)
        pieces = [_pad_to(leaves[i].reshape(-1).astype(jnp.float32), group_codec.bucket_size)
                  for i in members]
        buf = _pad_to(jnp.concatenate(pieces),
                      inner_size * padding_multiple(algorithm, group_codec, num_participants))
        total, error = _allreduce_buffer(buf, seeds, plan)
        if mean:
            total = total / jnp.float32(num_participants * inner_size)
        offset = 0
        for i, piece in zip(members, pieces):
            leaf = leaves[i]
            out[i] = total[offset:offset + leaf.size].reshape(leaf.shape).astype(leaf.dtype)
            if local_error:
                errors[i] = error[offset:offset + leaf.size].reshape(leaf.shape)
            offset += piece.shape[0]
    result = jax.tree_util.tree_unflatten(treedef, out)
    if local_error:
        return result, jax.tree_util.tree_unflatten(treedef, errors)
    return result


def compressed_psum(x, axis_name, *, codec: Codec | None = None,
                    policy: LayerPolicy | None = None, key=None, algorithm: str = "auto",
                    inner_axis_name=None, backend: str = "ffi") -> Any:
    """``lax.psum`` whose floating leaves travel as 1-8-bit quantized buckets (CGX).

    Call it inside ``jax.pmap``/``jax.shard_map`` with ``axis_name`` bound (a name or a tuple
    of mesh axes reduced as one group). ``codec=`` compresses every floating leaf with one
    codec; ``policy=`` decides per leaf; neither means ``LayerPolicy()`` (small, 1-D and
    non-floating leaves exact). Exact leaves go through ``lax.psum``. The output has the
    input's structure, shapes and dtypes; sums accumulate in f32. Stochastic rounding needs
    ``key`` (fold in the step; replicas' noise is made independent inside). Under
    ``jax.grad`` it acts as an exact ``psum`` (straight-through estimator).

    ``algorithm`` (every one gives bitwise-identical results on all replicas):

    - ``"sra"``: scatter-reduce-allgather; each value quantized twice, ``2(N-1)/N``
      packets of traffic.
    - ``"allgather"``: quantize once, gather all packets; ``N-1`` packets of traffic.
    - ``"ring"``: ``N-1`` ``ppermute`` hops re-encoding partial sums, then a gather; as many
      bytes as SRA, but each value is quantized up to N times, so the error bound grows
      with N (about N/2 times SRA's; see ``cgx_jax.collectives.ring_reduce``).
    - ``"auto"`` (default): ``"allgather"`` for N <= 2 (same bytes as SRA, one quantization
      instead of two, one collective instead of two: faster and more accurate in the
      README's 2-process benchmark), ``"sra"`` otherwise.

    ``inner_axis_name`` (hierarchical reduction, for example devices of one host): the sum
    runs over ``axis_name`` and ``inner_axis_name`` together: an exact reduce-scatter
    (``lax.psum_scatter``; on CPU a ``psum``, see ``cgx_jax.collectives.hierarchical_reduce``)
    over the fast inner axis, the compressed ``algorithm`` over the outer ``axis_name`` on
    each scattered piece (N is the outer size), an exact ``lax.all_gather`` over the inner
    axis. The result is the compressed outer reduction of the exact inner sums.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, cgx_jax as cgx
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
        >>> codec = cgx.Codec(bits=8, bucket_size=256, rounding="nearest")
        >>> f = jax.shard_map(lambda g: cgx.compressed_psum(g, "batch", codec=codec),
        ...                   mesh=mesh, in_specs=P(), out_specs=P())
        >>> f(jnp.ones((4, 256))).shape
        (4, 256)
    """
    return _reduce_tree(x, axis_name, codec=codec, policy=policy, key=key,
                        algorithm=algorithm, backend=backend, mean=False,
                        inner_axis_name=inner_axis_name)


def compressed_pmean(x, axis_name, *, codec: Codec | None = None,
                     policy: LayerPolicy | None = None, key=None, algorithm: str = "auto",
                     inner_axis_name=None, backend: str = "ffi") -> Any:
    """``compressed_psum`` divided by the number of participants (``lax.pmean`` for exact
    leaves); same arguments. With ``inner_axis_name`` it divides by the total count, inner
    size times outer size.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: cgx.compressed_pmean(g, "i", codec=codec), axis_name="i")
        >>> f(jnp.ones((1, 64)))[0, :3]
        Array([1., 1., 1.], dtype=float32)
    """
    return _reduce_tree(x, axis_name, codec=codec, policy=policy, key=key,
                        algorithm=algorithm, backend=backend, mean=True,
                        inner_axis_name=inner_axis_name)
