"""Layer-wise adaptive compression (L-GreCo-style): per-leaf bit widths under a size budget.

Layers differ in how much quantization error they suffer and in how many bytes they cost, so
one bit width for all is wasteful. ``layer_errors`` measures, with the real codec, the squared
error and packet bytes of every candidate leaf at every candidate bit width; ``fit_policy``
picks one width per leaf by an exact dynamic program (a multiple-choice knapsack) and returns a
``LayerPolicy``. ``AdaptiveConfig`` and ``refit_policy`` refit during training from error
statistics that ``compressed_allreduce(..., adaptive=...)`` keeps in its state.

Discretisation: the DP works on whole cells (``cells``, default 2000). Only what a choice
costs above the leaf's cheapest choice is discretised, and it is rounded UP to whole cells of
``slack / cells`` (slack: the budget minus the cost of every leaf at its cheapest choice), so
a solution that fits the cells always fits the real budget: the DP is optimal for the rounded
costs and feasible for the real ones. The result is then compared with every uniform
assignment that fits the real budget, so it is never worse than uniform ``budget_bits``, and
the fitted error never grows with the budget.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax.api import BACKENDS, _check_choice, _pad_to
from cgx_jax.codec import META_BYTES_PER_BUCKET, Codec, padded_length, wire_bytes
from cgx_jax.policy import LayerPolicy, path_name

DEFAULT_CHOICES = (2, 3, 4, 5, 6, 8)
DEFAULT_BUCKET_SIZE = 1024
DEFAULT_CELLS = 2000
OBJECTIVES = ("error", "bytes")


# ---------------------------------------------------------------------------
# Error table
# ---------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class ErrorTable:
    """Per candidate leaf and bit width: squared quantization error and packet bytes.

    Attributes:
      paths: the ``a/b/c`` names of the candidate leaves (those the base policy compresses).
      sizes: their numbers of values.
      errors: ``f32[leaves, choices]`` squared L2 error (the only pytree leaf, so a table can
        be all-reduced, averaged and kept in an optimizer state; under ``pmap`` it gains a
        leading replica axis, which ``fit_policy`` drops).
      bytes: ``int64[leaves, choices]`` packet bytes (static numpy).
      choices: the candidate bit widths, ascending.
      bucket_size: the bucket size of every candidate codec.
    """

    def __init__(self, paths, sizes, errors, bytes, choices, bucket_size):  # noqa: A002
        self.paths = tuple(paths)
        self.sizes = tuple(int(s) for s in sizes)
        self.errors = errors
        self.bytes = np.asarray(bytes, np.int64).reshape(len(self.paths), len(choices))
        self.choices = tuple(choices)
        self.bucket_size = int(bucket_size)

    def tree_flatten(self):
        aux = (self.paths, self.sizes, tuple(map(tuple, self.bytes.tolist())), self.choices,
               self.bucket_size)
        return (self.errors,), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        paths, sizes, nbytes, choices, bucket_size = aux
        return cls(paths, sizes, children[0], nbytes, choices, bucket_size)

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
            codec = next((c for p, c in policy.overrides if re.search(p, path)), policy.default)
            if codec is None:
                raise ValueError(f"policy leaves candidate leaf {path!r} exact")
            bits.append(codec.bits)
        return tuple(bits)


def _check_choices(choices) -> tuple[int, ...]:
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
    """Squared quantization error and packet bytes of each candidate leaf at each bit width.

    Candidates are the non-empty leaves ``base`` compresses (``base.resolve_leaves`` not
    ``None``). Each is flattened, cast to f32 and padded to whole buckets by repeating its last
    value (as in the all-reduce), encoded and decoded with the real codec (``backend``) using
    *nearest* rounding: a deterministic, noise-free proxy. Stochastic rounding's expected error
    is a similar multiple of the bucket's squared unit at every width, so the ranking of
    (leaf, bits) choices, which is what the fit uses, is the same. The error sums over the
    leaf's own values, not the padding. Jittable (shapes and paths are static).

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
    choices = _check_choices(choices)
    codecs = {b: Codec(bits=b, bucket_size=bucket_size, rounding="nearest") for b in choices}
    _check_choice("backend", backend, BACKENDS)
    if not isinstance(base, LayerPolicy):
        raise TypeError(f"base must be a cgx_jax.LayerPolicy, got {type(base).__name__}")
    impl = BACKENDS[backend]
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    resolved = base.resolve_leaves(grads)
    paths, sizes, errors, nbytes = [], [], [], []
    seed = jnp.zeros((2,), jnp.uint32)
    for (path, leaf), codec in zip(flat, resolved):
        leaf = jnp.asarray(leaf)
        if codec is None or leaf.size == 0:
            continue
        values = leaf.reshape(-1).astype(jnp.float32)
        padded = _pad_to(values, bucket_size)[None, :]
        row = []
        for b in choices:
            packet = impl.quantize_rows(padded, seed, codecs[b])
            decoded = impl.dequantize_rows(packet, codecs[b], padded.shape[1], jnp.float32)
            row.append(jnp.sum(jnp.square(decoded[0, :leaf.size] - values)))
        paths.append(path_name(path))
        sizes.append(leaf.size)
        errors.append(jnp.stack(row))
        nbytes.append([wire_bytes(leaf.size, codecs[b]) for b in choices])
    errors = jnp.stack(errors) if errors else jnp.zeros((0, len(choices)), jnp.float32)
    return ErrorTable(paths, sizes, errors, np.reshape(nbytes, (len(paths), len(choices))),
                      choices, bucket_size)


# ---------------------------------------------------------------------------
# The dynamic program
# ---------------------------------------------------------------------------

def _knapsack(values: np.ndarray, costs: np.ndarray, capacity: int):
    """Exact multiple-choice knapsack: one column per row minimising the total ``values``
    with total integer ``costs`` <= ``capacity``. Returns column indices (ties: the lower
    column), or ``None`` when nothing fits. O(rows * columns * capacity)."""
    rows, cols = values.shape
    best = np.zeros(capacity + 1)  # best[k]: least value of the rows so far with cost <= k
    picks = np.empty((rows, capacity + 1), np.int16)
    span = np.arange(capacity + 1)
    for i in range(rows):
        candidates = np.full((cols, capacity + 1), np.inf)
        for j in range(cols):
            c = int(costs[i, j])
            if c <= capacity:
                candidates[j, c:] = best[:capacity + 1 - c] + values[i, j]
        picks[i] = np.argmin(candidates, axis=0)
        best = candidates[picks[i], span]
    if not np.isfinite(best[capacity]):
        return None
    chosen, k = [], capacity
    for i in reversed(range(rows)):
        j = int(picks[i, k])
        chosen.append(j)
        k -= int(costs[i, j])
    return chosen[::-1]


def _cells_up(extra: np.ndarray, slack, cells: int) -> np.ndarray:
    """``extra`` in cells of ``slack / cells``, rounded up (integers stay exact)."""
    if np.issubdtype(extra.dtype, np.integer) and isinstance(slack, numbers.Integral):
        return -(-extra * cells // slack)
    return np.ceil(extra * (cells / slack)).astype(np.int64)


def _solve(minimise: np.ndarray, limited: np.ndarray, limit, cells: int, uniform_ok):
    """Columns minimising ``sum(minimise)`` subject to ``sum(limited) <= limit``: the DP on
    the discretised ``limited``, or a uniform column when that is better (``uniform_ok``:
    which uniform columns fit the real limit)."""
    floor = limited.min(axis=1)
    slack = limit - floor.sum()
    if slack < 0:
        return None
    if slack == 0 or minimise.shape[0] == 0:
        chosen = [min(np.flatnonzero(limited[i] == floor[i]), key=lambda j: minimise[i, j])
                  for i in range(limited.shape[0])]
    else:
        chosen = _knapsack(minimise, _cells_up(limited - floor[:, None], slack, cells), cells)
    rows = np.arange(minimise.shape[0])
    total = minimise[rows, chosen].sum() if chosen is not None else np.inf
    for j in np.flatnonzero(uniform_ok):
        if minimise[:, j].sum() < total:
            chosen, total = [j] * minimise.shape[0], minimise[:, j].sum()
    return chosen


def fit_policy(grads_or_table, *, budget_bits: float = 4.0, choices=None, bucket_size=None,
               base: LayerPolicy = LayerPolicy(), objective: str = "error",
               cells: int = DEFAULT_CELLS) -> LayerPolicy:
    """Per-leaf bit widths under a size budget, by an exact dynamic program.

    ``objective="error"`` minimises the total squared error subject to total packet bytes
    <= the bytes of every candidate at ``budget_bits``. A ``budget_bits`` between choices is
    priced as ``buckets * (8 + bucket_size * budget_bits / 8)`` bytes per leaf.
    ``objective="bytes"`` minimises the total bytes subject to total error <= that of uniform
    ``budget_bits`` (which must then be one of ``choices``); the errors are discretised.
    See the module docstring for the discretisation: the budget always holds for the real
    costs, and the result is never worse than uniform ``budget_bits``.

    Args:
      grads_or_table: a gradient pytree (measured with ``layer_errors``) or an ``ErrorTable``.
      budget_bits: the uniform bit width whose size (or error) is the budget.
      choices: candidate widths; default ``(2, 3, 4, 5, 6, 8)``, or the table's (a subset of
        the table's selects columns).
      bucket_size: bucket size of the candidate codecs; default 1024, or the table's.
      base: the policy deciding which leaves are candidates; the result is ``base`` with one
        ``overrides`` entry ``^<path>$`` per candidate (rounding: ``base.default``'s).
      objective: ``"error"`` or ``"bytes"``.
      cells: resolution of the dynamic program.

    Example:
        >>> import cgx_jax as cgx, jax, jax.numpy as jnp
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> grads = {"a": jax.random.normal(k1, (64, 64)),
        ...          "b": 0.01 * jax.random.normal(k2, (64, 64))}
        >>> policy = cgx.fit_policy(grads, budget_bits=4, bucket_size=256,
        ...                         base=cgx.LayerPolicy(min_size=0))
        >>> [codec.bits for _, codec in policy.overrides]  # the larger gradient gets more bits
        [6, 2]
    """
    _check_choice("objective", objective, OBJECTIVES)
    if isinstance(cells, bool) or not isinstance(cells, numbers.Integral) or cells < 1:
        raise ValueError(f"cells must be a positive int, got {cells!r}")
    if not isinstance(base, LayerPolicy):
        raise TypeError(f"base must be a cgx_jax.LayerPolicy, got {type(base).__name__}")
    if isinstance(grads_or_table, ErrorTable):
        table = _select(grads_or_table, choices, bucket_size)
    else:
        # Jitted: one compiled program instead of an eager dispatch per (leaf, bits).
        measure = jax.jit(layer_errors, static_argnums=(1, 2), static_argnames="base")
        table = measure(grads_or_table, _check_choices(DEFAULT_CHOICES if choices is None
                                                       else choices),
                        DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size, base=base)
    errors, nbytes = table.host_errors(), table.bytes
    if not np.all(np.isfinite(errors)):
        raise ValueError("the error table holds NaN or infinite errors (non-finite gradients?)")
    budget = _check_budget(budget_bits, table.choices, objective)
    if objective == "error":
        per_bucket = META_BYTES_PER_BUCKET + table.bucket_size * budget / 8
        limit = math.floor(sum(padded_length(n, table.bucket_size) // table.bucket_size
                               * per_bucket for n in table.sizes) + 1e-9)
        chosen = _solve(errors, nbytes, limit, cells, nbytes.sum(axis=0) <= limit)
    else:
        limit = errors[:, table.choices.index(budget)].sum()
        chosen = _solve(nbytes.astype(np.float64), errors, limit, cells,
                        errors.sum(axis=0) <= limit)
    rounding = base.default.rounding if base.default is not None else "stochastic"
    fitted = tuple((f"^{re.escape(path)}$",
                    Codec(bits=table.choices[j], bucket_size=table.bucket_size,
                          rounding=rounding))
                   for path, j in zip(table.paths, chosen))
    patterns = {p for p, _ in fitted}
    kept = tuple((p, c) for p, c in base.overrides if p not in patterns)
    return dataclasses.replace(base, overrides=fitted + kept)


def _select(table: ErrorTable, choices, bucket_size) -> ErrorTable:
    if bucket_size is not None and bucket_size != table.bucket_size:
        raise ValueError(f"bucket_size {bucket_size!r} differs from the table's "
                         f"{table.bucket_size}; measure a new table with layer_errors")
    if choices is None:
        return table
    choices = _check_choices(choices)
    missing = [b for b in choices if b not in table.choices]
    if missing:
        raise ValueError(f"choices {choices} are not all in the table's {table.choices}")
    columns = [table.choices.index(b) for b in choices]
    return ErrorTable(table.paths, table.sizes, table.host_errors()[:, columns],
                      table.bytes[:, columns], choices, table.bucket_size)


def _check_budget(budget_bits, choices, objective: str):
    if (isinstance(budget_bits, bool) or not isinstance(budget_bits, numbers.Real)
            or not math.isfinite(budget_bits)):
        raise ValueError(f"budget_bits must be a number of bits, got {budget_bits!r}")
    if objective == "bytes":
        if budget_bits not in choices:
            raise ValueError(f"with objective='bytes', budget_bits must be one of the choices "
                             f"{choices} (its uniform error is the budget), got {budget_bits!r}")
        return int(budget_bits)
    if not min(choices) <= budget_bits <= 8:
        raise ValueError(f"budget_bits must be between the smallest choice {min(choices)} and "
                         f"8 (a smaller budget fits no assignment), got {budget_bits!r}")
    return float(budget_bits)


# ---------------------------------------------------------------------------
# Refitting during training
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """When and how ``compressed_allreduce(..., adaptive=config)`` collects error statistics
    and ``refit_policy`` refits: ``budget_bits``, ``choices`` and ``bucket_size`` as for
    ``fit_policy``; a refit is due after ``warmup`` steps and then every ``every`` steps
    (``due(step)``). The state holds the mean error table of the steps since the last due
    step.

    Example:
        >>> import cgx_jax as cgx
        >>> config = cgx.AdaptiveConfig(every=100, warmup=10)
        >>> [s for s in range(300) if config.due(s)]
        [10, 110, 210]
    """

    budget_bits: float = 4.0
    every: int = 100
    warmup: int = 10
    choices: tuple = DEFAULT_CHOICES
    bucket_size: int = DEFAULT_BUCKET_SIZE

    def __post_init__(self):
        object.__setattr__(self, "choices", _check_choices(self.choices))
        _check_budget(self.budget_bits, self.choices, "error")
        Codec(bucket_size=self.bucket_size)  # validates it
        for name, low in (("every", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    def due(self, step) -> bool:
        """Whether the loop should refit after ``step`` completed updates."""
        return step >= max(self.warmup, 1) and (step - self.warmup) % self.every == 0

    def window_start(self, step):
        """First update (0-based) of the statistics window holding update ``step``."""
        after = self.warmup + (step - self.warmup) // self.every * self.every
        return jnp.where(step < self.warmup, 0, after)


class AdaptiveState(NamedTuple):
    """``table``: the mean all-reduced ``ErrorTable`` of the current window; ``steps``: the
    number of updates so far (``int32``)."""

    table: ErrorTable
    steps: jax.Array


def init_adaptive_state(params, config: AdaptiveConfig, base: LayerPolicy) -> AdaptiveState:
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), params)
    table = jax.eval_shape(lambda g: layer_errors(g, config.choices, config.bucket_size,
                                                  base=base), shapes)
    zeros = jnp.zeros(table.errors.shape, jnp.float32)
    return AdaptiveState(jax.tree.map(lambda _: zeros, table), jnp.zeros((), jnp.int32))


def update_adaptive_state(state: AdaptiveState, grads, axis_name, config: AdaptiveConfig,
                          base: LayerPolicy) -> AdaptiveState:
    """Adds this step's all-reduced (``lax.pmean``) error table to the window mean."""
    table = layer_errors(grads, config.choices, config.bucket_size, base=base)
    table = jax.lax.pmean(table, axis_name)
    step = state.steps
    seen = (step - config.window_start(step)).astype(jnp.float32)
    mean = jax.tree.map(lambda old, new: old + (new - old) / (seen + 1.0), state.table, table)
    return AdaptiveState(mean, step + 1)


def refit_policy(state_or_table, config: AdaptiveConfig, *,
                 base: LayerPolicy | None = None) -> LayerPolicy:
    """A new policy from the error statistics in a ``compressed_allreduce(adaptive=config)``
    state (or an optax chain state holding one, or an ``ErrorTable``).

    Host side: a traced step's policy is static, so the loop calls this when
    ``config.due(step)``, then uses a step function built for the returned policy. Policies
    are hashable and the (leaf, bits) choices are finite, so cache compiled step functions in
    a dict keyed by policy: compilations are bounded by the distinct policies met, typically a
    handful. Pass the policy the transform was built with as ``base`` (a fitted policy is a
    valid base: its own overrides are replaced, and the state's table keeps its structure).

    Example:
        >>> import cgx_jax as cgx, jax, jax.numpy as jnp, optax
        >>> config = cgx.AdaptiveConfig(bucket_size=256, every=5, warmup=1)
        >>> base = cgx.LayerPolicy(min_size=0)
        >>> tx = cgx.compressed_allreduce("batch", policy=base, adaptive=config)
        >>> grads = {"w": jax.random.normal(jax.random.key(0), (1, 64, 64))}
        >>> state = jax.pmap(tx.init)(grads)
        >>> _, state = jax.pmap(tx.update, axis_name="batch")(grads, state)
        >>> config.due(1), cgx.refit_policy(state, config, base=base).overrides[0][1].bits
        (True, 4)
    """
    base = LayerPolicy() if base is None else base
    table = _find_table(state_or_table)
    return fit_policy(table, budget_bits=config.budget_bits, choices=config.choices,
                      bucket_size=config.bucket_size, base=base)


def _find_table(state) -> ErrorTable:
    if isinstance(state, ErrorTable):
        return state
    if isinstance(state, AdaptiveState):
        if int(np.max(np.asarray(state.steps))) == 0:
            raise ValueError("no error statistics yet: refit after at least one update")
        return state.table
    adaptive = getattr(state, "adaptive", None)
    if isinstance(adaptive, AdaptiveState):
        return _find_table(adaptive)
    if isinstance(state, (tuple, list)):
        for item in state:
            try:
                return _find_table(item)
            except TypeError:
                continue
    raise TypeError("expected an ErrorTable or an optimizer state holding the state of "
                    f"compressed_allreduce(..., adaptive=...), got {type(state).__name__}")


__all__ = ["AdaptiveConfig", "AdaptiveState", "ErrorTable", "fit_policy", "layer_errors",
           "refit_policy"]
