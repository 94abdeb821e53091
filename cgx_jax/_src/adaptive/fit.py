"""Fitting per-leaf bit widths under a size budget (L-GreCo-style; docs/design.md section 7).

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

import jax
import numpy as np

from cgx_jax._src.adaptive.measure import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_CHOICES,
    ErrorTable,
    check_choices,
    layer_errors,
)
from cgx_jax._src.codec import META_BYTES_PER_BUCKET, Codec, padded_length
from cgx_jax._src.policy import LayerPolicy, check_policy
from cgx_jax._src.validation import check_choice

DEFAULT_CELLS = 2000
OBJECTIVES = ("error", "bytes")


def knapsack(values: np.ndarray, costs: np.ndarray, capacity: int):
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
        chosen = knapsack(minimise, _cells_up(limited - floor[:, None], slack, cells), cells)
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

    Returns:
      ``base`` with one override per candidate leaf: the fitted ``LayerPolicy``.

    Raises:
      ValueError: a bad ``objective``, ``cells``, width or budget; non-finite errors.
      TypeError: a ``base`` that is not a ``LayerPolicy``.

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
    check_choice("objective", objective, OBJECTIVES)
    if isinstance(cells, bool) or not isinstance(cells, numbers.Integral) or cells < 1:
        raise ValueError(f"cells must be a positive int, got {cells!r}")
    check_policy(base, "base")
    if isinstance(grads_or_table, ErrorTable):
        table = _select(grads_or_table, choices, bucket_size)
    else:
        # Jitted: one compiled program instead of an eager dispatch per (leaf, bits).
        measure = jax.jit(layer_errors, static_argnums=(1, 2), static_argnames="base")
        table = measure(grads_or_table, check_choices(DEFAULT_CHOICES if choices is None
                                                       else choices),
                        DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size, base=base)
    errors, nbytes = table.host_errors(), table.bytes
    if not np.all(np.isfinite(errors)):
        raise ValueError("the error table holds NaN or infinite errors (non-finite gradients?)")
    budget = check_budget(budget_bits, table.choices, objective)
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
    choices = check_choices(choices)
    missing = [b for b in choices if b not in table.choices]
    if missing:
        raise ValueError(f"choices {choices} are not all in the table's {table.choices}")
    columns = [table.choices.index(b) for b in choices]
    return ErrorTable(table.paths, table.sizes, table.host_errors()[:, columns],
                      table.bytes[:, columns], choices, table.bucket_size)


def check_budget(budget_bits, choices, objective: str):
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
