"""Fitting per-leaf bit widths under a size budget (L-GreCo-style) or a time budget on a
measured link (Kimad-style; docs/design.md section 7).

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
costs and feasible for the real ones (and exactly optimal when the slack is whole bytes, no
more than ``cells``: it then runs on the bytes). The result is then compared with every uniform
assignment that fits the real budget, so it is never worse than uniform ``budget_bits``, and
the fitted error never grows with the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import os
import re
import warnings

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
from cgx_jax._src.link_model import LinkProfile
from cgx_jax._src.policy import LayerPolicy, check_policy
from cgx_jax._src.validation import check_choice

DEFAULT_CELLS = 2000
DEFAULT_BUDGET_BITS = 4  # the size budget when neither budget is given
OBJECTIVES = ("error", "bytes")
# How a leaf's quantization error counts. "relative": over the leaf's mean square, as an
# Adam-style optimizer sees it (it divides each parameter's step by the gradient's running
# magnitude, so the same error moves a leaf of small gradients further); "squared": as is,
# as plain SGD sees it. Measured in docs/performance.md ("Adaptive bits").
ERROR_MEASURES = ("relative", "squared")


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
    extra = limited - floor[:, None]
    if slack == 0 or minimise.shape[0] == 0:
        chosen = [min(np.flatnonzero(limited[i] == floor[i]), key=lambda j: minimise[i, j])
                  for i in range(limited.shape[0])]
    elif np.issubdtype(extra.dtype, np.integer) and slack <= cells:
        chosen = knapsack(minimise, extra, int(slack))  # whole units: no rounding at all
    else:
        chosen = knapsack(minimise, _cells_up(extra, slack, cells), cells)
    rows = np.arange(minimise.shape[0])
    total = minimise[rows, chosen].sum() if chosen is not None else np.inf
    for j in np.flatnonzero(uniform_ok):
        if minimise[:, j].sum() < total:
            chosen, total = [j] * minimise.shape[0], minimise[:, j].sum()
    return chosen


def fit_policy(grads_or_table, *, budget_bits: float | None = None,
               time_budget: float | None = None, link=None, choices=None, bucket_size=None,
               base: LayerPolicy = LayerPolicy(), objective: str = "error",
               error: str = "relative", cells: int = DEFAULT_CELLS) -> LayerPolicy:
    """Per-leaf bit widths under a size or time budget, by an exact dynamic program.

    The error of a leaf is its squared quantization error over its mean square
    (``error="relative"``, the default: what an Adam-style optimizer, which normalises each
    parameter's step, sees) or the squared error as is (``error="squared"``: what SGD sees).

    Size (``budget_bits``, the default: 4): ``objective="error"`` minimises the total
    error subject to total packet bytes <= the bytes of every candidate at ``budget_bits``. A
    ``budget_bits`` between choices is priced as ``buckets * (8 + bucket_size * budget_bits /
    8)`` bytes per leaf. ``objective="bytes"`` minimises the total bytes subject to total
    error <= that of uniform ``budget_bits`` (which must then be one of ``choices``); the
    errors are discretised. See the module docstring for the discretisation: the budget always
    holds for the real costs, and the result is never worse than uniform ``budget_bits``.

    Time (``time_budget`` seconds on ``link``, Kimad-style): minimises the total
    error subject to the step's all-reduce taking at most ``time_budget`` as ``cgx.estimate``
    predicts it on that link (per wire byte, per value, a latency per codec in use, and the
    exact ``psum`` of the leaves ``base`` keeps exact); never worse than the best uniform
    width that fits. A budget no policy meets gives the fastest policy (every candidate at
    the smallest choice) and a ``UserWarning`` saying by how much it misses.

    Args:
      grads_or_table: a gradient pytree (measured with ``layer_errors``) or an ``ErrorTable``.
      budget_bits: the uniform bit width whose size (or error) is the budget.
      time_budget: seconds the all-reduce may take (instead of ``budget_bits``).
      link: with ``time_budget``, the ``LinkProfile`` (or the path ``bench link`` saved it
        to) of these processes and network.
      choices: candidate widths; default ``(2, 3, 4, 5, 6, 8)``, or the table's (a subset of
        the table's selects columns).
      bucket_size: bucket size of the candidate codecs; default 1024, or the table's.
      base: the policy deciding which leaves are candidates; the result is ``base`` with one
        ``overrides`` entry ``^<path>$`` per candidate (rounding: ``base.default``'s).
      objective: ``"error"`` or ``"bytes"`` (``"error"`` only with ``time_budget``).
      error: ``"relative"`` or ``"squared"``; a table without ``squares`` (built by hand)
        is fitted on its squared errors, with a ``UserWarning``.
      cells: resolution of the dynamic program.

    Returns:
      ``base`` with one override per candidate leaf: the fitted ``LayerPolicy``.

    Raises:
      ValueError: a bad ``objective``, ``error``, ``cells``, width or budget; both budgets, or
        ``time_budget`` without ``link``; non-finite errors.
      TypeError: a ``base`` that is not a ``LayerPolicy``, or a ``link`` that is neither a
        ``LinkProfile`` nor a path.
      OSError: a ``link`` path that cannot be read.

    Example:
        >>> import cgx_jax as cgx, jax, jax.numpy as jnp
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> grads = {"a": jax.random.normal(k1, (64, 64)),
        ...          "b": 0.01 * jax.random.normal(k2, (64, 64))}
        >>> policy = cgx.fit_policy(grads, budget_bits=4, bucket_size=256, error="squared",
        ...                         base=cgx.LayerPolicy(min_size=0))
        >>> [codec.bits for _, codec in policy.overrides]  # the larger gradient gets more bits
        [6, 2]
        >>> relative = cgx.fit_policy(grads, budget_bits=4, bucket_size=256,
        ...                           base=cgx.LayerPolicy(min_size=0))
        >>> [codec.bits for _, codec in relative.overrides]  # the same shape: the same bits
        [4, 4]
        >>> link = cgx.LinkProfile(processes=4, exact_latency=1e-3, seconds_per_byte=1e-8,
        ...                        compressed_latency=1e-3, seconds_per_wire_byte=1e-6,
        ...                        seconds_per_value=0.0)
        >>> timed = cgx.fit_policy(grads, time_budget=0.006, link=link, bucket_size=256,
        ...                        error="squared", base=cgx.LayerPolicy(min_size=0))
        >>> [codec.bits for _, codec in timed.overrides]  # two codecs, two 1 ms latencies
        [5, 2]
    """
    check_choice("objective", objective, OBJECTIVES)
    check_choice("error", error, ERROR_MEASURES)
    if isinstance(cells, bool) or not isinstance(cells, numbers.Integral) or cells < 1:
        raise ValueError(f"cells must be a positive int, got {cells!r}")
    check_policy(base, "base")
    profile = _time_budget_link(budget_bits, time_budget, link, objective)
    if isinstance(grads_or_table, ErrorTable):
        table = _select(grads_or_table, choices, bucket_size)
    else:
        table = _measure(grads_or_table, check_choices(DEFAULT_CHOICES if choices is None
                                                       else choices),
                        DEFAULT_BUCKET_SIZE if bucket_size is None else bucket_size, base=base)
    errors = table.host_errors()
    if not np.all(np.isfinite(errors)):
        raise ValueError("the error table holds NaN or infinite errors (non-finite gradients?)")
    if error == "relative":
        errors = relative_errors(table, errors)
    if profile is not None:
        chosen = _fit_to_time(table, errors, time_budget, profile, cells)
    else:
        chosen = _fit_to_size(table, errors, budget_bits, objective, cells)
    rounding = base.default.rounding if base.default is not None else "stochastic"
    fitted = tuple((f"^{re.escape(path)}$",
                    Codec(bits=table.choices[j], bucket_size=table.bucket_size,
                          rounding=rounding))
                   for path, j in zip(table.paths, chosen))
    patterns = {p for p, _ in fitted}
    kept = tuple((p, c) for p, c in base.overrides if p not in patterns)
    return dataclasses.replace(base, overrides=fitted + kept)


def relative_errors(table: ErrorTable, errors: np.ndarray) -> np.ndarray:
    """``errors`` over each leaf's mean square (a leaf of zeros: no error at any width); a
    table without ``squares`` keeps its squared errors, with a warning."""
    squares = table.host_squares()
    if squares is None:
        warnings.warn("this ErrorTable has no squares (measure it with cgx.layer_errors): "
                      "fitted on its squared errors, as error='squared'", UserWarning,
                      stacklevel=3)
        return errors
    mean_square = squares / np.asarray(table.sizes, np.float64)
    safe = np.where(mean_square > 0, mean_square, 1.0)
    return np.where(mean_square[:, None] > 0, errors / safe[:, None], 0.0)


# Jitted once, here: one compiled program instead of an eager dispatch per (leaf, bits), and
# a cache hit when fit_policy measures gradients of the same shapes again.
_measure = jax.jit(layer_errors, static_argnums=(1, 2), static_argnames="base")


def _fit_to_size(table: ErrorTable, errors, budget_bits, objective: str, cells):
    """Columns under the size budget: the least error within uniform ``budget_bits``' bytes,
    or the fewest bytes within its error."""
    nbytes = table.bytes
    budget = check_budget(DEFAULT_BUDGET_BITS if budget_bits is None else budget_bits,
                          table.choices, objective)
    if objective == "error":
        per_bucket = META_BYTES_PER_BUCKET + table.bucket_size * budget / 8
        limit = math.floor(sum(padded_length(n, table.bucket_size) // table.bucket_size
                               * per_bucket for n in table.sizes) + 1e-9)
        return _solve(errors, nbytes, limit, cells, nbytes.sum(axis=0) <= limit)
    limit = errors[:, table.choices.index(budget)].sum()
    return _solve(nbytes.astype(np.float64), errors, limit, cells, errors.sum(axis=0) <= limit)


def _time_budget_link(budget_bits, time_budget, link, objective) -> LinkProfile | None:
    """The ``LinkProfile`` of a time budget (``None`` for a size budget), every argument
    checked."""
    if time_budget is None:
        if link is not None:
            raise ValueError("link= is only taken with time_budget= (the seconds the "
                             "all-reduce may take on that link)")
        return None
    if budget_bits is not None:
        raise ValueError(f"give one budget: budget_bits={budget_bits!r} (a size) or "
                         f"time_budget={time_budget!r} (seconds), not both")
    if objective != "error":
        raise ValueError(f"time_budget minimises the error (objective='error'), got "
                         f"objective={objective!r}")
    check_time_budget(time_budget)
    if link is None:
        raise ValueError("time_budget needs link=: the cgx.LinkProfile (or the JSON path) "
                         "that python -m cgx_jax.bench link measured for these processes")
    if isinstance(link, LinkProfile):
        return link
    if isinstance(link, (str, os.PathLike)):
        return LinkProfile.load(link)
    raise TypeError(f"link must be a cgx.LinkProfile or the path of one, got "
                    f"{type(link).__name__}")


def check_time_budget(time_budget) -> None:
    if (isinstance(time_budget, bool) or not isinstance(time_budget, numbers.Real)
            or not math.isfinite(time_budget) or time_budget <= 0):
        raise ValueError(f"time_budget must be the all-reduce's seconds, a finite number > 0, "
                         f"got {time_budget!r}")


def predicted_seconds(table: ErrorTable, profile: LinkProfile, columns) -> float:
    """The all-reduce's seconds on ``profile`` when candidate ``i`` takes column
    ``columns[i]`` of ``table`` (as ``cgx.estimate`` predicts a policy's)."""
    rows = np.arange(len(table.paths))
    wire = int(table.bytes[rows, list(columns)].sum())
    return profile.allreduce_seconds(wire, sum(table.sizes), len(set(columns)),
                                     table.exact_bytes)


def _fit_to_time(table: ErrorTable, errors, seconds: float, profile: LinkProfile, cells):
    """Columns minimising the total error with ``predicted_seconds <= seconds``. Each codec
    in use is a buffer paying the compressed latency, so every set of widths gets its own
    byte limit and DP (at most 2^8 - 1 sets); the best of them is optimal."""
    columns = len(table.choices)
    if not table.paths:
        return []
    # What does not depend on the widths: no bytes, no buffer (the kernels, the exact psum).
    fixed = profile.allreduce_seconds(0, sum(table.sizes), 0, table.exact_bytes)
    most = int(table.bytes.sum())  # more than any assignment sends
    best, best_error = None, np.inf
    for count in range(1, columns + 1):
        for widths in itertools.combinations(range(columns), count):
            room = seconds - fixed - profile.compressed_latency * count
            if room < 0:
                continue
            # Down to whole bytes (up would overrun the budget); + 1e-9: a budget equal to an
            # assignment's time, up to float rounding, fits it.
            limit = (most if profile.seconds_per_wire_byte <= 0
                     else min(most, math.floor(room / profile.seconds_per_wire_byte + 1e-9)))
            sub = list(widths)
            chosen = _solve(errors[:, sub], table.bytes[:, sub], limit, cells,
                            table.bytes[:, sub].sum(axis=0) <= limit)
            if chosen is None:
                continue
            picked = [sub[j] for j in chosen]
            error = errors[np.arange(len(picked)), picked].sum()
            if error < best_error:
                best, best_error = picked, error
    if best is None:  # the smallest width, one codec: the least bytes and one latency
        best = [0] * len(table.paths)
        fastest = predicted_seconds(table, profile, best)
        warnings.warn(
            f"no policy meets time_budget={seconds * 1e3:.3g} ms on this link: the fastest "
            f"(every candidate at {table.choices[0]} bits) takes {fastest * 1e3:.3g} ms, "
            f"{(fastest - seconds) * 1e3:.3g} ms over; fitted that one", UserWarning,
            stacklevel=3)
    return best


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
                      table.bytes[:, columns], choices, table.bucket_size, table.exact_bytes,
                      table.host_squares())


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
