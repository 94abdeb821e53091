"""Compressed collectives for sharded (FSDP) training: ``compressed_all_gather`` and
``compressed_psum_scatter`` (QSDP; docs/design.md section 10).

An FSDP step gathers each weight shard in the forward with ``lax.all_gather`` and autodiff
turns that into a ``lax.psum_scatter`` of the gradient. Here each participant encodes its own
shard once, the packets are gathered and every participant decodes the same bytes (the
all-gather); or it encodes the chunks its peers will own, the packets are exchanged and each
participant sums what it received with its own raw chunk in f32 (the reduce-scatter, one
quantization per value). Only what travels is quantized: the caller's shards, and the
optimizer's master weights, stay full precision.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from cgx_jax import fusion
from cgx_jax.axes import axis_size
from cgx_jax.backends import BACKENDS, get_backend
from cgx_jax.codec import Codec, pad_to_multiple
from cgx_jax.collectives.transport import column_offsets, exchange_rows
from cgx_jax.policy import LayerPolicy, choose_codecs, path_name
from cgx_jax.reduction import plan_reduction
from cgx_jax.seeds import phase_seeds, seed_bits
from cgx_jax.validation import check_choice, check_codec
from cgx_jax.vma import to_local

# Weights travel at 8 bits with nearest rounding (no key needed, error below 0.2% of each
# bucket's range); gradients at the library's default, 4-bit stochastic (unbiased).
WEIGHT_CODEC = Codec(bits=8, rounding="nearest")
GRADIENT_CODEC = Codec()


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------

def _check_common(key, backend):
    check_choice("backend", backend, BACKENDS)
    if key is not None:
        seed_bits(key)  # a TypeError naming the key for anything but a PRNG key


def _leaf_name(path: str) -> str:
    return f"leaf {path!r}" if path else "x"


def _check_axis(leaf, axis: int, extra: int, name: str, path: str) -> int:
    """``axis`` normalized for a leaf of ``leaf.ndim`` dimensions (+ ``extra`` for a new one)."""
    ndim = leaf.ndim + extra
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{name} must be an int in [{-ndim}, {ndim}) for {_leaf_name(path)} "
                         f"of shape {tuple(leaf.shape)}, got {axis!r}")
    return axis % ndim


def _need_key(codecs, key, paths, what: str) -> None:
    stochastic = [p for p, c in zip(paths, codecs) if c is not None and c.stochastic]
    if stochastic and key is None:
        raise ValueError(
            f"{what} rounds stochastically and needs a PRNG key: pass key=jax.random.key(...) "
            f"(a fresh one each step), or a codec with rounding='nearest'; leaves rounded "
            f"stochastically: {stochastic[:8]}")


def _seed(key, number: int, axis_name):
    """This participant's ``uint32[2]`` seed for buffer ``number`` of a call (zeros without a
    key): independent across participants and buffers."""
    participant = None if key is None else lax.axis_index(axis_name)
    return phase_seeds(key, number, participant, 1, 1)[0, 0]


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The static settings of one compressed gather or reduce-scatter (hashable, for
    ``custom_vjp``): ``codecs`` one per compressed leaf; ``grad_codec`` the gather's
    gradient codec (None: exact)."""

    axis_name: Hashable
    num: int
    codecs: tuple[Codec, ...]
    backend: str
    grad_codec: Codec | None = None


# ---------------------------------------------------------------------------
# compressed_all_gather
# ---------------------------------------------------------------------------

def compressed_all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False,
                          codec: Codec | None = None, policy: LayerPolicy | None = None,
                          key=None, grad_codec: Codec | None = GRADIENT_CODEC,
                          backend: str = "ffi"):
    """``lax.all_gather`` whose floating leaves travel quantized: the same shapes and dtypes.

    Each participant encodes its own shard once, the packets are gathered, and every
    participant decodes the same bytes, so all replicas of the result are bitwise identical
    (the own shard too is the decoded one); buckets never straddle two shards. The codecs:
    as in ``compressed_psum``, ``codec=`` for every floating leaf or ``policy=`` per leaf;
    neither means ``LayerPolicy(default=Codec(bits=8, rounding="nearest"))`` (no key needed;
    small, 1-D and non-floating leaves travel exactly through ``lax.all_gather``). Under
    ``jax.grad`` the compressed leaves' cotangent is reduce-scattered with
    ``compressed_psum_scatter`` and ``grad_codec``
    (default 4-bit stochastic: noise from ``key``, folded apart from the forward's) or, with
    ``grad_codec=None``, exactly with ``lax.psum_scatter``. Call it inside ``jax.shard_map``
    (typed as ``lax.all_gather``) or ``jax.pmap``.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> w = jnp.linspace(-1, 1, 128 * 256).reshape(1, 128, 256)  # one shard per device
        >>> full = jax.pmap(lambda w: cgx.compressed_all_gather(w, "data", tiled=True),
        ...                 axis_name="data", devices=jax.devices()[:1])(w)
        >>> full.shape, bool(jnp.max(jnp.abs(full - w)) <= 2 / 255 / 2)
        ((1, 128, 256), True)
    """
    _check_common(key, backend)
    if grad_codec is not None:
        check_codec(grad_codec, "grad_codec")
    num = axis_size(axis_name)
    flat_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [jnp.asarray(leaf) for _, leaf in flat_with_paths]
    paths = [path_name(p) for p, _ in flat_with_paths]
    axes = [_check_axis(leaf, axis, 0 if tiled else 1, "axis", path)
            for leaf, path in zip(leaves, paths)]
    gathered = [_gathered_shape(leaf.shape, a, tiled, num) for leaf, a in zip(leaves, axes)]
    codecs = choose_codecs(leaves, treedef, codec=codec, policy=policy,
                           default=LayerPolicy(default=WEIGHT_CODEC), shapes=gathered)
    _need_key(codecs, key, paths, "compressed_all_gather's codec")
    compressed = [i for i, c in enumerate(codecs) if c is not None and leaves[i].size]
    out = [lax.all_gather(leaf, axis_name, axis=a, tiled=tiled)
           for leaf, a in zip(leaves, axes)]  # exact leaves keep these
    if compressed:
        settings = _Settings(axis_name, num, tuple(codecs[i] for i in compressed), backend,
                             grad_codec)
        stacked = _gather_stacked([leaves[i] for i in compressed], key, settings)
        for i, rows in zip(compressed, stacked):
            out[i] = _place_rows(rows, axes[i], tiled)
    return jax.tree_util.tree_unflatten(treedef, out)


def _gathered_shape(shape, axis: int, tiled: bool, num: int) -> tuple:
    """The shape ``lax.all_gather`` gives a shard of ``shape`` over ``num`` participants."""
    if tiled:
        return shape[:axis] + (shape[axis] * num,) + shape[axis + 1:]
    return shape[:axis] + (num,) + shape[axis:]


def _place_rows(rows, axis: int, tiled: bool):
    """``rows [N, *shape]`` (row k from participant k) laid out as ``lax.all_gather`` lays
    out its result: a new dimension at ``axis``, or (tiled) concatenated along ``axis``."""
    moved = jnp.moveaxis(rows, 0, axis)
    if not tiled:
        return moved
    shape = moved.shape
    return moved.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_stacked(leaves, key, settings: _Settings):
    """``[N, *shape]`` per leaf: every participant's shard, decoded from the gathered
    packets. Planned like the all-gather all-reduce (``reduction.plan_reduction``): leaves
    sharing a codec packed bucket-aligned into segments, a large leaf read in place."""
    backend = get_backend(settings.backend)
    plan = plan_reduction(leaves, list(settings.codecs), algorithm="allgather",
                          num_participants=settings.num)
    packets = []
    for number, segment in enumerate(plan.segments):  # each segment its own noise
        buf, length = fusion.pack([leaves[i] for i in segment.leaves],
                                  segment.codec.bucket_size, segment.multiple, plan.rows)
        seed = _seed(key if segment.codec.stochastic else None, number, settings.axis_name)
        packets.append(backend.quantize_rows(buf, seed, segment.codec, n=length))
    # Plain lax.all_gather, so the result is typed varying as lax.all_gather's is.
    gathered = lax.all_gather(jnp.concatenate(packets, axis=1)[0], settings.axis_name)
    out = [None] * len(leaves)
    for segment, offset in zip(plan.segments, column_offsets(packets)):
        decoded = backend.dequantize_rows(gathered, segment.codec, segment.length, "float32",
                                          offset=offset)
        shapes = [leaves[i].shape for i in segment.leaves]
        rows = jax.vmap(lambda row, s=shapes, b=segment.codec.bucket_size:
                        fusion.unpack(row, s, b))(decoded)
        for i, value in zip(segment.leaves, rows):
            out[i] = value.astype(leaves[i].dtype)
    # Typed varying, as lax.all_gather's result (the kernels' outputs carry no axis type).
    return to_local(out, settings.axis_name)


def _gather_stacked_fwd(leaves, key, settings):
    return _gather_stacked(leaves, key, settings), key


def _gather_stacked_bwd(settings, key, cotangents):
    # The transpose of a gather is a reduce-scatter of the cotangent over the new axis.
    if settings.grad_codec is None:
        grads = [lax.psum_scatter(ct, settings.axis_name, scatter_dimension=0, tiled=False)
                 for ct in cotangents]
    else:
        grad_key = None if key is None else jax.random.fold_in(key, 1)
        grads = compressed_psum_scatter(list(cotangents), settings.axis_name,
                                        codec=settings.grad_codec, key=grad_key,
                                        backend=settings.backend, what="the gradient of "
                                        "compressed_all_gather (grad_codec)")
    return grads, None


_gather_stacked.defvjp(_gather_stacked_fwd, _gather_stacked_bwd)


# ---------------------------------------------------------------------------
# compressed_psum_scatter
# ---------------------------------------------------------------------------

def compressed_psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False,
                            codec: Codec | None = None, policy: LayerPolicy | None = None,
                            key=None, backend: str = "ffi",
                            what: str = "compressed_psum_scatter"):
    """``lax.psum_scatter`` whose floating leaves travel quantized: the same shapes and dtypes.

    Each participant encodes the N-1 chunks its peers will own, the packets are exchanged
    (an all-to-all), and each participant sums, in f32 and in participant order, the chunks
    it received, decoded, and its own chunk, raw: every value is quantized once. The codecs
    as in ``compressed_psum``: ``codec=`` for every floating leaf, ``policy=`` per leaf,
    neither ``LayerPolicy()`` (4-bit stochastic: noise from ``key``, independent per
    participant; small, 1-D and non-floating leaves exact through ``lax.psum_scatter``).
    Under ``jax.grad`` it acts as the exact ``lax.psum_scatter`` (its transpose is the exact
    ``lax.all_gather``: straight-through). Leaves sharing a codec share one exchange.

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> g = jnp.ones((1, 128, 256))  # each device's full gradient
        >>> part = jax.pmap(lambda g: cgx.compressed_psum_scatter(
        ...     g, "data", tiled=True, key=jax.random.key(0)),
        ...     axis_name="data", devices=jax.devices()[:1])(g)
        >>> part.shape, float(part[0, 0, 0])
        ((1, 128, 256), 1.0)
    """
    _check_common(key, backend)
    num = axis_size(axis_name)
    flat_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    leaves = [jnp.asarray(leaf) for _, leaf in flat_with_paths]
    paths = [path_name(p) for p, _ in flat_with_paths]
    dims = [_check_axis(leaf, scatter_dimension, 0, "scatter_dimension", path)
            for leaf, path in zip(leaves, paths)]
    for leaf, dim, path in zip(leaves, dims, paths):
        if leaf.shape[dim] % num if tiled else leaf.shape[dim] != num:
            want = f"a multiple of {num}" if tiled else f"{num}"
            raise ValueError(
                f"scatter_dimension {dim} of {_leaf_name(path)} (shape {tuple(leaf.shape)}) must "
                f"have size {want}, the size of axis {axis_name!r}"
                f"{' (tiled=True)' if tiled else ' (tiled=False: one slice per participant)'}")
    codecs = choose_codecs(leaves, treedef, codec=codec, policy=policy)
    _need_key(codecs, key, paths, what)
    compressed = [i for i, c in enumerate(codecs) if c is not None and leaves[i].size]
    out = [None] * len(leaves)
    for i in range(len(leaves)):
        if i not in compressed:
            out[i] = lax.psum_scatter(leaves[i], axis_name, scatter_dimension=dims[i],
                                      tiled=tiled)
    if compressed:
        rows = [_rows_of(leaves[i], dims[i], num) for i in compressed]
        settings = _Settings(axis_name, num, tuple(codecs[i] for i in compressed), backend)
        for i, value in zip(compressed, _scatter_rows(rows, key, settings)):
            out[i] = _unrows(value, dims[i], tiled)
    return jax.tree_util.tree_unflatten(treedef, out)


def _rows_of(leaf, dim: int, num: int):
    """``leaf`` as ``[N, k, *rest]``: row j the ``k`` slices along ``dim`` participant j owns
    (``k`` = 1 untiled)."""
    moved = jnp.moveaxis(leaf, dim, 0)
    return moved.reshape((num, moved.shape[0] // num) + moved.shape[1:])


def _unrows(value, dim: int, tiled: bool):
    """This participant's ``[k, *rest]`` laid out as ``lax.psum_scatter``'s result: ``k``
    slices back at ``dim`` (tiled), or the one slice with ``dim`` gone."""
    return jnp.moveaxis(value, 0, dim) if tiled else value[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scatter_rows(rows, key, settings: _Settings):
    """Per leaf ``[N, k, *rest]`` -> this participant's ``[k, *rest]``: the f32 sum over
    participants of their row ``index``, peers' rows decoded, the own row raw. Leaves sharing
    a codec are one buffer ``[N, L]`` (each leaf's row padded to whole buckets, so no bucket
    mixes two leaves) and all buffers share one exchange."""
    backend = get_backend(settings.backend)
    num, axis_name = settings.num, settings.axis_name
    index = lax.axis_index(axis_name)
    groups, _ = fusion.group_by_codec(rows, list(settings.codecs))
    bufs, seeds, packets = [], [], []
    for group, (codec, members) in enumerate(groups.items()):
        pad = jax.vmap(lambda row, b=codec.bucket_size: pad_to_multiple(row, b))
        buf = jnp.concatenate([pad(rows[i].reshape(num, -1).astype(jnp.float32))
                               for i in members], axis=1)
        seed = _seed(key if codec.stochastic else None, group, axis_name)
        # The own row is summed raw, so it is not encoded (zero bytes on the wire).
        packets.append(backend.quantize_rows(buf, seed, codec, skip_row=index))
        bufs.append(buf)
        seeds.append(seed)
    received = exchange_rows(jnp.concatenate(packets, axis=1), axis_name, index, num)
    out = [None] * len(rows)
    for (codec, members), buf, seed, offset in zip(groups.items(), bufs, seeds,
                                                   column_offsets(packets)):
        _, total = backend.reduce_requantize(received, buf, index, seed, codec, buf.shape[1],
                                             emit_packet=False, emit_sum=True, offset=offset)
        shapes = [rows[i].shape[1:] for i in members]
        for i, value in zip(members, fusion.unpack(total, shapes, codec.bucket_size)):
            out[i] = value.astype(rows[i].dtype)
    return to_local(out, axis_name)  # typed varying, as lax.psum_scatter's result


def _scatter_rows_fwd(rows, key, settings):
    return _scatter_rows(rows, key, settings), None


def _scatter_rows_bwd(settings, _, cotangents):
    # Straight-through: the transpose of a (compressed) reduce-scatter is the exact gather.
    return [lax.all_gather(ct, settings.axis_name, axis=0, tiled=False)
            for ct in cotangents], None


_scatter_rows.defvjp(_scatter_rows_fwd, _scatter_rows_bwd)
