"""Local gradients under ``shard_map``'s varying/invariant typing (docs/design.md section 6).

Inside ``jax.shard_map`` with its default ``check_vma=True``, JAX types every value as
*varying* over a mesh axis (it may differ between participants) or *invariant* (the same on
all of them). Parameters passed in replicated (``P()``) are invariant, so ``jax.grad`` with
respect to them already sums the gradient over the axis (the transpose of the implicit
broadcast is an exact ``psum``): the gradients arrive reduced. Reducing them again with
``compressed_psum`` would add N identical copies. So:

- ``check_local`` refuses a value that is invariant over an axis it is asked to reduce over
  (``compressed_psum``/``compressed_pmean`` and ``compressed_allreduce`` call it);
- ``local_value_and_grad`` takes the gradient with respect to a *varying* copy of the
  parameters, so each participant gets its own local gradient and the only reduction is
  cgx's.

Under ``pmap`` and ``shard_map(check_vma=False)`` JAX tracks nothing (every value's type
says invariant, gradients are local already): nothing is refused and nothing is cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from cgx_jax._src import flax_compat
from cgx_jax._src.axes import axis_tuple
from cgx_jax._src.seeds import participant_key


def varying_axes(value) -> frozenset:
    """The mesh axes ``value`` is typed varying over (empty where JAX does not say)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax 0.7 - 0.9


def vma_checked(axis_name) -> bool:
    """Whether the enclosing ``shard_map`` checks varying axes for ``axis_name``: only then is
    ``lax.axis_index`` typed varying (under ``pmap`` and ``check_vma=False`` it is not)."""
    return bool(varying_axes(lax.axis_index(axis_name)))


def check_local(tree, axis_name, paths, what: str = "the compressed all-reduce") -> None:
    """``ValueError`` when vma checking is on and a leaf of ``tree`` (named by ``paths``) is
    invariant over an axis of ``axis_name``: it is already reduced (or replicated), and
    reducing it again would count it N times."""
    axes = axis_tuple(axis_name)
    if not vma_checked(axes):
        return
    for path, leaf in zip(paths, jax.tree_util.tree_leaves(tree)):
        missing = tuple(a for a in axes if a not in varying_axes(leaf))
        if missing:
            leaf_name = f"leaf {path!r}" if path else "an array"
            raise ValueError(
                f"{what} got {leaf_name} typed invariant over mesh axes {missing} inside "
                f"shard_map (check_vma=True): every participant already holds the same value, "
                f"so summing it would count it {lax.axis_size(missing)} times. "
                f"Gradients arrive like this when jax.grad differentiates parameters passed in "
                f"replicated (P()): JAX then reduces them exactly, and cgx would reduce them a "
                f"second time. Take local gradients with cgx.local_value_and_grad(loss_fn, "
                f"{axis_name!r}) (or jax.lax.pcast(params, {axis_name!r}, to='varying') before "
                f"jax.grad) and reduce those; see the README's 'Use' section.")


def _cast_tovarying_axes(x, axes):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if hasattr(lax, "pcast"):  # jax >= 0.9
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)


def to_local(tree, axis_name):
    """``tree`` with every leaf typed varying over ``axis_name`` (a no-op where vma checking
    is off or a leaf is varying already), so ``jax.grad`` with respect to it gives each
    participant its local gradient, with no reduction inserted."""
    axes = axis_tuple(axis_name)
    if not vma_checked(axes):
        return tree
    return jax.tree.map(lambda x: _cast_tovarying_axes(x, axes), tree)


def local_value_and_grad(fun, axis_name, *, argnums=0, has_aux: bool = False):
    """``jax.value_and_grad(fun, argnums, has_aux)`` that returns each participant's *local*
    loss and gradients inside ``shard_map`` (either ``check_vma``) or ``pmap``: the
    differentiated arguments are cast to varying over ``axis_name`` first, so JAX inserts no
    reduction and the gradients are ready for ``cgx.compressed_pmean`` or
    ``cgx.compressed_allreduce``.

    A Flax NNX module among them is differentiated with ``nnx.value_and_grad`` (its gradient
    is an ``nnx.State``), and its other state is left as ``nnx.value_and_grad`` over the
    global batch would leave it: RNG streams advance once per call, each participant drawing
    its own noise (dropout masks differ between participants, as over one global batch);
    floating state the loss changes (BatchNorm statistics) is averaged over ``axis_name``;
    integer state that comes out different on each participant is refused with a
    ``ValueError`` naming it (docs/design.md section 6).

    Args:
      fun: the loss, ``fun(*args) -> scalar`` (``(scalar, aux)`` with ``has_aux``).
      axis_name: the bound data-parallel axis (or tuple of axes).
      argnums, has_aux: as for ``jax.value_and_grad``.

    Returns:
      A function of ``fun``'s arguments returning ``(value, grads)`` (``((value, aux),
      grads)`` with ``has_aux``): this participant's own loss and gradients.

    Raises:
      ValueError: integer module state that differs between participants.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, cgx_jax as cgx
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()), ("batch",))
        >>> def step(w, x):  # w replicated, x this participant's rows
        ...     loss, g = cgx.local_value_and_grad(lambda w: jnp.sum(w * x), "batch")(w)
        ...     return cgx.compressed_pmean(g, "batch", codec=cgx.Codec(rounding="nearest"))
        >>> f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
        >>> f(jnp.ones(1024), jnp.full((len(jax.devices()), 1024), 3.0))[:3]  # not N * 3
        Array([3., 3., 3.], dtype=float32)
    """
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def wrapped(*args, **kwargs):
        args = list(args)
        modules = {}
        for i in positions:
            if flax_compat.is_module(args[i]):
                modules[i] = args[i]
                args[i] = _local_copy(args[i], axis_name)
            else:
                args[i] = to_local(args[i], axis_name)
        if modules:
            grad_fn = flax_compat.nnx().value_and_grad(fun, argnums=argnums, has_aux=has_aux)
        else:
            grad_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
        out = grad_fn(*args, **kwargs)
        for i, module in modules.items():
            _carry_back_state(args[i], module, axis_name)
        return out

    return wrapped


def _local_copy(module, axis_name):
    """A copy of NNX ``module`` whose parameters are varying over ``axis_name`` (local
    gradients) and whose RNG keys are folded with the participant's index (its own dropout
    masks); the module passed in keeps its keys."""
    nnx = flax_compat.nnx()
    graphdef, params, keys, rest = nnx.split(module, nnx.Param, nnx.RngKey, ...)
    index = lax.axis_index(axis_tuple(axis_name))
    keys = jax.tree.map(lambda key: participant_key(key, index), keys)
    rest = jax.tree.map(lambda value: value, rest)  # new Variables: the module's stay as they are
    return nnx.merge(graphdef, to_local(params, axis_name), keys, rest)


def _carry_back_state(copy, module, axis_name) -> None:
    """Updates ``module`` with the state the loss left in ``copy`` besides parameters and RNG
    keys (RNG counts, batch statistics, any other variable), agreed over ``axis_name``."""
    nnx = flax_compat.nnx()
    carried = nnx.Not(nnx.Any(nnx.Param, nnx.RngKey))
    after, before = nnx.state(copy, carried), nnx.state(module, carried)
    before = dict(jax.tree_util.tree_leaves_with_path(before))
    agreed = jax.tree_util.tree_map_with_path(
        lambda path, new: _agree(new, before.get(path), axis_name, path), after)
    nnx.update(module, agreed)


def _agree(new, old, axis_name, path):
    """One state value after the loss, the same on every participant of ``axis_name``:
    unchanged where it is per participant by design (passed in varying) or did not come out
    varying; averaged when floating; refused when integer. Where JAX types nothing (``pmap``,
    ``check_vma=False``) every floating value is averaged."""
    axes = axis_tuple(axis_name)
    if not vma_checked(axes):
        return lax.pmean(new, axes) if jnp.issubdtype(new.dtype, jnp.inexact) else new
    if old is not None and set(axes) <= varying_axes(old):
        return new
    if not set(axes) & varying_axes(new):
        return new
    if jnp.issubdtype(new.dtype, jnp.inexact):
        return lax.pmean(to_local(new, axes), axes)
    raise ValueError(
        f"cgx.local_value_and_grad: the loss changed the module's variable "
        f"{jax.tree_util.keystr(path)} ({new.dtype}) "
        f"differently on each participant of {axis_name!r}: floating state is averaged over "
        f"the participants, but integer state cannot be; keep it out of the loss or make it "
        f"floating")
