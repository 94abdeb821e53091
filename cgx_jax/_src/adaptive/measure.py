"""Measuring what quantization costs each layer (docs/design.md section 7): the error table
of squared quantization errors and packet bytes per candidate leaf and bit width, measured
with the real codec. ``cgx_jax._src.adaptive.fit`` turns a table into a policy.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.backends import get_backend
from cgx_jax._src.codec import Codec, pad_to_multiple, wire_bytes
from cgx_jax._src.policy import LayerPolicy, check_policy, is_compressible, path_name

DEFAULT_CHOICES = (2, 3, 4, 5, 6, 8)
DEFAULT_BUCKET_SIZE = Codec().bucket_size  # the candidates bucket as the default codec does


@jax.tree_util.register_pytree_node_class
class ErrorTable:
    """Per candidate leaf and bit width: squared quantization error and packet bytes.

    Attributes:
      paths: the ``a/b/c`` names of the candidate leaves (those the base policy compresses).
      sizes: their numbers of values.
      errors: ``f32[leaves, choices]`` squared L2 error (a pytree leaf, with ``squares``, so
        a table can be all-reduced, averaged and kept in an optimizer state; under ``pmap``
        it gains a leading replica axis, which ``fit_policy`` drops).
      bytes: ``int64[leaves, choices]`` packet bytes (static numpy).
      choices: the candidate bit widths, ascending.
      bucket_size: the bucket size of every candidate codec.
      exact_bytes: the f32 bytes of the floating leaves the base policy keeps exact (what
        the step's exact ``psum`` sends; a time budget counts them).
      squares: ``f32[leaves]``, each leaf's sum of squared values (what ``fit_policy``'s
        ``error="relative"`` divides by), or None for a table built without them.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> table = cgx.layer_errors({"w": jnp.linspace(-1, 1, 64 * 512).reshape(64, 512)},
        ...                          choices=(2, 4), backend="jax")
        >>> table.paths, table.choices, table.errors.shape
        (('w',), (2, 4), (1, 2))
    """

    def __init__(self, paths, sizes, errors, bytes, choices, bucket_size,  # noqa: A002
                 exact_bytes: int = 0, squares=None):
        self.paths = tuple(paths)
        self.sizes = tuple(int(s) for s in sizes)
        self.errors = errors
        self.bytes = np.asarray(bytes, np.int64).reshape(len(self.paths), len(choices))
        self.choices = tuple(choices)
        self.bucket_size = int(bucket_size)
        self.exact_bytes = int(exact_bytes)
        self.squares = squares

    def tree_flatten(self):
        aux = (self.paths, self.sizes, tuple(map(tuple, self.bytes.tolist())), self.choices,
               self.bucket_size, self.exact_bytes)
        return (self.errors, self.squares), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        paths, sizes, nbytes, choices, bucket_size, exact_bytes = aux
        errors, squares = children
        return cls(paths, sizes, errors, nbytes, choices, bucket_size, exact_bytes, squares)

    def __repr__(self):
        return (f"ErrorTable(paths={self.paths}, choices={self.choices}, "
                f"bucket_size={self.bucket_size})")

    def host_errors(self) -> np.ndarray:
        """The errors as ``float64[leaves, choices]`` on the host (replica 0 of a ``pmap``
        output: all replicas hold the same all-reduced table)."""
        errors = np.asarray(self.errors, np.float64)
        if errors.ndim == 3:
            errors = errors[0]
        if errors.shape != self.bytes.shape:
            raise ValueError(f"errors must be [{len(self.paths)}, {len(self.choices)}] (or with "
                             f"a leading replica axis), got shape {errors.shape}")
        return errors

    def host_squares(self) -> np.ndarray | None:
        """``squares`` as ``float64[leaves]`` on the host (replica 0 under ``pmap``), or None."""
        if self.squares is None:
            return None
        squares = np.asarray(self.squares, np.float64)
        return squares[0] if squares.ndim == 2 else squares

    def cost(self, bits) -> tuple[float, int]:
        """``(total error, total bytes)`` of per-leaf ``bits`` (one int: uniform)."""
        bits = [bits] * len(self.paths) if isinstance(bits, numbers.Integral) else list(bits)
        unknown = [b for b in bits if b not in self.choices]
        if len(bits) != len(self.paths) or unknown:
            raise ValueError(f"bits must be {len(self.paths)} values from {self.choices}, "
                             f"got {bits}")
        columns = [self.choices.index(b) for b in bits]
        rows = np.arange(len(self.paths))
        return (float(self.host_errors()[rows, columns].sum()),
                int(self.bytes[rows, columns].sum()))

    def bits_of(self, policy: LayerPolicy) -> tuple[int, ...]:
        """The bits ``policy`` gives each candidate leaf by its ``overrides`` (first match)
        or else its ``default``, as for the policies ``fit_policy`` returns."""
        bits = []
        for path in self.paths:
            overridden, codec = policy.override_for(path)
            if not overridden:
                codec = policy.default
            if codec is None:
                raise ValueError(f"policy leaves candidate leaf {path!r} exact")
            bits.append(codec.bits)
        return tuple(bits)


def check_choices(choices) -> tuple[int, ...]:
    try:
        values = tuple(choices)
    except TypeError:
        values = None
    if (not values or any(isinstance(b, bool) or not isinstance(b, numbers.Integral)
                          or not 1 <= b <= 8 for b in values) or len(set(values)) != len(values)):
        raise ValueError(f"choices must be a non-empty sequence of distinct integer bit widths "
                         f"in 1..8, got {choices!r}")
    return tuple(sorted(int(b) for b in values))


def layer_errors(grads, choices=DEFAULT_CHOICES, bucket_size: int = DEFAULT_BUCKET_SIZE, *,
                 base: LayerPolicy = LayerPolicy(), backend: str = "ffi") -> ErrorTable:
    """Squared quantization error and packet bytes of each candidate leaf at each bit width,
    and each leaf's sum of squares.

    Candidates are the non-empty leaves ``base`` compresses (``base.resolve_leaves`` not
    ``None``). Each is flattened, cast to f32 and padded to whole buckets by repeating its last
    value (as in the all-reduce), encoded and decoded with the real codec (``backend``) using
    *nearest* rounding: a deterministic, noise-free proxy. Stochastic rounding's expected error
    is a similar multiple of the bucket's squared unit at every width, so the ranking of
    (leaf, bits) choices, which is what the fit uses, is the same. The error sums over the
    leaf's own values, not the padding. Jittable (shapes and paths are static).

    Args:
      grads: a gradient pytree (a representative step's).
      choices: the bit widths to measure.
      bucket_size: the codecs' bucket size.
      base: the policy whose compressed leaves are the candidates.
      backend: ``"ffi"`` or ``"jax"``.

    Returns:
      An ``ErrorTable``: per candidate leaf its path, size, and squared error and packet
      bytes at each width.

    Example:
        >>> import cgx_jax as cgx, jax, jax.numpy as jnp
        >>> grads = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "b": jnp.ones(64)}
        >>> table = cgx.layer_errors(grads, choices=(2, 4, 8), bucket_size=256,
        ...                          base=cgx.LayerPolicy(min_size=0))
        >>> table.paths, table.bytes.tolist()
        (('w',), [[1152, 2176, 4224]])
        >>> bool(jnp.all(jnp.diff(table.errors[0]) < 0))  # more bits, less error
        True
    """
    choices = check_choices(choices)
    codecs = {b: Codec(bits=b, bucket_size=bucket_size, rounding="nearest") for b in choices}
    implementation = get_backend(backend)
    check_policy(base, "base")
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    resolved = base.resolve_leaves(grads)
    paths, sizes, errors, nbytes, squares = [], [], [], [], []
    exact_bytes = 0
    seed = jnp.zeros((2,), jnp.uint32)
    for (path, leaf), codec in zip(flat, resolved):
        leaf = jnp.asarray(leaf)
        if codec is None or leaf.size == 0:
            exact_bytes += 4 * leaf.size if is_compressible(leaf) else 0
            continue
        values = leaf.reshape(-1).astype(jnp.float32)
        padded = pad_to_multiple(values, bucket_size)[None, :]
        row = []
        for b in choices:
            packet = implementation.quantize_rows(padded, seed, codecs[b])
            decoded = implementation.dequantize_rows(packet, codecs[b], padded.shape[1],
                                                     jnp.float32)
            row.append(jnp.sum(jnp.square(decoded[0, :leaf.size] - values)))
        paths.append(path_name(path))
        sizes.append(leaf.size)
        squares.append(jnp.sum(jnp.square(values)))
        errors.append(jnp.stack(row))
        nbytes.append([wire_bytes(leaf.size, codecs[b]) for b in choices])
    errors = jnp.stack(errors) if errors else jnp.zeros((0, len(choices)), jnp.float32)
    squares = jnp.stack(squares) if squares else jnp.zeros((0,), jnp.float32)
    return ErrorTable(paths, sizes, errors, np.reshape(nbytes, (len(paths), len(choices))),
                      choices, bucket_size, exact_bytes, squares)
