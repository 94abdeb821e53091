"""Which leaves of a pytree are compressed, and with which codec (docs/design.md section 7).

Leaves are named by their pytree path rendered as ``a/b/c`` (dict keys, attribute names and
sequence indices), so the same regexes work for Flax linen ``params`` dicts and NNX states.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from cgx_jax._src.codec import Codec, wire_bytes
from cgx_jax._src.trees import is_array, partition
from cgx_jax._src.validation import check_codec

# Layers below 16K values (64 KiB in f32) cost latency, not bandwidth: compressing them saves
# little and spends their precision. CGX leaves such layers, biases and norms exact too.
DEFAULT_MIN_SIZE = 16384


def path_name(path) -> str:
    """Renders a ``jax.tree_util`` key path as ``a/b/c``. The trailing ``.value`` of a Flax
    NNX ``Variable`` is dropped, so NNX states and linen ``params`` dicts name the same layer
    alike (``fc1/kernel``)."""
    path = tuple(path)
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)


def leaf_paths(tree) -> list[str]:
    """The ``a/b/c`` names of the leaves of ``tree``, in ``tree_leaves`` order: what the
    regexes of ``LayerPolicy(exclude=..., overrides=...)`` are matched against.

    Args:
      tree: any pytree.

    Returns:
      One ``str`` per leaf.

    Example:
        >>> import cgx_jax as cgx, jax.numpy as jnp
        >>> cgx.leaf_paths({"mlp": {"kernel": jnp.zeros(2), "bias": jnp.zeros(2)}})
        ['mlp/bias', 'mlp/kernel']
    """
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def is_compressible(leaf) -> bool:
    """Whether ``leaf`` is floating, so a codec can carry it (integer leaves stay exact)."""
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """Decides per leaf: a ``Codec`` (compressed) or ``None`` (reduced exactly by ``psum``).

    Rules, first match wins: non-floating leaves are exact; the first ``overrides`` regex that
    matches the path gives the codec (``None`` for exact); a path matching an ``exclude``
    regex is exact; leaves with fewer than ``min_ndim`` dimensions (biases, norm scales) or
    fewer than ``min_size`` values are exact; everything else gets ``default``.

    Frozen and hashable (``overrides`` is stored as a tuple of pairs).

    Attributes:
      default: the codec of every leaf no other rule decides (``None``: all exact).
      min_size: leaves of fewer values are exact.
      min_ndim: leaves of fewer dimensions are exact (2: biases and norm scales).
      exclude: regexes of ``a/b/c`` leaf paths kept exact.
      overrides: ``{regex: Codec or None}`` (or pairs), checked in order before the rest.

    Raises:
      TypeError: a ``default`` or override codec that is not a ``Codec`` or ``None``.
      ValueError: a negative or non-int ``min_size``/``min_ndim``, or a bad regex.

    Example:
        >>> import cgx_jax as cgx, jax.numpy as jnp
        >>> policy = cgx.LayerPolicy(default=cgx.Codec(bits=4), min_size=1024,
        ...                          overrides={"head": cgx.Codec(bits=8)})
        >>> tree = {"head": {"kernel": jnp.zeros((64, 64))}, "mlp": {"bias": jnp.zeros(64)}}
        >>> codecs = jax.tree.leaves(policy.resolve(tree), is_leaf=lambda c: c is None)
        >>> [c and c.bits for c in codecs]
        [8, None]
    """

    default: Codec | None = Codec()
    min_size: int = DEFAULT_MIN_SIZE
    min_ndim: int = 2
    exclude: tuple[str, ...] = ()
    overrides: Any = ()

    def __post_init__(self):
        if self.default is not None and not isinstance(self.default, Codec):
            raise TypeError(f"default must be a Codec or None, got {self.default!r}")
        for name in ("min_size", "min_ndim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        pairs = self.overrides.items() if isinstance(self.overrides, Mapping) else self.overrides
        pairs = tuple((pattern, codec) for pattern, codec in pairs)
        for pattern, codec in pairs:
            if codec is not None and not isinstance(codec, Codec):
                raise TypeError(f"overrides[{pattern!r}] must be a Codec or None, got {codec!r}")
        for pattern in (*self.exclude, *(p for p, _ in pairs)):
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ValueError(f"invalid regex {pattern!r} in LayerPolicy: {err}") from None
        object.__setattr__(self, "overrides", pairs)

    def override_for(self, path: str) -> tuple[bool, Codec | None]:
        """``(True, codec)`` from the first ``overrides`` regex matching ``path``, else
        ``(False, None)``."""
        for pattern, codec in self.overrides:
            if re.search(pattern, path):
                return True, codec
        return False, None

    def codec_for(self, path: str, leaf) -> Codec | None:
        """The codec of one leaf named ``path`` (``None``: reduce it exactly)."""
        if not is_compressible(leaf):
            return None
        overridden, codec = self.override_for(path)
        if overridden:
            return codec
        if any(re.search(pattern, path) for pattern in self.exclude):
            return None
        shape = jnp.shape(leaf)  # also of a jax.ShapeDtypeStruct
        if len(shape) < self.min_ndim or math.prod(shape) < self.min_size:
            return None
        return self.default

    def resolve_leaves(self, tree) -> list[Codec | None]:
        """Per-leaf codecs in ``tree_leaves`` order. Raises ``ValueError`` when an override
        regex matches no path (a typo would otherwise silently change nothing)."""
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        paths = [path_name(p) for p, _ in flat]
        for pattern, _ in self.overrides:
            if not any(re.search(pattern, path) for path in paths):
                raise ValueError(
                    f"override regex {pattern!r} matches no leaf; the paths are: {paths}")
        return [self.codec_for(path, leaf) for path, (_, leaf) in zip(paths, flat)]

    def resolve(self, tree):
        """The tree of per-leaf codecs (``None`` for exact leaves), same structure as ``tree``."""
        treedef = jax.tree_util.tree_structure(tree)
        return jax.tree_util.tree_unflatten(treedef, self.resolve_leaves(tree))


def check_policy(policy, name: str = "policy") -> LayerPolicy:
    """``policy``, or ``LayerPolicy()`` for None; ``TypeError`` naming ``name`` for anything
    but a ``LayerPolicy``.

    Example:
        >>> check_policy(None).min_ndim
        2
    """
    if policy is None:
        return LayerPolicy()
    if not isinstance(policy, LayerPolicy):
        raise TypeError(f"{name} must be a cgx_jax.LayerPolicy, got {type(policy).__name__}")
    return policy


def choose_codecs(leaves, treedef, *, codec=None, policy=None, default=None,
                  shapes=None) -> list:
    """Each leaf's codec (None: exact), as every compressed collective chooses it:
    ``codec`` for every floating leaf, else ``policy`` per leaf, else ``default`` (a
    ``LayerPolicy``; None: ``LayerPolicy()``). A policy decides on ``shapes`` when given (the
    whole parameter a shard belongs to, as ``cgx.summary`` shows it), else on the leaves.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> leaves, treedef = jax.tree.flatten({"w": jnp.ones((4, 4)), "n": jnp.arange(3)})
        >>> [c is None for c in choose_codecs(leaves, treedef, codec=Codec(bits=8))]  # n, w
        [True, False]
    """
    if codec is not None and policy is not None:
        raise ValueError("pass codec= or policy=, not both")
    if codec is not None:
        check_codec(codec)
        return [codec if is_compressible(leaf) else None for leaf in leaves]
    policy = check_policy(policy) if policy is not None else (default or LayerPolicy())
    if shapes is not None:
        leaves = [jax.ShapeDtypeStruct(shape, leaf.dtype) for leaf, shape in zip(leaves, shapes)]
    return policy.resolve_leaves(jax.tree_util.tree_unflatten(treedef, leaves))


def residual_shape(codec: Codec | None, shape) -> tuple:
    """The error-feedback residual's shape for one participant and one leaf: the leaf's shape
    where ``codec`` compresses it, ``(1,)`` where it is exact: an exact leaf loses nothing, so
    one zero keeps the residual tree the gradients' structure (not an empty array: Orbax
    refuses to save those).

    Example:
        >>> residual_shape(Codec(bits=4), (64, 32)), residual_shape(None, (64,))
        ((64, 32), (1,))
    """
    return tuple(shape) if codec is not None else (1,)


def add_residual(grad, residual_row):
    """``grad`` plus this participant's residual row (f32 sums, the gradient's dtype back);
    ``grad`` unchanged where the residual is an exact leaf's one zero.

    Example:
        >>> add_residual(jnp.ones(3), jnp.full(3, 0.5)).tolist(), add_residual(
        ...     jnp.ones(3), jnp.zeros(1)).tolist()
        ([1.5, 1.5, 1.5], [1.0, 1.0, 1.0])
    """
    if jnp.shape(residual_row) != jnp.shape(grad):
        return grad
    return (grad.astype(jnp.float32) + residual_row).astype(grad.dtype)


def leaf_wire_bytes(codec: Codec | None, leaf) -> int:
    """Bytes one participant sends for ``leaf``: its packet padded to whole buckets (as in the
    fused buffer) under ``codec``, its own dtype's size when exact (``codec`` None)."""
    size = int(jnp.size(leaf))
    if codec is None:
        return size * jnp.dtype(jnp.result_type(leaf)).itemsize
    return wire_bytes(size, codec)


def tree_wire_bytes(policy: LayerPolicy, tree) -> int:
    """Bytes one participant sends to all-reduce ``tree`` under ``policy``: the total of
    ``summary``'s wire bytes column.

    Args:
      policy: the ``LayerPolicy``.
      tree: the gradients, parameters or their shapes.

    Returns:
      The bytes, an ``int``.

    Example:
        >>> import cgx_jax as cgx, jax.numpy as jnp
        >>> tree = {"w": jnp.zeros((256, 256)), "b": jnp.zeros(256)}
        >>> cgx.tree_wire_bytes(cgx.LayerPolicy(), tree)
        37888
    """
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(leaf_wire_bytes(codec, leaf)
               for codec, leaf in zip(policy.resolve_leaves(tree), leaves))


def policy_of(source) -> LayerPolicy:
    """The ``LayerPolicy`` of a policy, a ``cgx.compressed_allreduce`` transform or a
    ``cgx.value_and_grad`` function (they carry the policy they run with as ``.policy``)."""
    if isinstance(source, LayerPolicy):
        return source
    policy = getattr(source, "policy", None)
    if isinstance(policy, LayerPolicy):
        return policy
    raise TypeError(
        f"expected a cgx.LayerPolicy, a cgx.compressed_allreduce transform or a "
        f"cgx.value_and_grad function, got {type(source).__name__} (an optax.chain does not "
        f"show its members: pass the cgx transform itself)")


def summary(policy, tree) -> str:
    """A table of what ``policy`` does to ``tree``: per leaf its path, shape, codec and bytes
    on the wire against f32 and bf16, then the totals. Compressed leaves are counted padded to
    whole buckets, as in the fused buffer; exact leaves at their own dtype's size. ``policy``
    may also be the ``cgx.compressed_allreduce`` transform or ``cgx.value_and_grad`` function
    that runs it, so the table shows what that transform does.

    Args:
      policy: a ``LayerPolicy``, or the transform or ``value_and_grad`` function using one.
      tree: the gradients, parameters or their shapes.

    Returns:
      The table, as text.

    Example:
        >>> import cgx_jax as cgx, jax.numpy as jnp
        >>> print(cgx.summary(cgx.LayerPolicy(), {"w": jnp.zeros((256, 256)), "b": jnp.zeros(256)}))
        ... # doctest: +NORMALIZE_WHITESPACE +ELLIPSIS
        path   shape       codec                 wire bytes  f32 bytes  vs f32  vs bf16
        b      (256,)      exact                       1024       1024    1.0x     0.5x
        w      (256, 256)  4 bit/128 stochastic       36864     262144    7.1x     3.6x
        total                                         37888     263168    6.9x     3.5x
    """
    policy = policy_of(policy)
    tree = partition(tree, is_array)[0]  # a model's functions and ints are not sent
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    codecs = policy.resolve_leaves(tree)
    rows, wire_total, f32_total = [], 0, 0
    for (path, leaf), codec in zip(flat, codecs):
        size = int(jnp.size(leaf))
        wire = leaf_wire_bytes(codec, leaf)
        name = ("exact" if codec is None
                else f"{codec.bits} bit/{codec.bucket_size} {codec.rounding}")
        wire_total += wire
        f32_total += 4 * size
        rows.append((path_name(path), str(tuple(jnp.shape(leaf))), name, wire, 4 * size))
    rows.append(("total", "", "", wire_total, f32_total))

    def ratio(f32, wire, scale):
        return f"{scale * f32 / wire:.1f}x" if wire else "-"

    header = ("path", "shape", "codec", "wire bytes", "f32 bytes", "vs f32", "vs bf16")
    cells = [header] + [(p, s, c, str(w), str(f), ratio(f, w, 1.0), ratio(f, w, 0.5))
                        for p, s, c, w, f in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        left = [row[i].ljust(widths[i]) for i in range(3)]
        right = [row[i].rjust(widths[i]) for i in range(3, len(header))]
        lines.append("  ".join(left + right).rstrip())
    return "\n".join(lines)
