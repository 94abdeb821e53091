"""``compressed_allreduce``: an Optax gradient transformation that all-reduces gradients
with cgx_jax inside ``pmap``/``shard_map``, optionally with error feedback
(docs/design.md section 6).

Put it first in the chain, so every later transformation sees the same reduced gradient on
every replica::

    tx = optax.chain(cgx.compressed_allreduce("batch"), optax.adamw(1e-3))
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cgx_jax._src import flax_compat
from cgx_jax._src.adaptive import schedule
from cgx_jax._src.api import reduce_tree, reduce_tree_with_residual
from cgx_jax._src.axes import axis_tuple
from cgx_jax._src.policy import (
    LayerPolicy,
    add_residual,
    check_policy,
    leaf_paths,
    residual_shape,
)
from cgx_jax._src.seeds import key_or_deprecated_seed, next_keys, raw_key
from cgx_jax._src.vma import check_local


class CompressedAllReduceState(NamedTuple):
    """The state of ``compressed_allreduce``: plain arrays, so it checkpoints like any
    optimizer state.

    Attributes:
      rng_key: raw ``uint32[2]`` PRNG key, split every step (fresh, reproducible stochastic
        rounding noise).
      residual: with error feedback, what the last step's local compression lost: a pytree
        of f32 arrays of shape ``(1, *gradient_shape)`` for the leaves the policy compresses
        (``(1, 1)``, one zero, for the exact ones, which lose nothing), one row per
        participant, so under ``shard_map`` it is sharded over the data axis
        (``state_specs``/``shard_state``) and every participant's residual is saved in a
        checkpoint; ``None`` without it.
      adaptive: with ``adaptive=``, the ``AdaptiveState`` (error statistics for
        ``cgx.refit_policy``); ``None`` without it.

    Example:
        >>> import jax.numpy as jnp, cgx_jax as cgx
        >>> state = cgx.compressed_allreduce("data").init({"w": jnp.zeros((4, 4))})
        >>> isinstance(state, cgx.CompressedAllReduceState), state.residual
        (True, None)
    """

    rng_key: jax.Array
    residual: Any
    adaptive: Any = None


class CompressedAllReduce(optax.GradientTransformation):
    """``compressed_allreduce``'s transform: an ``optax.GradientTransformation`` that also
    carries the ``policy`` it runs with (``cgx.summary(tx, params)`` reads it)."""

    policy: LayerPolicy


def compressed_allreduce(axis_name, *, policy: LayerPolicy | None = None, mean: bool = True,
                         error_feedback: bool = False, key=None, algorithm: str = "auto",
                         backend: str = "ffi",
                         adaptive: schedule.AdaptiveConfig | None = None,
                         seed: int | None = None) -> CompressedAllReduce:
    """All-reduces gradients with compressed ``psum`` (``pmean`` when ``mean``) over
    ``axis_name``; must run inside ``pmap``/``shard_map`` with that axis bound.

    Args:
      axis_name: the data-parallel axis (or tuple of mesh axes).
      policy: per-leaf codecs; ``None`` means ``LayerPolicy()`` (4-bit stochastic buckets of
        128 for matrices of at least 16K values, everything else exact).
      mean: average (``True``) or sum the gradients over participants.
      error_feedback: add what each participant's compression lost to its next gradient
        (EF-SGD); the residual lives in the state.
      key: the PRNG key of the stochastic rounding noise (``jax.random.key(0)`` by default),
        kept in the state as ``rng_key`` and split every step, as optax's own noisy
        transformations do.
      algorithm, backend: as for ``cgx.compressed_psum``.
      adaptive: a ``cgx.AdaptiveConfig``: every step, also measure the error table of this
        participant's gradient (``cgx.layer_errors`` of the leaves ``policy`` compresses),
        ``lax.pmean`` it so every replica agrees, and keep its mean over the current window
        in the state. The policy of a traced step is static: the training loop calls
        ``cgx.refit_policy(state, config, base=policy)`` when ``config.due(step)`` and
        continues with a transform (and step function, cached by policy) built for the
        returned policy, passing the same state.
      seed: deprecated (warns): ``key=jax.random.key(seed)`` gives the same noise.

    Put it before ``optax.apply_if_finite`` (a NaN on one replica becomes a NaN bucket on all
    of them, so every replica skips the step together) and inside ``optax.MultiSteps`` (the
    all-reduce then runs only on the real step).

    Returns:
      A ``CompressedAllReduce``: an ``optax.GradientTransformation`` (state:
      ``CompressedAllReduceState``) whose ``policy`` attribute is the policy it runs.

    Raises:
      TypeError: a ``policy``, ``key`` or ``adaptive`` of the wrong type.

    Example:
        >>> import jax, jax.numpy as jnp, optax, cgx_jax as cgx
        >>> tx = optax.chain(cgx.compressed_allreduce("batch"), optax.sgd(0.1))
        >>> params = {"w": jnp.ones((128, 128))}  # 16,384 values: the default policy compresses it
        >>> def step(params, state, grads):
        ...     updates, state = tx.update(grads, state, params)
        ...     return optax.apply_updates(params, updates), state
        >>> state = tx.init(params)
        >>> new, state = jax.pmap(step, axis_name="batch")(
        ...     jax.tree.map(lambda p: p[None], params), jax.tree.map(lambda s: s[None], state),
        ...     {"w": jnp.ones((1, 128, 128))})
        >>> new["w"].shape
        (1, 128, 128)
    """
    policy = check_policy(policy)
    first_key = raw_key(key_or_deprecated_seed(key, seed, "cgx.compressed_allreduce"))
    if adaptive is not None and not isinstance(adaptive, schedule.AdaptiveConfig):
        raise TypeError(f"adaptive must be a cgx_jax.AdaptiveConfig or None, got "
                        f"{type(adaptive).__name__}")

    def init_fn(params):
        residual = None
        if error_feedback:  # a row for the leaves the policy compresses, a zero for the rest
            leaves, treedef = jax.tree.flatten(params)
            residual = jax.tree.unflatten(treedef, [
                jnp.zeros((1, *residual_shape(codec, jnp.shape(p))), jnp.float32)
                for p, codec in zip(leaves, policy.resolve_leaves(params))])
        stats = (None if adaptive is None
                 else schedule.init_adaptive_state(params, adaptive, policy))
        return CompressedAllReduceState(rng_key=first_key, residual=residual,
                                        adaptive=stats)

    def update_fn(updates, state, params=None):
        del params
        rng_key, step_key = next_keys(state.rng_key)
        # Before the residual is added: a varying residual would hide reduced gradients.
        check_local(updates, axis_name, leaf_paths(updates), "compressed_allreduce")
        if error_feedback:
            updates = jax.tree.map(lambda g, r: add_residual(g, r[0]), updates,
                                   state.residual)
        stats = (None if adaptive is None else schedule.update_adaptive_state(
            state.adaptive, updates, axis_name, adaptive, policy))
        settings = dict(policy=policy, key=step_key, algorithm=algorithm, backend=backend,
                        mean=mean)
        if not error_feedback:
            return reduce_tree(updates, axis_name, **settings), CompressedAllReduceState(
                rng_key, None, stats)
        reduced, new = reduce_tree_with_residual(updates, axis_name, **settings)
        # The residual keeps init's layout: a leaf the policy kept exact at init (or an
        # adaptive policy has since compressed) keeps its zero.
        residual = jax.tree.map(lambda n, r: n[None] if r.shape[1:] == n.shape else r,
                                new, state.residual)
        return reduced, CompressedAllReduceState(rng_key, residual, stats)

    transform = CompressedAllReduce(init_fn, update_fn)
    transform.policy = policy
    return transform


def _is_cgx_state(node) -> bool:
    return isinstance(node, CompressedAllReduceState)


def state_specs(state, axis_name):
    """``PartitionSpec``s for an optimizer state holding ``compressed_allreduce``'s state, to
    use as the state's ``in_specs``/``out_specs`` of ``jax.shard_map``: ``P(axis_name)`` for
    the per-participant leaves (the error-feedback residual, one row per participant), ``P()``
    for everything else (replicated).

    Args:
      state: the optimizer state.
      axis_name: the data-parallel axis (or tuple of axes).

    Returns:
      A pytree of ``PartitionSpec``s with ``state``'s structure (NNX Variables as leaves).

    Raises:
      TypeError: an ``nnx.Optimizer`` or its state.

    Example:
        >>> import jax.numpy as jnp, optax, cgx_jax as cgx
        >>> tx = optax.chain(cgx.compressed_allreduce("batch", error_feedback=True),
        ...                  optax.sgd(0.1))
        >>> specs = cgx.state_specs(tx.init({"w": jnp.zeros((4, 4))}), "batch")
        >>> from jax.sharding import PartitionSpec as P
        >>> specs[0].residual == {"w": P("batch")}, specs[0].rng_key == P()
        (True, True)
    """
    _refuse_nnx_optimizer(state, "state_specs")
    # nnx.shard_map takes one spec per Variable, not one for the array inside it.
    return _specs(state, axis_name, flax_compat.is_variable)


def _refuse_nnx_optimizer(state, what: str) -> None:
    """An ``nnx.Optimizer`` (or its ``nnx.State``) wraps every optimizer leaf in a Variable,
    so the per-participant residual cannot be told apart from replicated leaves: placing it
    as one of them would silently keep one residual for all participants."""
    if flax_compat.is_optimizer_or_state(state):
        raise TypeError(
            f"cgx.{what} takes an optax state (tx.init(params)), not an "
            f"{type(state).__name__}: inside an nnx.Optimizer the error-feedback residual "
            f"cannot be laid out one row per participant. With nnx.Optimizer use "
            f"cgx.value_and_grad(loss_fn, mesh=..., axis_name=..., error_feedback=True) in a "
            f"jax.jit/nnx.jit step, with the residual from cgx.init_residual(model, ...) "
            f"kept next to the optimizer (README, 'Use')")


def _specs(state, axis_name, is_leaf=None):
    per_participant = PartitionSpec(axis_name)
    replicated = PartitionSpec()

    def specs(node):
        if _is_cgx_state(node):
            return CompressedAllReduceState(
                rng_key=replicated,
                residual=jax.tree.map(lambda _: per_participant, node.residual,
                                      is_leaf=is_leaf),
                adaptive=jax.tree.map(lambda _: replicated, node.adaptive, is_leaf=is_leaf))
        return replicated

    return jax.tree.map(specs, state,
                        is_leaf=lambda x: _is_cgx_state(x) or bool(is_leaf and is_leaf(x)))


def shard_state(state, mesh: Mesh, axis_name):
    """Places an optimizer state on ``mesh`` as ``state_specs`` says: per-participant leaves
    with one row per participant along ``axis_name`` (a row of ``tx.init``'s output is
    repeated for every participant; a state restored from a checkpoint, with all its rows,
    is placed as it is), the rest replicated.

    Args:
      state: the optimizer state (``tx.init(params)``, or one restored from a checkpoint).
      mesh: the mesh of the step.
      axis_name: its data-parallel axis (or tuple of axes).

    Returns:
      The state with every leaf placed on ``mesh``.

    Raises:
      ValueError: a per-participant leaf with neither 1 nor one row per participant.
      TypeError: an ``nnx.Optimizer`` or its state.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax, cgx_jax as cgx
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(np.array(jax.devices()), ("batch",))
        >>> tx = cgx.compressed_allreduce("batch", error_feedback=True)
        >>> state = cgx.shard_state(tx.init({"w": jnp.zeros((128, 128))}), mesh, "batch")
        >>> state.residual["w"].shape == (len(jax.devices()), 128, 128)
        True
    """
    _refuse_nnx_optimizer(state, "shard_state")
    rows = math.prod(mesh.shape[a] for a in axis_tuple(axis_name))

    def place(leaf, spec):
        if spec == PartitionSpec() or leaf.shape[0] == rows:
            return jax.device_put(leaf, NamedSharding(mesh, spec))
        if leaf.shape[0] != 1:
            raise ValueError(f"a per-participant state leaf must have 1 or {rows} rows (the "
                             f"participants of {axis_name!r}), got shape {leaf.shape}")
        tiled = jnp.broadcast_to(leaf, (rows, *leaf.shape[1:]))
        return jax.device_put(tiled, NamedSharding(mesh, spec))

    return jax.tree.map(place, state, _specs(state, axis_name))
