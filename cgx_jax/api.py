"""Public entry points: ``compressed_psum``/``compressed_pmean`` over arrays and pytrees, and
``quantize``/``dequantize`` of single arrays (docs/design.md section 6).

``reduce_tree`` composes the pieces: the policy picks a codec per leaf
(``cgx_jax.policy``), leaves sharing a codec are fused into one group of segments
(``cgx_jax.fusion``), the segments of all groups go through one compressed all-reduce
(``cgx_jax.collectives``; the ring and the hierarchical reduction: one per group), each
group with its own noise (``cgx_jax.seeds``), and the exact leaves go through one fused
``lax.psum``.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cgx_jax import fusion, memory
from cgx_jax.backends import BACKENDS, get_backend
from cgx_jax.codec import Codec, packet_bytes, pad_to_multiple, padded_length
from cgx_jax.collectives import (
    ALGORITHMS,
    Plan,
    allreduce_segments,
    axis_tuple,
    num_phases,
    padding_multiple,
    resolve_algorithm,
    segment_rows,
)
from cgx_jax.consistency import check_processes_agree, installed_version
from cgx_jax.policy import LayerPolicy, is_compressible, path_name
from cgx_jax.seeds import phase_seeds, rounding_seed, seed_bits
from cgx_jax.validation import check_choice, check_codec
from cgx_jax.vma import check_local

# ---------------------------------------------------------------------------
# Axes
# ---------------------------------------------------------------------------

def _axis_size(axis_name, argument: str = "axis_name") -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(
            f"{argument} {axis_name!r} is not bound here: call compressed_psum inside "
            f"jax.pmap(..., axis_name=...) or jax.shard_map over a mesh with that axis ({err}). "
            f"Under plain jax.jit with sharded arrays XLA reduces gradients itself: wrap the "
            f"gradient and update in jax.shard_map (the README's 'Use' section)"
        ) from None


def _check_inner_axis(axis_name, inner_axis_name) -> int:
    """The size of the inner axis; ValueError when it is unbound or overlaps ``axis_name``."""
    shared = set(axis_tuple(axis_name)) & set(axis_tuple(inner_axis_name))
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

def reduce_tree(x, axis_name, *, codec=None, policy=None, key=None, algorithm="auto",
                backend="ffi", mean=False, local_error=False, inner_axis_name=None,
                leaf_codecs=None):
    """The compressed all-reduce of a pytree (``compressed_psum``, or ``compressed_pmean``
    with ``mean``); with ``local_error`` also the tree of what this participant's own
    compression lost (f32 leaves of the input's shapes, zero where exact), for error
    feedback. ``leaf_codecs``: the codecs ``policy`` chose per leaf (``tree_leaves`` order),
    when it decided on other shapes than these (the whole parameter of a shard).

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> from cgx_jax.api import reduce_tree
        >>> codec = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: reduce_tree(g, "i", codec=codec, local_error=True),
        ...              axis_name="i")
        >>> total, lost = f({"w": jnp.ones((1, 64))})
        >>> float(total["w"][0, 0]), float(lost["w"][0, 0])
        (1.0, 0.0)
    """
    check_choice("algorithm", algorithm, ALGORITHMS)
    check_choice("backend", backend, BACKENDS)
    if codec is not None and policy is not None:
        raise ValueError("pass codec= or policy=, not both")
    if codec is not None:
        check_codec(codec)
    elif policy is None:
        policy = LayerPolicy()
    elif not isinstance(policy, LayerPolicy):
        raise TypeError(f"policy must be a cgx_jax.LayerPolicy, got {type(policy).__name__}")
    num_participants = _axis_size(axis_name)
    inner_size = 1 if inner_axis_name is None else _check_inner_axis(axis_name, inner_axis_name)
    algorithm = resolve_algorithm(algorithm, num_participants)

    flat_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [jnp.asarray(leaf) for _, leaf in flat_with_paths]
    all_axes = (axis_name if inner_axis_name is None
                else axis_tuple(axis_name) + axis_tuple(inner_axis_name))
    check_local(leaves, all_axes, [path_name(p) for p, _ in flat_with_paths])
    if codec is not None:
        codecs = [codec if is_compressible(leaf) else None for leaf in leaves]
    elif leaf_codecs is not None:
        codecs = list(leaf_codecs)
    else:
        codecs = policy.resolve_leaves(jax.tree_util.tree_unflatten(treedef, leaves))
    groups, exact = fusion.group_by_codec(leaves, codecs)
    if groups:
        memory.keep_freed_memory_on_cpu()  # reuse warm host pages step to step (memory.py)
    elif codec is None and leaf_codecs is None and policy.default is not None:
        warn_nothing_compressed(policy, leaves)

    if any(c.stochastic for c in groups) and key is None:
        paths = [path_name(p) for p, _ in flat_with_paths]
        stochastic = [paths[i] for c, g in groups.items() if c.stochastic for i in g]
        raise ValueError(
            "stochastic rounding needs a PRNG key: pass key=jax.random.key(...) (a fresh one "
            "each step) or use Codec(rounding='nearest'); leaves rounded stochastically: "
            f"{stochastic[:8]}")
    participant = None
    if key is not None and groups:
        seed_bits(key)  # validates the key type before it is folded
        participant = lax.axis_index(axis_name)
        if inner_axis_name is not None:  # one noise stream per device
            participant = participant * inner_size + lax.axis_index(inner_axis_name)

    out = list(leaves)
    errors = [jnp.zeros(leaf.shape, jnp.float32) for leaf in leaves] if local_error else None
    if exact:
        reduce_exact = lax.pmean if mean else lax.psum
        for i, value in zip(exact, fusion.reduce_exact(reduce_exact, [leaves[i] for i in exact],
                                                       all_axes)):
            out[i] = value
    # Each codec group is split into segments with their own seeds. SRA and all-gather then
    # carry the segments of all groups in one set of collectives (an adaptive policy's
    # several bit widths add no latency); the ring and the hierarchical reduction reduce each
    # group's one segment on its own.
    rows = segment_rows(algorithm, num_participants, hierarchical=inner_axis_name is not None)
    segments, codecs, bufs, lengths, seeds = [], [], [], [], []
    for group_number, (group_codec, members) in enumerate(groups.items()):
        multiple = inner_size * padding_multiple(algorithm, group_codec, num_participants)
        group_segments = [[members[j] for j in segment] for segment in fusion.split_segments(
            [leaves[i].size for i in members], multiple, rows)]
        seeds.append(phase_seeds(key if group_codec.stochastic else None, group_number,
                                 participant, len(group_segments),
                                 num_phases(algorithm, num_participants)))
        for segment in group_segments:
            buf, length = fusion.pack([leaves[i] for i in segment], group_codec.bucket_size,
                                      multiple, rows)
            segments.append(segment)
            codecs.append(group_codec)
            bufs.append(buf)
            lengths.append(length)
    seeds = jnp.concatenate(seeds) if seeds else None
    check_processes_agree(_wire_settings(leaves, exact, segments, codecs, bufs, algorithm,
                                         num_participants, inner_size, mean))
    batches = ([range(len(segments))] if rows is not None and segments
               else [range(s, s + 1) for s in range(len(segments))])
    for batch in batches:
        plan = Plan(axis_name, tuple(codecs[s] for s in batch), algorithm, backend,
                    num_participants, local_error, inner_axis_name,
                    divisor=num_participants * inner_size if mean else 1)
        totals, batch_errors = allreduce_segments(
            [bufs[s] for s in batch], seeds[batch.start:batch.stop], plan,
            tuple(lengths[s] for s in batch))
        for s, total, error in zip(batch, totals, batch_errors):
            shapes = [leaves[i].shape for i in segments[s]]
            bucket_size = codecs[s].bucket_size
            for i, value in zip(segments[s], fusion.unpack(total, shapes, bucket_size)):
                out[i] = value.astype(leaves[i].dtype)
            if local_error:
                for i, lost in zip(segments[s], fusion.unpack(error, shapes, bucket_size)):
                    errors[i] = lost
    result = jax.tree_util.tree_unflatten(treedef, out)
    if local_error:
        return result, jax.tree_util.tree_unflatten(treedef, errors)
    return result


def _wire_settings(leaves, exact, segments, codecs, bufs, algorithm, num_participants,
                   inner_size, mean) -> dict:
    """What shapes this all-reduce's traffic, for ``check_processes_agree``."""
    return {
        "cgx_jax version": installed_version(),
        "algorithm": algorithm,
        "participants (outer, inner)": [num_participants, inner_size],
        "mean": mean,
        "leaves": [f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves],
        "exact leaves": [int(i) for i in exact],
        "segments (codec, leaves, values)": [
            [repr(codec), [int(i) for i in segment], int(buf.size)]
            for codec, segment, buf in zip(codecs, segments, bufs)],
    }


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
