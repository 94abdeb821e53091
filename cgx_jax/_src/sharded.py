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
from jax.sharding import PartitionSpec as P

from cgx_jax._src import fusion
from cgx_jax._src.axes import axis_size, axis_tuple
from cgx_jax._src.backends import BACKENDS, get_backend
from cgx_jax._src.codec import Codec, packet_bytes
from cgx_jax._src.collectives import REDUCE_SCATTER
from cgx_jax._src.consistency import check_processes_agree
from cgx_jax._src.layouts import entry_axes
from cgx_jax._src.policy import LayerPolicy, choose_codecs, path_name
from cgx_jax._src.reduction import ReductionPlan, plan_reduction, run_scatter_plan, segment_seeds
from cgx_jax._src.seeds import gradient_key, need_key, seed_bits
from cgx_jax._src.validation import check_choice, check_codec
from cgx_jax._src.vma import to_local, varying_axes

# Weights travel at 8 bits with nearest rounding (no key needed, error below 0.2% of each
# bucket's range) in buckets of 1,024 (with exact gradients such weights left the loss as
# exact ones did: docs/performance.md); gradients at the library's default, 4-bit
# stochastic (unbiased), in buckets of 128.
WEIGHT_CODEC = Codec(bits=8, bucket_size=1024, rounding="nearest")
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


def _agreed_plan(leaves, codecs, algorithm: str, num: int, what: str):
    """The plan (``reduction.plan_reduction``), checked to be the same in every process of a
    multi-process run (``consistency.check_processes_agree``) before any byte moves."""
    plan = plan_reduction(leaves, codecs, algorithm=algorithm, num_participants=num)
    check_processes_agree(plan.wire_settings(what), what)
    return plan


@dataclasses.dataclass(frozen=True)
class _GatherSettings:
    """The static settings of one compressed gather (hashable, for ``custom_vjp``):
    ``grad_codecs`` and ``paths`` one per leaf of the plan (the cotangent's codec, None:
    exact; the leaf's name in errors)."""

    axis_name: Hashable
    plan: ReductionPlan
    backend: str
    grad_codecs: tuple
    paths: tuple


# ---------------------------------------------------------------------------
# compressed_all_gather
# ---------------------------------------------------------------------------

def compressed_all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False,
                          codec: Codec | None = None, policy: LayerPolicy | None = None,
                          key=None, grad_codec: Codec | None = GRADIENT_CODEC,
                          backend: str = "ffi", specs=None):
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

    ``specs``: the ``PartitionSpec``s the tree was split by (a tree prefix of ``x``: the
    ``shard_map``'s ``in_specs`` for it, or ``nnx.get_partition_spec(state)``). Each leaf
    whose spec shards a dimension over ``axis_name`` is gathered along it, tiled; the others
    are returned as they are, so a whole model state can be passed (not with ``axis`` or
    ``tiled``).

    Args:
      x: a pytree of arrays (this participant's shards).
      axis_name: the bound axis to gather over.
      axis, tiled: as for ``lax.all_gather``.
      codec, policy, key, backend: as for ``compressed_psum``.
      grad_codec: the codec of the gradient's reduce-scatter (``None``: exact).
      specs: the ``PartitionSpec``s the tree was split by (above).

    Returns:
      The gathered pytree, laid out as ``lax.all_gather`` lays it out.

    Raises:
      ValueError: bad ``specs``; a stochastic codec without ``key`` (also the gradient's).
      TypeError: a ``codec`` or ``policy`` of the wrong type.
      cgx.ProcessesDisagreeError: processes that would send different traffic.

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
    if specs is None:
        axes = [_check_axis(leaf, axis, 0 if tiled else 1, "axis", path)
                for leaf, path in zip(call.leaves, call.paths)]
    elif axis != 0 or tiled:
        raise ValueError("pass specs= or axis=/tiled=, not both: with specs= each leaf is "
                         "gathered tiled along the dimension its spec shards over "
                         f"{axis_name!r}")
    else:
        axes, tiled = _sharded_dims(specs, x, call, axis_name), True
    chosen = [i for i, a in enumerate(axes) if a is not None]
    gathered = [leaf.shape if a is None else _gathered_shape(leaf.shape, a, tiled, call.num)
                for leaf, a in zip(call.leaves, axes)]
    codecs = choose_codecs(call.leaves, call.treedef, codec=codec, policy=policy,
                           default=LayerPolicy(default=WEIGHT_CODEC), shapes=gathered)
    out = list(call.leaves)  # the leaves specs= leaves alone
    # Leaves gathered exactly get lax.all_gather's gradient, the exact reduce-scatter.
    for i, value in zip(chosen, gather_leaves(
            [call.leaves[i] for i in chosen], [codecs[i] for i in chosen], axis_name,
            axes=[axes[i] for i in chosen], tiled=tiled, key=key,
            grad_codecs=[None if codecs[i] is None else grad_codec for i in chosen],
            backend=backend, paths=[call.paths[i] for i in chosen])):
        out[i] = value
    return jax.tree_util.tree_unflatten(call.treedef, out)


def _sharded_dims(specs, x, call: _Call, axis_name) -> list:
    """Per leaf of ``x``, the dimension its spec (``specs``, a tree prefix of ``x``) shards
    over ``axis_name``, or None."""
    def is_spec(s):
        return isinstance(s, P)

    try:
        full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, x,
                            is_leaf=is_spec)
    except (ValueError, TypeError) as error:
        raise ValueError(f"specs must be a tree prefix of x with PartitionSpec leaves: "
                         f"{error}") from None
    dims = []
    for spec, leaf, path in zip(jax.tree.leaves(full, is_leaf=is_spec), call.leaves,
                                call.paths):
        if not is_spec(spec):
            raise ValueError(f"specs for {_leaf_name(path)} must be a PartitionSpec, got "
                             f"{spec!r}")
        entries = [entry_axes(entry) for entry in spec]
        named = [d for d, names in enumerate(entries) if axis_name in names]
        if named and (len(entries) > leaf.ndim or len(entries[named[0]]) > 1):
            raise ValueError(f"specs for {_leaf_name(path)} of shape {tuple(leaf.shape)} is "
                             f"{spec}: its dimension sharded over {axis_name!r} must be one "
                             f"of the leaf's, sharded over that axis alone")
        dims.append(named[0] if named else None)
    return dims


def gather_leaves(leaves, codecs, axis_name, *, axes, tiled: bool, key, grad_codecs,
                  backend: str, paths) -> list:
    """The core of ``compressed_all_gather``: ``leaves`` (a list of arrays) each with its
    codec (None: exact, through ``lax.all_gather``), its gather ``axes`` and the codec of its
    gradient's reduce-scatter in ``grad_codecs`` (None: exact); ``paths`` name them in
    errors. Plans, checks that the processes agree, gathers.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> codec = Codec(bits=8, bucket_size=64, rounding="nearest")
        >>> f = jax.pmap(lambda w: gather_leaves([w], [codec], "i", axes=[0], tiled=True,
        ...     key=None, grad_codecs=[None], backend="ffi", paths=["w"]), axis_name="i")
        >>> f(jnp.ones((1, 4, 64)))[0].shape
        (1, 4, 64)
    """
    settings, packets = start_gather(leaves, codecs, axis_name, key=key,
                                     grad_codecs=grad_codecs, backend=backend, paths=paths)
    return finish_gather(settings, leaves, packets, key, axes=axes, tiled=tiled)


def start_gather(leaves, codecs, axis_name, *, key, grad_codecs, backend: str, paths):
    """The first half of ``gather_leaves``: plans, checks that the processes agree, and
    gathers the compressed leaves' packets. Returns ``(settings, packets)`` for
    ``finish_gather``, which decodes them (``packets`` is None when nothing is compressed),
    and may run later, where the weights are used (``cgx.value_and_grad``'s
    ``keep_for_backward="packets"``)."""
    need_key(codecs, key, paths, "compressed_all_gather's codec")
    plan = _agreed_plan(leaves, codecs, "allgather", axis_size(axis_name),
                        "compressed_all_gather")
    settings = _GatherSettings(axis_name, plan, backend, tuple(grad_codecs), tuple(paths))
    # Through the custom VJP: compressed leaves, and exact ones whose gradient is compressed
    # (the others are None there: no leaf of its pytree, no cotangent).
    through = _through(leaves, settings)
    packets = (_gather_packets(through, key, settings)
               if plan.segments and any(leaf is not None for leaf in through) else None)
    return settings, packets


def finish_gather(settings: _GatherSettings, leaves, packets, key, *, axes, tiled: bool):
    """The second half of ``gather_leaves``: the gathered ``leaves``, the compressed ones
    decoded from ``packets``, the exact ones gathered through ``lax.all_gather``."""
    out = [None] * len(leaves)
    through = _through(leaves, settings)
    for i in settings.plan.exact:
        if through[i] is None:
            out[i] = lax.all_gather(leaves[i], settings.axis_name, axis=axes[i], tiled=tiled)
    if any(leaf is not None for leaf in through):
        stacked = _decode_stacked(through, packets, key, settings)
        for i, rows in enumerate(stacked):
            if rows is not None:
                out[i] = _place_rows(rows, axes[i], tiled)
    return out


def _through(leaves, settings: _GatherSettings) -> list:
    """The leaves that go through ``_decode_stacked`` (None for the others)."""
    return [leaf if i not in settings.plan.exact or settings.grad_codecs[i] is not None
            else None for i, leaf in enumerate(leaves)]


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


def _gather_packets(leaves, key, settings: _GatherSettings):
    """``uint8 [N, W]``: row k participant k's packets of the plan's segments, one after the
    other. Planned like the all-gather all-reduce: leaves sharing a codec packed
    bucket-aligned into segments, a large leaf read in place. No gradient flows through the
    packets (``_decode_stacked``'s VJP gives the leaves theirs)."""
    backend, plan = get_backend(settings.backend), settings.plan
    leaves = [None if leaf is None else lax.stop_gradient(leaf) for leaf in leaves]
    seeds = segment_seeds(plan, key, settings.axis_name)  # each segment its own noise
    packets = [backend.quantize_rows(plan.pack(segment, leaves), seed[0], segment.codec,
                                     n=segment.length)
               for segment, seed in zip(plan.segments, seeds)]
    # Plain lax.all_gather, so the result is typed varying as lax.all_gather's is.
    return lax.all_gather(jnp.concatenate(packets, axis=1)[0], settings.axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _decode_stacked(leaves, gathered, key, settings: _GatherSettings):
    """``[N, *shape]`` per leaf that is not None: every participant's shard, decoded from
    the ``gathered`` packets (the plan's segments) or, for an exact leaf, gathered exactly.
    The leaves of segments give only their shapes and dtypes; all receive the gradient: the
    reduce-scatter of the cotangent, through ``scatter_leaves`` with ``grad_codecs``."""
    backend, plan = get_backend(settings.backend), settings.plan
    out = [None] * len(leaves)
    for i in plan.exact:
        if leaves[i] is not None:
            out[i] = lax.all_gather(leaves[i], settings.axis_name, axis=0, tiled=False)
    offset = 0
    for segment in plan.segments:
        decoded = backend.dequantize_rows(gathered, segment.codec, segment.length, "float32",
                                          offset=offset)
        offset += packet_bytes(segment.length, segment.codec)
        shapes = [leaves[i].shape for i in segment.leaves]
        rows = jax.vmap(lambda row, s=shapes, b=segment.codec.bucket_size:
                        fusion.unpack(row, s, b))(decoded)
        for i, value in zip(segment.leaves, rows):
            out[i] = value.astype(leaves[i].dtype)
    # Typed varying, as lax.all_gather's result (the kernels' outputs carry no axis type),
    # and over any other axis its leaf varies over (so the cotangent, and the gradient the
    # VJP gives the leaf, are typed as the leaf).
    return [None if value is None else to_local(value, _with_axis(leaf, settings.axis_name))
            for leaf, value in zip(leaves, out)]


def _with_axis(leaf, axis_name) -> tuple:
    """The axes ``leaf`` varies over, and ``axis_name``."""
    return tuple(sorted(varying_axes(leaf) | set(axis_tuple(axis_name)), key=str))


def _decode_stacked_fwd(leaves, gathered, key, settings):
    return _decode_stacked(leaves, gathered, key, settings), key


def _decode_stacked_bwd(settings, key, cotangents):
    # The transpose of a gather is a reduce-scatter of the cotangent over the new axis.
    members = [i for i, ct in enumerate(cotangents) if ct is not None]
    grad_key = gradient_key(key)
    grads = scatter_leaves(
        [cotangents[i] for i in members], [settings.grad_codecs[i] for i in members],
        settings.axis_name, dims=[0] * len(members), tiled=False, key=grad_key,
        backend=settings.backend, paths=[settings.paths[i] for i in members],
        what="the gradient of compressed_all_gather (grad_codec)")
    out = [None] * len(cotangents)
    for i, grad in zip(members, grads):
        # Typed varying over the axes the cotangent varies over (inside a shard_map manual
        # over more axes than this gather's, those too), as the leaf is.
        axes = tuple(sorted(varying_axes(cotangents[i]), key=str))
        out[i] = to_local(grad, axes) if axes else grad
    return out, None, None


_decode_stacked.defvjp(_decode_stacked_fwd, _decode_stacked_bwd)


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

    Args:
      x: a pytree of arrays (each participant's values).
      axis_name: the bound axis to reduce-scatter over.
      scatter_dimension, tiled: as for ``lax.psum_scatter``.
      codec, policy, key, backend: as for ``compressed_psum``.
      what: the name errors use for the caller.

    Returns:
      This participant's chunk of the sum, laid out as ``lax.psum_scatter`` lays it out.

    Raises:
      ValueError: a scatter dimension that does not fit the participants; a stochastic
        codec without ``key``.
      TypeError: a ``codec`` or ``policy`` of the wrong type.
      cgx.ProcessesDisagreeError: processes that would send different traffic.

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
    need_key(codecs, key, paths, what)
    num = axis_size(axis_name)
    rows = [_participant_rows(leaf, dim, num) for leaf, dim in zip(leaves, dims)]
    plan = _agreed_plan(rows, codecs, REDUCE_SCATTER, num, what)
    out = run_scatter_plan(plan, rows, axis_name, key=key, backend=backend)
    return [_from_participant_rows(value, dim, tiled) for value, dim in zip(out, dims)]


def _participant_rows(leaf, dim: int, num: int):
    """``leaf`` as ``[N, k, *rest]``: row j the ``k`` slices along ``dim`` participant j owns
    (``k`` = 1 untiled)."""
    moved = jnp.moveaxis(leaf, dim, 0)
    return moved.reshape((num, moved.shape[0] // num) + moved.shape[1:])


def _from_participant_rows(value, dim: int, tiled: bool):
    """This participant's ``[k, *rest]`` laid out as ``lax.psum_scatter``'s result: ``k``
    slices back at ``dim`` (tiled), or the one slice with ``dim`` gone."""
    return jnp.moveaxis(value, 0, dim) if tiled else value[0]
