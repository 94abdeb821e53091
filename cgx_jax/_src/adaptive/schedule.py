"""Refitting the policy during training (docs/design.md section 7): when a refit is due,
the error statistics ``compressed_allreduce(..., adaptive=config)`` keeps in its state, and
``refit_policy``, which turns them into a new policy on the host.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.adaptive.fit import (
    DEFAULT_BUDGET_BITS,
    ERROR_MEASURES,
    check_budget,
    check_time_budget,
    fit_policy,
)
from cgx_jax._src.adaptive.measure import (
    DEFAULT_BUCKET_SIZE,
    DEFAULT_CHOICES,
    ErrorTable,
    check_choices,
    layer_errors,
)
from cgx_jax._src.codec import Codec
from cgx_jax._src.policy import LayerPolicy
from cgx_jax._src.validation import check_choice


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """When and how ``compressed_allreduce(..., adaptive=config)`` collects error statistics
    and ``refit_policy`` refits. A refit is due after ``warmup`` steps and then every
    ``every`` steps (``due(step)``); the state holds the mean error table of the steps since
    the last due step, measured on one update in ``sample_every``. One budget:
    ``budget_bits`` (4 when neither is given) or ``time_budget``.

    Attributes:
      budget_bits: the mean wire bits per value a refit may spend, as for ``fit_policy``.
      every: steps between refits (an int >= 1).
      warmup: steps before the first refit (an int >= 0).
      choices: the candidate bit widths, as for ``fit_policy``.
      bucket_size: the bucket size of every candidate codec.
      time_budget: the seconds the all-reduce may take: each refit fits the bits to it on
        the link ``refit_policy`` is given (the one last measured), as ``fit_policy`` does.
      error: how a leaf's error counts, as for ``fit_policy``: ``"relative"`` (over the
        leaf's mean square; for Adam-style optimizers) or ``"squared"`` (for SGD).
      sample_every: the error table is measured on the first update of each window and then
        on every ``sample_every``-th (an int >= 1; 1: every update). Measuring quantizes
        every gradient at every candidate width, which costs more than the all-reduce on a
        CPU; the default 10 gives a window of 100 updates 10 samples.

    Raises:
      ValueError: a budget outside the choices' range or both budgets, bad choices, a bad
        bucket size or ``error``, a ``time_budget`` not a number > 0, or
        ``every``/``warmup`` not an int of at least 1/0.

    Example:
        >>> import cgx_jax as cgx
        >>> config = cgx.AdaptiveConfig(every=100, warmup=10)
        >>> [s for s in range(300) if config.due(s)]
        [10, 110, 210]
    """

    budget_bits: float | None = None
    every: int = 100
    warmup: int = 10
    choices: tuple = DEFAULT_CHOICES
    bucket_size: int = DEFAULT_BUCKET_SIZE
    time_budget: float | None = None
    sample_every: int = 10
    error: str = "relative"

    def __post_init__(self):
        object.__setattr__(self, "choices", check_choices(self.choices))
        check_choice("error", self.error, ERROR_MEASURES)
        if self.time_budget is None:
            check_budget(DEFAULT_BUDGET_BITS if self.budget_bits is None else self.budget_bits,
                         self.choices, "error")
        elif self.budget_bits is not None:
            raise ValueError(f"give one budget: budget_bits={self.budget_bits!r} or "
                             f"time_budget={self.time_budget!r}, not both")
        else:
            check_time_budget(self.time_budget)
        Codec(bucket_size=self.bucket_size)  # validates it
        for name, low in (("every", 1), ("warmup", 0), ("sample_every", 1)):
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
    zeros = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), table)
    return AdaptiveState(zeros, jnp.zeros((), jnp.int32))


def update_adaptive_state(state: AdaptiveState, grads, axis_name, config: AdaptiveConfig,
                          base: LayerPolicy) -> AdaptiveState:
    """Adds this step's all-reduced (``lax.pmean``) error table to the window mean when the
    step is sampled (``config.sample_every``); other steps skip the measurement."""
    step = state.steps
    since = step - config.window_start(step)  # updates of this window before this one
    seen = (since // config.sample_every).astype(jnp.float32)  # samples before this one

    def add_sample(old):
        table = layer_errors(grads, config.choices, config.bucket_size, base=base)
        table = jax.lax.pmean(table, axis_name)
        return jax.tree.map(lambda old, new: old + (new - old) / (seen + 1.0), old, table)

    mean = jax.lax.cond(since % config.sample_every == 0, add_sample, lambda old: old,
                        state.table)
    return AdaptiveState(mean, step + 1)


def refit_policy(state_or_table, config: AdaptiveConfig, *,
                 base: LayerPolicy | None = None, link=None) -> LayerPolicy:
    """A new policy from the error statistics in a ``compressed_allreduce(adaptive=config)``
    state (or an optax chain state holding one, or an ``ErrorTable``).

    Host side: a traced step's policy is static, so the loop calls this when
    ``config.due(step)``, then uses a step function built for the returned policy. Policies
    are hashable and the (leaf, bits) choices are finite, so cache compiled step functions in
    a dict keyed by policy: compilations are bounded by the distinct policies met, typically a
    handful. Pass the policy the transform was built with as ``base`` (a fitted policy is a
    valid base: its own overrides are replaced, and the state's table keeps its structure).

    Args:
      state_or_table: the optimizer state (or an ``ErrorTable``).
      config: the ``AdaptiveConfig`` the transform was built with.
      base: the policy the transform was built with (default ``LayerPolicy()``).
      link: with ``config.time_budget``, the ``LinkProfile`` (or its path) of the link as
        last measured: a link that slowed gets fewer bits, one that recovered more.

    Returns:
      The fitted ``LayerPolicy``.

    Raises:
      TypeError: a state without ``compressed_allreduce(adaptive=...)`` statistics.
      ValueError: ``config.time_budget`` without ``link``, or ``link`` without it.

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
    return fit_policy(table, budget_bits=config.budget_bits, time_budget=config.time_budget,
                      link=link, choices=config.choices, bucket_size=config.bucket_size,
                      base=base, error=config.error)


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
