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
from cgx_jax.codec import Codec
from cgx_jax.collectives import REDUCE_SCATTER
from cgx_jax.collectives.transport import column_offsets
from cgx_jax.consistency import check_processes_agree
from cgx_jax.policy import LayerPolicy, choose_codecs, path_name
from cgx_jax.reduction import ReductionPlan, plan_reduction, run_scatter_plan, segment_seeds
from cgx_jax.seeds import seed_bits
from cgx_jax.validation import check_choice, check_codec
from cgx_jax.vma import to_local

# Weights travel at 8 bits with nearest rounding (no key needed, error below 0.2% of each
# bucket's range); gradients at the library's default, 4-bit stochastic (unbiased).
WEIGHT_CODEC = Codec(bits=8, rounding="nearest")
GRADIENT_CODEC = Codec()


# ---------------------------------------------------------------------------
# The opening both ops share
# ---------------------------------------------------------------------------

def _leaf_name(path: str) -> str:
    return f"leaf {path!r}" if path else "x"


def _check_axis(leaf, axis: int, extra: int, name: str, path: str) -> int:
    """``axis`` normalized for a leaf of ``leaf.ndim`` dimensions (+ ``extra`` for a new one)."""
    ndim = leaf.ndim + extra
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{name} must be an int in [{-ndim}, {ndim}) for {_leaf_name(path)} "
                         f"of shape {tuple(leaf.shape)}, got {axis!r}")
    return axis % ndim


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call's arguments, checked: the leaves with their ``a/b/c`` paths and treedef, and
    the size of the axis."""

    leaves: list
    paths: list
    treedef: object
    num: int


def _open(x, axis_name, key, backend: str) -> _Call:
    """Checks ``backend``, ``key`` and ``axis_name`` (bound here) and flattens ``x`` with the
    paths its leaves are named by in errors."""
    check_choice("backend", backend, BACKENDS)
    if key is not None:
        seed_bits(key)  # a TypeError naming the key for anything but a PRNG key
    num = axis_size(axis_name)
    flat_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    return _Call([jnp.asarray(leaf) for _, leaf in flat_with_paths],
                 [path_name(p) for p, _ in flat_with_paths], treedef, num)


def _need_key(codecs, key, paths, what: str) -> None:
    """A ``ValueError`` when a stochastic codec has no key, naming the leaves."""
    stochastic = [p for p, c in zip(paths, codecs) if c is not None and c.stochastic]
    if stochastic and key is None:
        raise ValueError(
            f"{what} rounds stochastically and needs a PRNG key: pass key=jax.random.key(...) "
            f"(a fresh one each step), or a codec with rounding='nearest'; leaves rounded "
            f"stochastically: {stochastic[:8]}")


def _agreed_plan(leaves, codecs, algorithm: str, num: int, what: str):
    """The plan (``reduction.plan_reduction``), checked to be the same in every process of a
    multi-process run (``consistency.check_processes_agree``) before any byte moves."""
    plan = plan_reduction(leaves, codecs, algorithm=algorithm, num_participants=num)
    check_processes_agree(plan.wire_settings(what), what)
    return plan


@dataclasses.dataclass(frozen=True)
class _GatherSettings:
    """The static settings of one compressed gather (hashable, for ``custom_vjp``)."""

    axis_name: Hashable
    plan: ReductionPlan
    backend: str
    grad_codec: Codec | None


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
    (typed as ``lax.all_gather``) or ``jax.pmap``. In a multi-process run the processes must
    agree on what travels (``ProcessesDisagreeError`` otherwise, before any byte moves).

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> w = jnp.linspace(-1, 1, 128 * 256).reshape(1, 128, 256)  # one shard per device
        >>> full = jax.pmap(lambda w: cgx.compressed_all_gather(w, "data", tiled=True),
        ...                 axis_name="data", devices=jax.devices()[:1])(w)
        >>> full.shape, bool(jnp.max(jnp.abs(full - w)) <= 2 / 255 / 2)
        ((1, 128, 256), True)
    """
    call = _open(x, axis_name, key, backend)
    if grad_codec is not None:
        check_codec(grad_codec, "grad_codec")
    axes = [_check_axis(leaf, axis, 0 if tiled else 1, "axis", path)
            for leaf, path in zip(call.leaves, call.paths)]
    gathered = [_gathered_shape(leaf.shape, a, tiled, call.num)
                for leaf, a in zip(call.leaves, axes)]
    codecs = choose_codecs(call.leaves, call.treedef, codec=codec, policy=policy,
                           default=LayerPolicy(default=WEIGHT_CODEC), shapes=gathered)
    out = gather_leaves(call.leaves, codecs, axis_name, axes=axes, tiled=tiled, key=key,
                        grad_codec=grad_codec, backend=backend, paths=call.paths)
    return jax.tree_util.tree_unflatten(call.treedef, out)


def gather_leaves(leaves, codecs, axis_name, *, axes, tiled: bool, key, grad_codec,
                  backend: str, paths) -> list:
    """The core of ``compressed_all_gather``: ``leaves`` (a list of arrays) each with its
    codec (None: exact, through ``lax.all_gather``) and its gather ``axes``; ``paths`` name
    them in errors. Plans, checks that the processes agree, gathers.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> codec = Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda w: gather_leaves([w], [codec], "i", axes=[0], tiled=True,
        ...     key=None, grad_codec=None, backend="ffi", paths=["w"]), axis_name="i")
        >>> f(jnp.ones((1, 4, 64)))[0].shape
        (1, 4, 64)
    """
    _need_key(codecs, key, paths, "compressed_all_gather's codec")
    plan = _agreed_plan(leaves, codecs, "allgather", axis_size(axis_name),
                        "compressed_all_gather")
    out = [None] * len(leaves)
    for i in plan.exact:
        out[i] = lax.all_gather(leaves[i], axis_name, axis=axes[i], tiled=tiled)
    if plan.segments:
        # Exact leaves are None here (no leaf of the custom_vjp's pytree, no cotangent).
        compressed = [None if i in plan.exact else leaf for i, leaf in enumerate(leaves)]
        stacked = _gather_stacked(compressed, key,
                                  _GatherSettings(axis_name, plan, backend, grad_codec))
        for i, rows in enumerate(stacked):
            if rows is not None:
                out[i] = _place_rows(rows, axes[i], tiled)
    return out


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
def _gather_stacked(leaves, key, settings: _GatherSettings):
    """``[N, *shape]`` per leaf of ``settings.plan``'s segments (None where the plan has an
    exact leaf): every participant's shard, decoded from the gathered packets. Planned like
    the all-gather all-reduce: leaves sharing a codec packed bucket-aligned into segments, a
    large leaf read in place."""
    backend, plan = get_backend(settings.backend), settings.plan
    seeds = segment_seeds(plan, key, settings.axis_name)  # each segment its own noise
    packets = [backend.quantize_rows(plan.pack(segment, leaves), seed[0], segment.codec,
                                     n=segment.length)
               for segment, seed in zip(plan.segments, seeds)]
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
        grads = [None if ct is None else
                 lax.psum_scatter(ct, settings.axis_name, scatter_dimension=0, tiled=False)
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
    call = _open(x, axis_name, key, backend)
    num = call.num
    dims = [_check_axis(leaf, scatter_dimension, 0, "scatter_dimension", path)
            for leaf, path in zip(call.leaves, call.paths)]
    for leaf, dim, path in zip(call.leaves, dims, call.paths):
        if leaf.shape[dim] % num if tiled else leaf.shape[dim] != num:
            want = f"a multiple of {num}" if tiled else f"{num}"
            raise ValueError(
                f"scatter_dimension {dim} of {_leaf_name(path)} (shape {tuple(leaf.shape)}) must "
                f"have size {want}, the size of axis {axis_name!r}"
                f"{' (tiled=True)' if tiled else ' (tiled=False: one slice per participant)'}")
    codecs = choose_codecs(call.leaves, call.treedef, codec=codec, policy=policy)
    out = scatter_leaves(call.leaves, codecs, axis_name, dims=dims, tiled=tiled, key=key,
                         backend=backend, paths=call.paths, what=what)
    return jax.tree_util.tree_unflatten(call.treedef, out)


def scatter_leaves(leaves, codecs, axis_name, *, dims, tiled: bool, key, backend: str, paths,
                   what: str = "compressed_psum_scatter") -> list:
    """The core of ``compressed_psum_scatter``: ``leaves`` (a list of arrays) each with its
    codec (None: exact, through ``lax.psum_scatter``) and its scatter dimension in ``dims``
    (of a size the axis divides); ``paths`` name them in errors. Plans, checks that the
    processes agree, reduce-scatters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> codec = Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda g: scatter_leaves([g], [codec], "i", dims=[0], tiled=True,
        ...     key=None, backend="ffi", paths=["g"]), axis_name="i")
        >>> float(f(jnp.ones((1, 4, 64)))[0][0, 0, 0])
        1.0
    """
    _need_key(codecs, key, paths, what)
    num = axis_size(axis_name)
    rows = [_rows_of(leaf, dim, num) for leaf, dim in zip(leaves, dims)]
    plan = _agreed_plan(rows, codecs, REDUCE_SCATTER, num, what)
    out = run_scatter_plan(plan, rows, axis_name, key=key, backend=backend)
    return [_unrows(value, dim, tiled) for value, dim in zip(out, dims)]


def _rows_of(leaf, dim: int, num: int):
    """``leaf`` as ``[N, k, *rest]``: row j the ``k`` slices along ``dim`` participant j owns
    (``k`` = 1 untiled)."""
    moved = jnp.moveaxis(leaf, dim, 0)
    return moved.reshape((num, moved.shape[0] // num) + moved.shape[1:])


def _unrows(value, dim: int, tiled: bool):
    """This participant's ``[k, *rest]`` laid out as ``lax.psum_scatter``'s result: ``k``
    slices back at ``dim`` (tiled), or the one slice with ``dim`` gone."""
    return jnp.moveaxis(value, 0, dim) if tiled else value[0]
