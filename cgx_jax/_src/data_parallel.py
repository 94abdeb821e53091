"""``cgx.value_and_grad``: compressed data-parallel gradients from inside plain ``jax.jit`` or
``nnx.jit``, on any mesh (docs/design.md section 6).

A step written for GSPMD (``jax.jit`` with sharded inputs, XLA inserting the collectives)
gets an exact all-reduce of its gradients from XLA. This entry point replaces
``jax.value_and_grad``/``nnx.value_and_grad`` in such a step and makes that all-reduce
cgx's, in two ``shard_map`` stages:

1. The loss and each participant's *local* gradient, in a ``shard_map`` manual over the data
   axis only: batch arguments are split over it, parameters are replicated over it, and every
   other mesh axis stays automatic, so the model runs as it does under GSPMD (its weights
   sharded over ``'model'`` as they are). The local gradients leave stacked, one row per
   participant (``P(axis_name)``), with no reduction.
2. The compressed mean over the data axis, in a ``shard_map`` manual over every mesh axis:
   each device encodes only its own shard of a ``'model'``-sharded gradient (its layout read
   from the parameters' sharding annotations), so nothing is gathered for cgx's sake.

The gradients come back replicated over the data axis and sharded like their parameters,
as ``jax.value_and_grad``'s would, so ``optimizer.update`` and Optax apply unchanged.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from cgx_jax._src import flax_compat, fsdp
from cgx_jax._src.api import reduce_leaves, warn_nothing_compressed
from cgx_jax._src.collectives.jax_compat import ambient_mesh, reshard, untyped_collectives
from cgx_jax._src.layouts import axis_type, entry_axes, lay_out, spec_axes
from cgx_jax._src.policy import (
    LayerPolicy,
    add_residual,
    check_policy,
    leaf_paths,
    policy_of,
    residual_shape,
)
from cgx_jax._src.seeds import key_or_deprecated_seed, need_key, raw_key, shard_group_key, step_key
from cgx_jax._src.sharded import WEIGHT_CODEC
from cgx_jax._src.trees import combine, is_array, is_differentiable, partition
from cgx_jax._src.validation import check_choice
from cgx_jax._src.vma import local_value_and_grad


def _param_specs(grads, param_specs):
    """A tree of ``PartitionSpec``s for ``grads``: ``param_specs`` (a tree prefix) when given,
    else the sharding annotations of NNX states in it (``nnx.with_partitioning``,
    ``sharding=``), else replicated."""
    if param_specs is not None:
        return _broadcast_prefix(param_specs, grads)

    def annotated(node):
        if flax_compat.is_state(node):
            return flax_compat.nnx().get_partition_spec(node)
        return jax.tree.map(lambda _: P(), node)

    return jax.tree.map(annotated, grads, is_leaf=flax_compat.is_state)


def _data_dim(spec, axis_name, path) -> int | None:
    """The dimension that ``spec`` shards over the data axis (an FSDP parameter), or None
    (replicated over it). One dimension sharded over the data axis and another axis together
    is refused: each device would hold a shard of a shard."""
    for dim, entry in enumerate(spec or ()):  # None: a layout decided after tracing
        names = entry_axes(entry)
        if axis_name in names:
            if len(names) > 1:
                raise ValueError(
                    f"cgx.value_and_grad: parameter {path!r} has dimension {dim} sharded over "
                    f"{entry} together (spec {spec}); shard it over the data axis "
                    f"{axis_name!r} in a dimension of its own (for example P({axis_name!r}, "
                    f"'model')), or not at all")
            return dim
    return None


def value_and_grad(fun: Callable, *, mesh: Mesh | None = None, axis_name: str, argnums=0,
                   has_aux: bool = False, policy: LayerPolicy | None = None, key=None,
                   algorithm: str = "auto", backend: str = "ffi", param_specs=None,
                   error_feedback: bool = False, weight_policy: LayerPolicy | None = None,
                   keep_for_backward: str = "weights", seed: int | None = None):
    """``jax.value_and_grad(fun, argnums, has_aux)`` (``nnx.value_and_grad`` for an NNX module)
    whose gradients are averaged over ``axis_name`` with cgx's compressed all-reduce; call it
    inside ``jax.jit``/``nnx.jit`` (or eagerly) as ``grad_fn(*args, step=step)``.

    Args:
      fun: the loss, ``fun(*args) -> scalar`` (``(scalar, aux)`` with ``has_aux``), written
        as under GSPMD, but run once per data-parallel participant on that participant's
        rows: sizes taken from the arrays (``x.shape[0]``), not from the global batch.
      mesh: the mesh the step runs on; default: the one ``jax.sharding.set_mesh`` made
        current where ``grad_fn`` is called (inside ``jax.jit`` too).
      axis_name: its data-parallel axis. Every argument not in ``argnums`` is a batch, split
        over ``axis_name`` along its first dimension; arguments in ``argnums`` (parameters,
        or an NNX module) may be sharded over the other mesh axes, and replicated over
        ``axis_name`` or sharded over it (FSDP, below).
      argnums, has_aux: as for ``jax.value_and_grad``.
      policy: the gradients' per-leaf codecs (default ``LayerPolicy()``).
      key: the noise's PRNG key, folded with ``step`` (default ``jax.random.key(0)``).
      seed: deprecated (warns): ``key=jax.random.key(seed)`` gives the same noise.
      algorithm, backend: as for ``compressed_allreduce``.
      weight_policy: the codecs of FSDP parameters' weights as they are gathered (default
        ``LayerPolicy(default=Codec(bits=8, rounding="nearest"))``).
      param_specs: the parameters' ``PartitionSpec``s over the other mesh axes (a tree
        prefix of the gradients); default: an NNX module's sharding annotations
        (``nnx.with_partitioning``, ``sharding=``), else what JAX tells of each array (its
        type over explicit mesh axes; a placed array's sharding when called outside
        ``jit``). Over automatic axes inside ``jit``, where a layout is decided after
        tracing, XLA's partitioner tells it when it compiles the step (with error feedback,
        whose residual is placed before, they are taken as replicated, with a warning that
        says how to pass ``param_specs``); a parameter placed sharded over an automatic
        ``axis_name`` there is refused when the step compiles (FSDP needs the spec before
        tracing). A gradient is compressed per shard, so each device encodes only what it
        holds. A ``param_specs`` that calls replicated a parameter whose annotation or
        placement shards it over ``axis_name`` is a ``ValueError``.

      error_feedback: add what each participant's compression lost to its next gradient
        (EF-SGD): ``grad_fn(*args, step=step, residual=residual)`` then returns
        ``(value, grads, residual)``; start from ``cgx.init_residual(params, mesh=mesh,
        axis_name=axis_name)`` and carry the returned residual to the next step. Not for
        FSDP parameters (a ``ValueError``).
      keep_for_backward: what an NNX module's FSDP weights leave for the backward pass.
        ``"weights"`` (default): each is gathered and decoded at the start of the loss, and
        the layers keep the decoded weights they use, as GSPMD's FSDP keeps its gathered
        ones. ``"packets"``: each is gathered at the start as 8-bit packets (a quarter of
        its f32 bytes) and decoded where the model reads it; in layers the model wraps in
        ``nnx.remat`` the backward pass decodes it again from the packets instead of
        keeping it (the bytes on the wire are the same). For accelerators: XLA:CPU drops
        ``jax.checkpoint``'s barriers, so there it keeps the same memory
        (docs/performance.md). Leaves also sharded over another mesh axis, and parameters
        not in an NNX module, are decoded at the start. A weight the model reads twice
        (tied weights) is a ``ValueError``: read it once, or keep ``"weights"``.

    FSDP: a parameter whose spec shards one dimension over ``axis_name`` (GSPMD FSDP, as
    ``nnx.with_partitioning(init, (axis_name, None))`` or ``P(axis_name, None)`` writes it)
    stays sharded. Inside the differentiated loss each participant gathers it whole with
    the compressed all-gather (``weight_policy``), one gather per parameter, and the
    backward pass reduce-scatters its gradient with the compressed reduce-scatter
    (``policy``) as soon as it has it: averaged and sharded like the parameter, so
    ``nnx.Optimizer``/Optax update shards. Its other dimensions may be sharded over other
    mesh axes (each device then gathers and reduce-scatters only its block).

    ``step``: an integer array that differs every step (``optimizer.step[...]`` of an
    ``nnx.Optimizer``, or a counter in the train state); the stochastic rounding noise is
    folded from it. A Python int is refused: inside ``jax.jit`` it would be a constant and
    the noise would repeat every call. Only a policy that rounds nothing stochastically runs
    without it.

    Leaves that are not arrays (an Equinox module's activation functions, a dataclass's ints)
    are passed to ``fun`` as they are; in ``argnums``, only floating arrays are
    differentiated, and the gradients hold ``None`` for the other leaves, as
    ``equinox.filter_value_and_grad`` gives.

    An NNX module's other state is updated as ``cgx.local_value_and_grad`` says (RNG counts
    advanced, each participant its own dropout masks, BatchNorm statistics averaged).

    Returns:
      ``grad_fn``, which returns ``(value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``; with ``error_feedback``, the new residual as a third value): the loss
      averaged over participants (aux leaves too, which must be floating arrays), and the
      averaged gradients, of the arguments' types and structure, sharded like the
      parameters (so replicated over ``axis_name`` but for FSDP parameters).

    Raises:
      ValueError: an ``axis_name`` not in ``mesh``; a bad ``keep_for_backward``; and, when
        ``grad_fn`` is called, FSDP parameters with ``error_feedback``, a missing or
        mismatched ``residual``, or ``param_specs`` that contradict the parameters.
      TypeError: a Python int or non-integer ``step``; a ``policy`` or ``key`` of the
        wrong type.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, cgx_jax as cgx
        >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))  # explicit or auto axes
        >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
        >>> grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="data")
        >>> w, x = jnp.ones((256, 128)), jnp.ones((8 * len(jax.devices()), 256))
        >>> value, g = jax.jit(grad_fn)(w, x, step=jnp.int32(0))
        >>> g.shape, float(value)
        ((256, 128), 65536.0)
    """
    policy = check_policy(policy)
    base_key = raw_key(key_or_deprecated_seed(key, seed, "cgx.value_and_grad"))
    check_choice("keep_for_backward", keep_for_backward, ("weights", "packets"))
    if mesh is not None:
        _check_mesh(mesh, axis_name)
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    single = isinstance(argnums, int)
    # param_specs describes the gradients as returned: one tree, or one per argnum.
    specs = (param_specs,) if single and param_specs is not None else param_specs
    settings = dict(fun=fun, mesh=mesh, axis_name=axis_name, positions=positions,
                    has_aux=has_aux, policy=policy, algorithm=algorithm, backend=backend,
                    keep_for_backward=keep_for_backward,
                    weight_policy=(LayerPolicy(default=WEIGHT_CODEC) if weight_policy is None
                                   else check_policy(weight_policy, "weight_policy")))

    def grad_fn(*args, step=None, residual=None):
        _check_call(args, argnums, positions, axis_name, error_feedback, residual)
        call, flat_args = _Call.of(args, specs, _step_key(step, base_key),
                                   **dict(settings, mesh=_mesh_here(mesh, axis_name)))
        flat_args = _placements_checked(call, flat_args, given=specs is not None)
        if error_feedback and call.fsdp:
            raise ValueError(
                f"cgx.value_and_grad(..., error_feedback=True): parameters "
                f"{[call.paths[i] for i in call.fsdp][:4]} are sharded over {axis_name!r} "
                f"(FSDP), whose compressed reduce-scatter has no error feedback (its residual "
                f"would be the whole unsharded gradient on every device); drop "
                f"error_feedback, or replicate them over {axis_name!r}")
        plain = [i for i, by_path in call.fsdp_paths.items() if by_path and i not in call.graphs]
        if keep_for_backward == "packets" and plain:
            raise ValueError(
                f"cgx.value_and_grad(..., keep_for_backward='packets') decodes FSDP weights "
                f"where an NNX module reads them, but argument {plain[0]} is not an NNX module "
                f"(its parameters {[call.paths[j] for j in call.fsdp_paths[plain[0]].values()]} "
                f"are sharded over {axis_name!r}): pass the nnx.Module, or "
                f"keep_for_backward='weights'")
        value, grads, states = _local_gradients(call, flat_args)
        for i, state in states.items():  # state a step changed (RNG counts, statistics)
            flax_compat.nnx().update(args[i], state)
        if residual is not None:
            residual = (residual,) if single else tuple(residual)
        grads, residual = _compressed_mean(call, grads, residual)
        if single:
            grads = grads[0]
            residual = None if residual is None else residual[0]
        if error_feedback:
            return value, grads, residual
        return value, grads

    grad_fn.policy = policy  # for cgx.summary(grad_fn, params)
    return grad_fn


def _check_mesh(mesh, axis_name) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (or None: the mesh "
                        f"jax.sharding.set_mesh made current), got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh, whose axes "
                         f"are {mesh.axis_names}")


def _mesh_here(mesh, axis_name):
    """``mesh``, or where it is None the mesh ``jax.sharding.set_mesh`` made current;
    checked to have ``axis_name``."""
    if mesh is None:
        mesh = ambient_mesh()
        if mesh is None:
            raise ValueError(
                f"cgx: no mesh: pass mesh=, or call inside jax.sharding.set_mesh(mesh) (as "
                f"`with jax.sharding.set_mesh(mesh):`, or jax.sharding.set_mesh(mesh) once) "
                f"with a mesh that has the axis {axis_name!r}")
    _check_mesh(mesh, axis_name)
    return mesh


def _check_call(args, argnums, positions, axis_name, error_feedback, residual) -> None:
    """The errors a call can have before anything is traced."""
    if error_feedback and residual is None:
        raise ValueError("cgx.value_and_grad(..., error_feedback=True): pass residual= "
                         "(cgx.init_residual(params, mesh=..., axis_name=...) at the "
                         "start, then the residual the last call returned)")
    if not error_feedback and residual is not None:
        raise ValueError("residual= is only taken with error_feedback=True")
    for i in positions:
        if not 0 <= i < len(args):
            raise ValueError(f"argnums {argnums} names argument {i}, but grad_fn got "
                             f"{len(args)} positional arguments")
    if len(positions) == len(args):
        raise ValueError(
            f"cgx.value_and_grad: every argument is differentiated (argnums {argnums}), so "
            f"none is a batch to split over {axis_name!r}: pass the batch as arguments, "
            f"fun(model, x, y), not through a closure; a closed-over batch would be "
            f"computed whole by every participant")


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """One call of a ``value_and_grad`` function, normalized once; both stages read it.

    ``positions``: the differentiated arguments. ``graphs``: the NNX module passed at a
    position, as its graph (its state travels in the arguments and is merged back inside
    the shard_map). ``static``: per argument, its leaves that do not travel (not arrays, or
    not floating arrays of a parameter), put back before ``fun`` runs. ``key``: this step's
    noise key (``None`` without a step). Per gradient leaf (``tree_leaves`` order of the
    gradients of all positions): ``paths`` (its name in errors), ``specs`` (its
    ``PartitionSpec``), ``codecs`` (``policy``'s) and ``weight_codecs`` (``weight_policy``'s).
    ``param_paths``: position -> {``keystr`` of the leaf's path in the travelling argument:
    leaf}; ``fsdp``: leaf -> the dimension sharded over ``axis_name``."""
    fun: Callable
    mesh: Mesh
    axis_name: str
    positions: tuple
    has_aux: bool
    policy: LayerPolicy
    weight_policy: LayerPolicy
    algorithm: str
    backend: str
    graphs: dict
    static: dict
    key: Any
    paths: list
    specs: list
    codecs: list
    weight_codecs: list
    param_paths: dict
    fsdp: dict
    keep_for_backward: str

    @classmethod
    def of(cls, args, specs, key, **settings):
        """The call of ``args`` and the arguments that travel into the shard_maps: an NNX
        module's state, of other arguments only their arrays (floating ones, of the
        parameters); the rest is closed over. ``specs``: ``param_specs``, one tree per
        position, or None."""
        positions, axis_name = settings["positions"], settings["axis_name"]
        nnx = flax_compat.nnx
        graphs, static, flat_args, params = {}, {}, list(args), []
        for i, arg in enumerate(args):
            if i in positions and flax_compat.is_module(arg):
                graphs[i], flat_args[i] = nnx().split(arg)
                params.append(nnx().state(arg, nnx().Param))  # what nnx.grad differentiates
            else:
                keep = is_differentiable if i in positions else is_array
                flat_args[i], static[i] = partition(arg, keep)
                if i in positions:
                    params.append(flat_args[i])
        params = tuple(params)
        # The paths a policy's patterns see: those of the gradients as returned (one
        # argnum: its tree, as fit_policy and summary see it; several: the tuple's).
        returned = params[0] if len(params) == 1 else params
        paths = leaf_paths(returned)
        visible = _visible_specs(params)
        if specs is not None:
            leaf_specs = _leaf_specs(params, specs)
            _check_given_specs(leaf_specs, visible, paths, axis_name)
        elif graphs:
            leaf_specs = _leaf_specs(params, None)  # the NNX annotations
        else:
            leaf_specs = _specs_jax_knows(visible, settings["mesh"], axis_name)
        fsdp = {j: d for j, (spec, path) in enumerate(zip(leaf_specs, paths))
                if (d := _data_dim(spec, axis_name, path)) is not None}
        param_paths, first = {}, 0
        for i, tree in zip(positions, params):
            flat = jax.tree_util.tree_flatten_with_path(tree)[0]
            param_paths[i] = {jax.tree_util.keystr(path): first + j
                              for j, (path, _) in enumerate(flat)}
            first += len(flat)
        return cls(graphs=graphs, static=static, key=key, paths=paths, specs=leaf_specs,
                   codecs=settings["policy"].resolve_leaves(returned),
                   weight_codecs=settings["weight_policy"].resolve_leaves(returned),
                   param_paths=param_paths, fsdp=fsdp, **settings), flat_args

    @property
    def fsdp_paths(self) -> dict:
        """The part of ``param_paths`` of the FSDP leaves."""
        return {i: {path: j for path, j in by_path.items() if j in self.fsdp}
                for i, by_path in self.param_paths.items()}

    def loss(self, *array_args):
        """``fun`` of the arguments as they travelled, their other leaves put back."""
        return self.fun(*(combine(a, self.static[i]) if i in self.static else a
                          for i, a in enumerate(array_args)))


def _placements_checked(call: _Call, flat_args, given: bool) -> list:
    """``flat_args`` with each traced parameter that cgx takes as replicated over an automatic
    data axis passed through ``fsdp.refuse_unseen_sharding``: placed sharded over that axis,
    it is refused when XLA compiles the step, not trained data-parallel in silence."""
    if axis_type(call.mesh, call.axis_name) != AxisType.Auto:
        return flat_args  # an explicit axis shows in the traced type; a manual one is inside
    keystr = jax.tree_util.keystr
    chosen = {}  # (position, path in the argument) -> (leaf, leaf index)
    for i, by_path in call.param_paths.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(flat_args[i])[0]:
            j = by_path.get(keystr(path))
            if (j is not None and j not in call.fsdp and isinstance(leaf, jax.core.Tracer)
                    and leaf.ndim):
                chosen[i, keystr(path)] = leaf, j
    checked = dict(zip(chosen, fsdp.refuse_unseen_sharding(
        [leaf for leaf, _ in chosen.values()], [call.paths[j] for _, j in chosen.values()],
        call.axis_name, given)))
    out = list(flat_args)
    for i in call.param_paths:
        out[i] = jax.tree_util.tree_map_with_path(
            lambda path, x, i=i: checked.get((i, keystr(path)), x), flat_args[i])
    return out


def _check_given_specs(given, visible, paths, axis_name) -> None:
    """``param_specs`` must not call replicated over the data axis a parameter that its
    annotation or placement shards over it: its weights would be gathered exactly, in f32,
    by XLA, and only its gradient compressed."""
    for spec, seen, path in zip(given, visible, paths):
        if (seen is not None and _data_dim(seen, axis_name, path) is not None
                and _data_dim(spec, axis_name, path) is None):
            raise ValueError(
                f"cgx.value_and_grad: param_specs gives parameter {path!r} the spec {spec}, "
                f"but it is sharded over the data axis {axis_name!r} ({seen}). "
                f"cgx.value_and_grad trains such a parameter FSDP-style (compressed gathers "
                f"and reduce-scatters) when its spec says so: give it its spec {seen} "
                f"(or leave it out of param_specs)")


def _visible_specs(params) -> list:
    """Per parameter leaf, the ``PartitionSpec`` that the parameter itself shows at trace
    time: its NNX annotation, else a placed array's sharding (outside ``jit``), else its type
    (which names explicit axes only); None for a traced array without either (its layout over
    automatic axes is decided after tracing)."""
    annotated = _leaf_specs(params, None)
    out = []
    for x, spec in zip(jax.tree_util.tree_leaves(params), annotated):
        if spec != P():
            out.append(spec)
        elif not isinstance(x, jax.core.Tracer) and isinstance(
                getattr(x, "sharding", None), jax.sharding.NamedSharding):
            out.append(x.sharding.spec)
        elif isinstance(x, jax.core.Tracer) and not spec_axes(jax.typeof(x).sharding.spec):
            out.append(None)
        else:
            out.append(jax.typeof(x).sharding.spec)
    return out


def _specs_jax_knows(visible, mesh, axis_name) -> list:
    """The ``PartitionSpec`` of every parameter array as JAX tells it at trace time
    (``_visible_specs``); None for a traced parameter whose layout over the mesh's automatic
    axes (besides ``axis_name``) is decided after tracing: its gradient is reduced where
    XLA's partitioner knows it (``_mean_when_partitioned``)."""
    auto = _automatic_axes(mesh, axis_name)
    return [P() if spec is None and not auto else spec for spec in visible]


def _automatic_axes(mesh, axis_name) -> list:
    """The mesh's automatic axes of size > 1 besides ``axis_name``: where a traced array's
    layout is decided after tracing."""
    return [a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1
            and axis_type(mesh, a) == AxisType.Auto]


def _specs_for_residual(call: _Call) -> list:
    """``call.specs`` for a step with an error-feedback residual, which ``init_residual``
    placed by the specs known before tracing: a leaf whose layout over automatic axes is
    decided after tracing is taken as replicated over them, with a warning."""
    unknown = [path for path, spec in zip(call.paths, call.specs) if spec is None]
    if unknown:
        auto = _automatic_axes(call.mesh, call.axis_name)
        warnings.warn(
            f"cgx.value_and_grad with error feedback cannot see how parameters "
            f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''} are sharded over the "
            f"automatic mesh axes {tuple(auto)} (inside jax.jit an array's layout over "
            f"automatic axes is decided after tracing), so their gradients and residuals are "
            f"laid out replicated over them: each device then encodes the whole gradient. "
            f"Pass param_specs=jax.tree.map(lambda a: a.sharding.spec, params), built outside "
            f"jit from the placed parameters (to init_residual too), or param_specs=P() if "
            f"they are replicated; explicit mesh axes need neither.", stacklevel=4)
    return [P() if spec is None else spec for spec in call.specs]


def _step_key(step, base_key):
    """The noise key of this step: ``base_key`` folded with ``step`` (``None`` without a
    step)."""
    if step is None:
        return None
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        raise TypeError(
            f"cgx.value_and_grad: step must be an integer array (jnp.asarray(step), or "
            f"optimizer.step[...]), got the Python int {step}: inside jax.jit it would be "
            f"compiled in as a constant and the rounding noise would repeat every call")
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"cgx.value_and_grad: step must be an integer scalar, got "
                        f"{step.dtype}{list(step.shape)}")
    return step_key(base_key, step)


def _local_gradients(call: _Call, flat_args):
    """Stage 1: each participant's loss and gradient, manual over the data axis only. FSDP
    parameters arrive as this participant's shard and are gathered whole (compressed) inside
    the differentiated loss (``fsdp.gathering_loss``); their gradients leave reduce-scattered
    (compressed) and averaged, the data dimension moved first. Returns the loss (averaged),
    the gradients stacked one row per participant (an FSDP leaf: its shards, as rows), and
    the NNX modules' other state."""
    mesh, axis_name, positions = call.mesh, call.axis_name, call.positions
    in_specs = tuple(fsdp.input_specs(call, i, arg) if i in positions else P(axis_name)
                     for i, arg in enumerate(flat_args))

    def local(key, *local_args):
        # The key travels as an argument: closed over, a key typed over explicit mesh axes
        # (an NNX optimizer's step under jax.make_mesh's default axes) is refused.
        call_here = dataclasses.replace(call, key=key)
        local_args = list(local_args)
        modules = {}
        for i, graph in call.graphs.items():
            local_args[i] = modules[i] = flax_compat.nnx().merge(graph, local_args[i])
        _need_step(call, call.fsdp, key)
        out, grads = _with_clear_constraint_errors(
            lambda: local_value_and_grad(fsdp.gathering_loss(call_here), axis_name,
                                         argnums=positions, has_aux=call.has_aux)(*local_args),
            axis_name)
        out = jax.tree.map(lambda v: lax.pmean(v, axis_name), out)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        # An FSDP leaf's gradient is this participant's shard of the sum: averaged, its data
        # dimension first. The others laid out like their parameters over the automatic
        # axes, so they leave this stage as stage 2 reads them (left to XLA, they were
        # gathered whole over 'model').
        num = mesh.shape[axis_name]
        stacked = [jnp.moveaxis((g.astype(jnp.float32) / num).astype(g.dtype), call.fsdp[j], 0)
                   if j in call.fsdp else lay_out(g, spec, mesh)[None]
                   for j, (g, spec) in enumerate(zip(leaves, call.specs))]
        # The modules' other state, agreed over the data axis by local_value_and_grad.
        states = {}
        for i, module in modules.items():
            nnx = flax_compat.nnx()
            states[i] = nnx.state(module, nnx.Not(nnx.Param))
        return out, jax.tree_util.tree_unflatten(treedef, stacked), states

    out_specs = (P(), P(axis_name), P())
    if axis_type(mesh, axis_name) == AxisType.Explicit:  # shard_map wants them split
        flat_args = [arg if i in positions else jax.tree.map(
            lambda x: _split_rows(x, mesh, axis_name), arg) for i, arg in enumerate(flat_args)]
    stage = jax.shard_map(local, mesh=mesh, in_specs=(None if call.key is None else P(), *in_specs),
                          out_specs=out_specs, axis_names={axis_name})
    return _compiled_when_eager(stage, call.key, *flat_args)


def _compiled_when_eager(stage, *args):
    """``stage(*args)``, compiled as one program when called outside a trace: eagerly, a
    ``shard_map`` runs primitive by primitive, each compiled on its own (inside ``jit`` it is
    part of the caller's program already)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
        return stage(*args)
    return jax.jit(stage)(*args)


def _need_step(call: _Call, leaves, key) -> None:
    need_key([call.codecs[j] for j in leaves], key, [call.paths[j] for j in leaves],
             "cgx.value_and_grad's policy",
             "pass step= (an integer array that changes every step, e.g. optimizer.step[...] "
             "of an nnx.Optimizer, or a counter in your train state): the noise is folded "
             "from the step, so it must not repeat")


def _split_rows(x, mesh, axis_name):
    """A batch array of an explicit mesh resharded to rows split over ``axis_name``, its other
    dimensions as they were."""
    spec = tuple(jax.typeof(x).sharding.spec)
    if spec[:1] == (axis_name,):
        return x
    return reshard(x, jax.sharding.NamedSharding(mesh, P(axis_name, *spec[1:])))


# The annotation a JAX error about a spec in the loss comes from, by the operation it names.
_ANNOTATIONS = {"einsum": "an out_sharding= of jnp.einsum",
                "dot_general": "an out_sharding= of a matmul (jnp.dot, jnp.matmul, @)",
                "reshard": "a jax.sharding.reshard"}


def _data_axis_annotation_error(message: str, axis_name) -> str | None:
    """cgx's words for JAX's error about a sharding annotation in the loss that names the
    data axis, which is manual inside the per-participant loss; None for other errors."""
    fix = (f"Drop {axis_name!r} from that spec (P({axis_name!r}, None) becomes P(None, None), "
           f"P({axis_name!r}, 'model') becomes P(None, 'model')): each participant already "
           f"holds only its rows.")
    spec = message.partition("Got spec=")[2].partition(" and mesh=")[0]
    if "can only refer to Auto axes" in message and repr(axis_name) in spec:
        return (f"a jax.lax.with_sharding_constraint (or nnx sharding constraint) in the loss "
                f"names {axis_name!r}. {fix} Do not turn off check_vma instead: the gradients "
                f"would then be reduced by JAX and again by cgx.")
    manual = re.search(r"PartitionSpec passed to (\w+) cannot contain axis names .*Got "
                       r"PartitionSpec: (P\(.*?\)) with axis name: (\w+) of type: "
                       r"AxisType.Manual", message)
    if manual and manual.group(3) == axis_name:
        kind = _ANNOTATIONS.get(manual.group(1), f"a spec passed to {manual.group(1)}")
        return f"{kind} in the loss names {axis_name!r} ({manual.group(2)}). {fix}"
    if ("Axes mentioned in `manual_axis_type`" in message
            and f"axis: {axis_name} of type AxisType.Auto" in message):
        return (f"a NamedSharding built on the mesh, where {axis_name!r} is automatic, "
                f"constrains a value in the loss. Write the constraint's spec alone "
                f"(jax.lax.with_sharding_constraint(x, P(None, 'model')) under "
                f"jax.sharding.set_mesh(mesh)), or its NamedSharding on "
                f"jax.sharding.get_abstract_mesh(), without {axis_name!r}.")
    return None


def _with_clear_constraint_errors(call, axis_name):
    try:
        return call()
    except (TypeError, ValueError) as error:
        message = str(error)
        problem = _data_axis_annotation_error(message, axis_name)
        if problem:
            raise ValueError(f"cgx.value_and_grad runs the loss once per data-parallel "
                             f"participant, manual over {axis_name!r}: {problem}") from error
        if "shape" in message:  # perhaps shapes written for the global batch
            error.add_note(
                f"cgx.value_and_grad runs the loss once per participant of {axis_name!r}, on "
                f"that participant's rows of every batch argument: if the loss computes a "
                f"shape from the global batch size (x.reshape(B * S, -1) with B the global "
                f"batch), it does not fit them. Take sizes from the arrays themselves "
                f"(x.reshape(-1, x.shape[-1]), x.shape[0]).")
        raise


def _leaf_specs(grads, param_specs) -> list:
    """The ``PartitionSpec`` of every gradient leaf (``tree_leaves`` order)."""
    specs = _param_specs(grads, param_specs)
    treedef = jax.tree_util.tree_structure(grads)
    return [P(*spec) for spec in treedef.flatten_up_to(specs)]


def _compressed_mean(call: _Call, grads, residual):
    """Stage 2: the compressed mean of the stacked local gradients (plus each participant's
    error-feedback residual, when there is one), manual over every mesh axis, so each device
    encodes its own shard. FSDP leaves, reduced in stage 1, only get their data dimension
    back in place; leaves whose layout over automatic axes JAX decides after tracing are
    reduced where XLA's partitioner knows it (``_mean_when_partitioned``). Returns the mean
    and the new residual (``None`` without one)."""
    mesh, axis_name, key, codecs = call.mesh, call.axis_name, call.key, call.codecs
    treedef = jax.tree_util.tree_structure(grads)
    leaves = jax.tree_util.tree_leaves(grads)
    out = [_unstack_shard(leaves[j], call.fsdp[j], call.specs[j], mesh) if j in call.fsdp
           else None for j in range(len(leaves))]
    residual_leaves = _checked_residual(call, treedef, leaves, residual)
    specs = _specs_for_residual(call) if residual_leaves else call.specs
    todo = [j for j in range(len(leaves)) if j not in call.fsdp and specs[j] is not None]
    late = [j for j in range(len(leaves)) if j not in call.fsdp and specs[j] is None]
    if all(codec is None for codec in codecs) and call.policy.default is not None:
        warn_nothing_compressed(call.policy, [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
                                              for leaf in leaves])
    if late:
        for j, value in zip(late, _mean_when_partitioned(call, late, leaves)):
            out[j] = value
    if todo:
        todo_specs = [specs[j] for j in todo]
        in_specs = [P(axis_name, *spec) for spec in todo_specs]
        residual_specs = tuple(spec if codecs[j] is not None else P(axis_name)  # a zero each
                               for spec, j in zip(in_specs, todo)) if residual_leaves else ()
        reduce = lambda key, *stacked: _reduce_rows(  # noqa: E731
            call, todo, todo_specs, key, stacked[:len(todo)], stacked[len(todo):])
        mean, new_residual = _compiled_when_eager(jax.shard_map(
            reduce, mesh=mesh, in_specs=(None if key is None else P(), *in_specs,
                                         *residual_specs),
            out_specs=(tuple(todo_specs), residual_specs)),
            key, *(leaves[j] for j in todo), *residual_leaves)
        for j, value in zip(todo, mean):
            out[j] = value
    out = jax.tree_util.tree_unflatten(treedef, out)
    return out, (jax.tree_util.tree_unflatten(treedef, list(new_residual)) if residual_leaves
                 else None)


def _reduce_rows(call: _Call, todo, specs, key, stacked, residual_in):
    """The compressed mean over the data axis of this device's row of each stacked gradient
    ``todo`` (leaf indices; ``specs``: their layouts over the mesh), in a context manual
    over every mesh axis; with ``residual_in`` (EF-SGD), added to what this participant's
    compression lost last step. Returns (means, new residual rows or ``()``)."""
    codecs = call.codecs
    local = [g[0] for g in stacked]
    if residual_in:
        local = [add_residual(g, r[0]) for g, r in zip(local, residual_in)]
    _need_step(call, todo, key)
    reduced, residual = [None] * len(todo), [None] * len(todo)
    for number, (shard_axes, members) in enumerate(_noise_groups(specs, call.mesh).items()):
        group_key = (shard_group_key(key, number, lax.axis_index(shard_axes)) if shard_axes
                     else key)
        means, residuals = reduce_leaves(
            [local[m] for m in members], [codecs[todo[m]] for m in members], call.axis_name,
            key=group_key, algorithm=call.algorithm, backend=call.backend, mean=True,
            with_residual=bool(residual_in), paths=[call.paths[todo[m]] for m in members])
        for k, m in enumerate(members):
            reduced[m] = means[k]
            if residual_in:  # an exact leaf keeps its zero
                residual[m] = (residuals[k][None] if codecs[todo[m]] is not None
                           else residual_in[m])
    return tuple(reduced), (tuple(residual) if residual_in else ())


def _mean_when_partitioned(call: _Call, late, leaves):
    """``_reduce_rows`` of the stacked gradients ``late`` (leaf indices) whose layout over
    the automatic mesh axes JAX decides after tracing, as a ``custom_partitioning`` op: XLA's
    partitioner, having propagated the parameters' layouts, calls ``partition`` with each
    gradient's sharding, and every device encodes its own shard there, as with known specs.
    The op's Shardy rule maps each gradient's dimensions to the mean's, its row dimension
    reduced."""
    mesh, axis_name, key = call.mesh, call.axis_name, call.key
    operands = [leaves[j] for j in late] + ([] if key is None else [key])

    def specs_of(arg_shapes):  # each gradient's layout after its row dimension
        specs = []
        for shape in arg_shapes[:len(late)]:
            entries = (tuple(shape.sharding.spec) + (None,) * shape.ndim)[1:shape.ndim]
            specs.append(P(*(None if entry == axis_name else entry for entry in entries)))
        return specs

    def infer(_, arg_shapes, result_shape):
        return tuple(jax.sharding.NamedSharding(mesh, spec) for spec in specs_of(arg_shapes))

    def partition(_, arg_shapes, result_shape):
        specs = specs_of(arg_shapes)

        def lower(*local):
            with untyped_collectives():  # traced outside shard_map: no varying types
                return _reduce_rows(call, late, specs, local[len(late)] if key is not None
                                    else None, local[:len(late)], ())[0]

        named = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
        return (mesh, lower, tuple(named(spec) for spec in specs),
                tuple(named(P(axis_name, *spec)) for spec in specs)
                + ((named(P()),) if key is not None else ()))

    @custom_partitioning
    def mean(*args):  # what the op means, for a partitioner that does not call partition
        return tuple(jnp.mean(g.astype(jnp.float32), 0).astype(g.dtype)
                     for g in args[:len(late)])

    dims = [tuple(f"d{i}_{k}" for k in range(leaves[j].ndim - 1)) for i, j in enumerate(late)]
    mean.def_partition(partition, infer_sharding_from_operands=infer,
                       sharding_rule=SdyShardingRule(
                           operand_mappings=tuple((f"n{i}", *d) for i, d in enumerate(dims))
                           + ((("key",),) if key is not None else ()),
                           result_mappings=tuple(dims),
                           reduction_factors=tuple(f"n{i}" for i in range(len(late)))))
    return mean(*operands)


def _unstack_shard(rows, dim: int, spec, mesh):
    """An FSDP gradient as stage 1 left it (its data dimension first, split over the data
    axis) back in its parameter's layout."""
    value = jnp.moveaxis(rows, 0, dim)
    if any(axis_type(mesh, n) == AxisType.Explicit for n in spec_axes(spec)):
        return reshard(value, jax.sharding.NamedSharding(mesh, spec))
    return lax.with_sharding_constraint(value, jax.sharding.NamedSharding(mesh, spec))


def _checked_residual(call: _Call, treedef, leaves, residual) -> list:
    """The residual's leaves (``[]`` without one), each checked against its gradient."""
    if residual is None:
        return []
    try:
        residual_leaves = treedef.flatten_up_to(residual)
    except (ValueError, TypeError) as error:
        raise ValueError(f"residual must have the gradients' structure (from "
                         f"cgx.init_residual): {error}") from None
    for path, grad, res, codec in zip(call.paths, leaves, residual_leaves, call.codecs):
        want = (grad.shape[0], *residual_shape(codec, grad.shape[1:]))  # a row each
        if res.shape != want:
            raise ValueError(
                f"residual leaf {path!r} has shape {res.shape}; its gradient "
                f"{grad.shape[1:]} is {'compressed' if codec else 'exact'} under the "
                f"policy, so its residual is {want} (one row per participant of "
                f"{call.axis_name!r}): make it with cgx.init_residual(params, mesh=..., "
                f"axis_name=..., policy=grad_fn), grad_fn the value_and_grad function")
    return residual_leaves


def _noise_groups(specs, mesh) -> dict:
    """The gradient leaves (indices) grouped by the mesh axes they are sharded over, in mesh
    order. A group's noise is folded from the device's index over exactly those axes: every
    replica of a shard draws the same noise (a replicated leaf's copies stay identical) and
    every distinct shard its own."""
    groups = {}
    for i, spec in enumerate(specs):
        named = set(spec_axes(spec))
        groups.setdefault(tuple(a for a in mesh.axis_names if a in named), []).append(i)
    return groups


def init_residual(params, *, mesh: Mesh | None = None, axis_name: str, param_specs=None,
                  policy=None):
    """The zero error-feedback residual of ``cgx.value_and_grad(..., error_feedback=True)``
    for ``params`` (a pytree, an ``nnx.State``, or an NNX module, whose ``nnx.Param``s are
    taken): f32, one row per participant of ``axis_name`` for each leaf that ``policy``
    compresses (the ``value_and_grad`` function, or its ``LayerPolicy``; default
    ``LayerPolicy()``), and one zero per participant for each exact leaf, which loses
    nothing. Placed on ``mesh`` with the rows split over ``axis_name`` and the rest sharded
    like each parameter (``param_specs`` or the NNX sharding annotations), so no device holds
    another's residual or a full copy of a model-sharded one. Save it with the optimizer
    state: a restored run continues bit for bit.

    Args:
      params: the parameters (a pytree, an ``nnx.State`` or an NNX module).
      mesh: the mesh of the step (default: the one ``jax.sharding.set_mesh`` made current).
      axis_name: its data-parallel axis.
      param_specs: the parameters' ``PartitionSpec``s over the other axes (default: the
        NNX annotations, else replicated).
      policy: the ``value_and_grad`` function or its ``LayerPolicy``.

    Returns:
      A pytree of zero f32 arrays, one per leaf of ``params``, placed on ``mesh``.

    Raises:
      ValueError: parameters sharded over ``axis_name`` (FSDP has no error feedback).

    Example:
        >>> import jax, jax.numpy as jnp, cgx_jax as cgx
        >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
        >>> params = {"w": jnp.ones((128, 128)), "b": jnp.ones(128)}  # w compressed, b exact
        >>> r = cgx.init_residual(params, mesh=mesh, axis_name="data")
        >>> from jax.sharding import PartitionSpec as P
        >>> r["w"].shape == (len(jax.devices()), 128, 128), r["w"].sharding.spec == P("data")
        (True, True)
        >>> r["b"].shape == (len(jax.devices()), 1)  # an exact leaf loses nothing: one zero
        True
    """
    mesh = _mesh_here(mesh, axis_name)
    if flax_compat.is_module(params):
        nnx = flax_compat.nnx()
        params = nnx.state(params, nnx.Param)
    params = partition(params, is_differentiable)[0]  # no residual for a function or an int
    rows = mesh.shape[axis_name]
    specs = _leaf_specs(params, param_specs)
    sharded = [path for path, spec in zip(leaf_paths(params), specs)
               if _data_dim(spec, axis_name, path) is not None]
    if sharded:
        raise ValueError(
            f"cgx.init_residual: parameters {sharded[:4]} are sharded over {axis_name!r} "
            f"(FSDP), whose compressed reduce-scatter has no error feedback; error feedback "
            f"is for parameters replicated over {axis_name!r}")
    treedef = jax.tree_util.tree_structure(params)
    codecs = (LayerPolicy() if policy is None else policy_of(policy)).resolve_leaves(params)
    zeros = [jax.device_put(jnp.zeros((rows, *residual_shape(codec, jnp.shape(p))),
                                      jnp.float32),
                            jax.sharding.NamedSharding(mesh, P(axis_name, *spec)
                                                       if codec is not None else P(axis_name)))
             for p, spec, codec in zip(jax.tree_util.tree_leaves(params), specs, codecs)]
    return jax.tree_util.tree_unflatten(treedef, zeros)


def _broadcast_prefix(prefix, tree):
    return jax.tree.map(lambda spec, subtree: jax.tree.map(lambda _: spec, subtree), prefix,
                        tree, is_leaf=lambda x: isinstance(x, P))
