"""Public entry points: ``compressed_psum``/``compressed_pmean`` over arrays and pytrees, and
``quantize``/``dequantize`` of single arrays (docs/design.md section 6).

``reduce_leaves`` is the core every entry point shares: it checks the call, asks
``cgx_jax._src.reduction`` for a plan (which leaves are exact, how the others are fused into
segments), checks that the processes agree on it (``cgx_jax._src.consistency``) and runs it.
``reduce_tree`` and ``reduce_tree_with_residual`` pick each leaf's codec first (``codec=`` or a
``cgx_jax._src.policy.LayerPolicy``).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.axes import axis_size, axis_tuple, inner_axis_size
from cgx_jax._src.backends import BACKENDS, get_backend
from cgx_jax._src.codec import Codec, packet_bytes, pad_to_multiple, padded_length
from cgx_jax._src.collectives import ALGORITHMS, resolve_algorithm
from cgx_jax._src.consistency import check_processes_agree
from cgx_jax._src.policy import (
    LayerPolicy,
    check_policy,
    choose_codecs,
    is_compressible,
    path_name,
)
from cgx_jax._src.reduction import plan_reduction, run_plan
from cgx_jax._src.seeds import PASS_A_KEY, need_key, rounding_seed, seed_bits
from cgx_jax._src.validation import check_choice, check_codec
from cgx_jax._src.vma import check_local

# ---------------------------------------------------------------------------
# quantize / dequantize of one array
# ---------------------------------------------------------------------------

def quantize(x, codec: Codec, key=None, *, backend: str = "ffi"):
    """Encodes a floating array (any shape, f32/bf16/f16) as one ``uint8`` packet.

    The flattened array is padded to whole buckets by repeating its last value. Stochastic
    rounding needs ``key``.

    Args:
      x: a floating array (f32, bf16 or f16) of any shape.
      codec: the ``Codec`` (bits, bucket size, rounding).
      key: PRNG key of the noise; required with stochastic rounding.
      backend: ``"ffi"`` or ``"jax"``.

    Returns:
      A ``uint8`` array of ``cgx.wire_bytes(x.size, codec)`` bytes.

    Raises:
      TypeError: a non-floating ``x``.
      ValueError: stochastic rounding without ``key``.

    Example:
        >>> import cgx_jax as cgx, jax, jax.numpy as jnp
        >>> codec = cgx.Codec(bits=4, bucket_size=64, rounding="nearest")
        >>> packet = cgx.quantize(jnp.linspace(-1, 1, 100), codec)
        >>> packet.shape, packet.dtype
        ((80,), dtype('uint8'))
    """
    check_codec(codec)
    implementation = get_backend(backend)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float64:
        raise TypeError(f"x must be a float32, bfloat16 or float16 array, got dtype {x.dtype}")
    seed = rounding_seed(codec, key)
    flat = pad_to_multiple(x.reshape(-1), codec.bucket_size)
    return implementation.quantize_rows(flat.reshape(1, -1), seed, codec)[0]


def dequantize(packets, codec: Codec, shape, dtype=jnp.float32, *, backend: str = "ffi"):
    """Decodes a packet made by ``quantize`` back into an array of ``shape`` and ``dtype``.

    Args:
      packets: the ``uint8`` packet ``quantize`` returned.
      codec: the codec it was encoded with.
      shape: the shape of the encoded array.
      dtype: the dtype to decode into (default f32).
      backend: ``"ffi"`` or ``"jax"``.

    Returns:
      An array of ``shape`` and ``dtype``.

    Raises:
      ValueError: a packet whose size does not match ``shape`` and ``codec``.

    Example:
        >>> import cgx_jax as cgx, jax.numpy as jnp
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> x = jnp.linspace(-1, 1, 100)
        >>> y = cgx.dequantize(cgx.quantize(x, codec), codec, x.shape)
        >>> bool(jnp.max(jnp.abs(x - y)) <= 2 / 255 / 2 + 1e-7)
        True
    """
    check_codec(codec)
    implementation = get_backend(backend)
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
    values = implementation.dequantize_rows(packets.reshape(1, -1), codec, padded, dtype)
    return values.reshape(-1)[:n].reshape(shape)


# ---------------------------------------------------------------------------
# compressed_psum / compressed_pmean
# ---------------------------------------------------------------------------

def reduce_leaves(leaves, codecs, axis_name, *, key=None, algorithm="auto", backend="ffi",
                  mean=False, inner_axis_name=None, with_residual=False, paths=None):
    """The compressed all-reduce of ``leaves`` (a list of arrays), each with its codec in
    ``codecs`` (None: exact, through one fused ``lax.psum``), over ``axis_name`` (and
    ``inner_axis_name``) -> ``(reduced leaves, residual)``: ``residual`` (with
    ``with_residual``, for error feedback) what this participant's own compression lost of
    each leaf (f32, zero for exact leaves), else None. The core that ``compressed_psum``,
    ``compressed_allreduce`` and ``value_and_grad`` share: checks the axes and leaves, plans
    (``reduction.plan_reduction``), checks that the processes agree on the plan, runs it.
    ``paths`` name the leaves in errors.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: reduce_leaves([g], [codec], "i", with_residual=True),
        ...              axis_name="i")
        >>> (total,), (residual,) = f(jnp.ones((1, 64)))
        >>> float(total[0, 0]), float(residual[0, 0])
        (1.0, 0.0)
    """
    check_choice("algorithm", algorithm, ALGORITHMS)
    check_choice("backend", backend, BACKENDS)
    num_participants = axis_size(axis_name)
    inner_size = 1 if inner_axis_name is None else inner_axis_size(axis_name, inner_axis_name)
    paths = [f"leaf {i}" for i in range(len(leaves))] if paths is None else list(paths)
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    all_axes = (axis_name if inner_axis_name is None
                else axis_tuple(axis_name) + axis_tuple(inner_axis_name))
    check_local(leaves, all_axes, paths)
    plan = plan_reduction(leaves, codecs, algorithm=resolve_algorithm(algorithm, num_participants),
                          num_participants=num_participants, inner_size=inner_size, mean=mean)
    need_key([s.codec for s in plan.segments for _ in s.leaves],
             key, [paths[i] for s in plan.segments for i in s.leaves], "cgx.compressed_psum",
             PASS_A_KEY + ", or let cgx.compressed_allreduce (which keeps and splits a key in "
             "its state) or cgx.value_and_grad(..., step=...) manage it")
    if key is not None and plan.segments:
        seed_bits(key)  # validates the key type before it is folded
    check_processes_agree(plan.wire_settings())
    return run_plan(plan, leaves, axis_name, key=key, backend=backend,
                    inner_axis_name=inner_axis_name, with_residual=with_residual)


def _tree_codecs(leaves, treedef, codec, policy) -> list:
    """Each leaf's codec (``policy.choose_codecs``); warns when a policy compresses nothing."""
    codecs = choose_codecs(leaves, treedef, codec=codec, policy=policy)
    policy = check_policy(policy)
    if codec is None and policy.default is not None and not any(
            c is not None and leaf.size for c, leaf in zip(codecs, leaves)):
        warn_nothing_compressed(policy, leaves)
    return codecs


def _reduce_tree(x, axis_name, *, codec, policy, with_residual, **settings):
    flat_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [jnp.asarray(leaf) for _, leaf in flat_with_paths]
    codecs = _tree_codecs(leaves, treedef, codec, policy)
    out, residual = reduce_leaves(leaves, codecs, axis_name, with_residual=with_residual,
                              paths=[path_name(p) for p, _ in flat_with_paths], **settings)
    result = jax.tree_util.tree_unflatten(treedef, out)
    return (result, jax.tree_util.tree_unflatten(treedef, residual)) if with_residual else result


def reduce_tree(x, axis_name, *, codec=None, policy=None, key=None, algorithm="auto",
                backend="ffi", mean=False, inner_axis_name=None):
    """The compressed all-reduce of a pytree (``compressed_psum``, or ``compressed_pmean``
    with ``mean``): each leaf's codec from ``codec`` or ``policy``, then ``reduce_leaves``.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: reduce_tree(g, "i", codec=codec), axis_name="i")
        >>> float(f({"w": jnp.ones((1, 64))})["w"][0, 0])
        1.0
    """
    return _reduce_tree(x, axis_name, codec=codec, policy=policy, with_residual=False, key=key,
                        algorithm=algorithm, backend=backend, mean=mean,
                        inner_axis_name=inner_axis_name)


def reduce_tree_with_residual(x, axis_name, *, codec=None, policy=None, key=None,
                          algorithm="auto", backend="ffi", mean=False, inner_axis_name=None):
    """``reduce_tree`` and the tree of what this participant's own compression lost (f32
    leaves of the input's shapes, zero where exact): error feedback's next residual.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: reduce_tree_with_residual(g, "i", codec=codec), axis_name="i")
        >>> total, residual = f({"w": jnp.ones((1, 64))})
        >>> float(total["w"][0, 0]), float(residual["w"][0, 0])
        (1.0, 0.0)
    """
    return _reduce_tree(x, axis_name, codec=codec, policy=policy, with_residual=True, key=key,
                        algorithm=algorithm, backend=backend, mean=mean,
                        inner_axis_name=inner_axis_name)


def warn_nothing_compressed(policy: LayerPolicy, leaves) -> None:
    """Warns (at trace time) when the policy leaves every floating leaf exact: the caller
    asked for a compressed all-reduce and would otherwise get an exact one without a word
    (a flat 1-D gradient buffer under the default policy, a model of small layers)."""
    floating = [leaf for leaf in leaves if is_compressible(leaf) and leaf.size]
    if not floating:
        return
    largest = max(floating, key=lambda leaf: leaf.size)
    warnings.warn(
        f"cgx: no leaf is compressed, so this all-reduce is exact: every floating leaf "
        f"({len(floating)} of them, the largest of shape {tuple(largest.shape)}) has fewer than "
        f"min_ndim={policy.min_ndim} dimensions or min_size={policy.min_size} values under "
        f"the policy, or is excluded. Pass codec=cgx.Codec() to compress every floating "
        f"leaf, or a cgx.LayerPolicy with a lower min_size or min_ndim.",
        UserWarning, stacklevel=4)


def compressed_psum(x, axis_name, *, codec: Codec | None = None,
                    policy: LayerPolicy | None = None, key=None, algorithm: str = "auto",
                    inner_axis_name=None, backend: str = "ffi") -> Any:
    """``lax.psum`` whose floating leaves travel as 1-8-bit quantized buckets (CGX).

    Call it inside ``jax.pmap``/``jax.shard_map`` with ``axis_name`` bound (a name or a tuple
    of mesh axes reduced as one group). ``codec=`` compresses every floating leaf with one
    codec; ``policy=`` decides per leaf; neither means ``LayerPolicy()`` (small, 1-D and
    non-floating leaves exact: a flat 1-D array needs ``codec=``; a call in which the policy
    compresses no leaf warns). Exact leaves go through ``lax.psum``. The output has the
    input's structure, shapes and dtypes; sums accumulate in f32. Stochastic rounding needs
    ``key`` (fold in the step; replicas' noise is made independent inside). Under
    ``jax.grad`` it acts as an exact ``psum`` (straight-through estimator).

    ``algorithm`` (every one gives bitwise-identical results on all replicas):

    - ``"sra"``: scatter-reduce-allgather; each value quantized twice, ``2(N-1)/N``
      packets of traffic.
    - ``"allgather"``: quantize once, gather all packets; ``N-1`` packets of traffic.
    - ``"ring"``: ``N-1`` ``ppermute`` hops re-encoding partial sums, then a gather; as many
      bytes as SRA, but each value is quantized up to N times, so the error bound grows
      with N (about N/2 times SRA's; docs/design.md section 4).
    - ``"auto"`` (default): ``"allgather"`` for N <= 2 (same bytes as SRA, one quantization
      instead of two, one collective instead of two), ``"sra"`` otherwise.

    ``inner_axis_name`` (hierarchical reduction, for example devices of one host): the sum
    runs over ``axis_name`` and ``inner_axis_name`` together: an exact reduce-scatter
    (``lax.psum_scatter``; on CPU a ``psum``, docs/design.md section 5)
    over the fast inner axis, the compressed ``algorithm`` over the outer ``axis_name`` on
    each scattered piece (N is the outer size), an exact ``lax.all_gather`` over the inner
    axis. The result is the compressed outer reduction of the exact inner sums.

    Args:
      x: a pytree of arrays (each participant's values).
      axis_name: the bound axis to sum over, or a tuple of mesh axes summed as one group.
      codec: one ``Codec`` for every floating leaf (exclusive with ``policy``).
      policy: a ``LayerPolicy`` choosing each leaf's codec (default ``LayerPolicy()``).
      key: PRNG key of the stochastic rounding noise; required when a codec rounds
        stochastically.
      algorithm: ``"auto"``, ``"sra"``, ``"allgather"`` or ``"ring"`` (above).
      inner_axis_name: a fast inner axis for the hierarchical reduction (above).
      backend: ``"ffi"`` (the C++/CUDA kernels) or ``"jax"`` (the same format in jnp).

    Returns:
      The sum over participants: ``x``'s structure, shapes and dtypes, bitwise identical
      on every participant.

    Raises:
      ValueError: a bad algorithm or axis; a stochastic codec without ``key``.
      TypeError: a ``codec`` or ``policy`` of the wrong type.
      cgx.ProcessesDisagreeError: processes that would send different traffic.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, cgx_jax as cgx
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
        >>> codec = cgx.Codec(bits=8, bucket_size=256, rounding="nearest")
        >>> f = jax.shard_map(lambda g: cgx.compressed_psum(g, "batch", codec=codec),
        ...                   mesh=mesh, in_specs=P("batch"), out_specs=P())
        >>> f(jnp.ones((4, 256))).shape
        (4, 256)
    """
    return reduce_tree(x, axis_name, codec=codec, policy=policy, key=key,
                       algorithm=algorithm, backend=backend, mean=False,
                       inner_axis_name=inner_axis_name)


def compressed_pmean(x, axis_name, *, codec: Codec | None = None,
                     policy: LayerPolicy | None = None, key=None, algorithm: str = "auto",
                     inner_axis_name=None, backend: str = "ffi") -> Any:
    """``compressed_psum`` divided by the number of participants (``lax.pmean`` for exact
    leaves); same arguments. With ``inner_axis_name`` it divides by the total count, inner
    size times outer size.

    Args:
      x, axis_name, codec, policy, key, algorithm, inner_axis_name, backend: as for
        ``compressed_psum``.

    Returns:
      The mean over participants, with ``x``'s structure, shapes and dtypes.

    Raises:
      ValueError: as ``compressed_psum``.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: cgx.compressed_pmean(g, "i", codec=codec), axis_name="i")
        >>> f(jnp.ones((1, 64)))[0, :3]
        Array([1., 1., 1.], dtype=float32)
    """
    return reduce_tree(x, axis_name, codec=codec, policy=policy, key=key,
                       algorithm=algorithm, backend=backend, mean=True,
                       inner_axis_name=inner_axis_name)
