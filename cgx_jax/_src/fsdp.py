"""FSDP inside ``cgx.value_and_grad`` (docs/design.md section 10): the differentiated loss of
a call with parameters sharded over the data axis gathers each one whole with the compressed
all-gather (decoded at the start, or where an NNX module reads it), and the gather's VJP
reduce-scatters its gradient, compressed, as soon as the backward pass has it. ``call`` is
``data_parallel``'s normalized call."""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import PartitionSpec as P

from cgx_jax._src import flax_compat
from cgx_jax._src.layouts import lay_out, spec_axes
from cgx_jax._src.seeds import block_key, gather_key
from cgx_jax._src.sharded import finish_gather, gather_leaves, start_gather
from cgx_jax._src.vma import to_local


def input_specs(call, i: int, arg):
    """The stage-1 ``in_specs`` tree of the differentiated argument ``arg`` at position
    ``i``: ``P()`` (replicated over the data axis), an FSDP leaf split over it along its
    dimension."""
    def spec(path, _):
        leaf = call.fsdp_paths[i].get(jax.tree_util.keystr(path))
        if leaf is None:
            return P()
        return P(*([None] * call.fsdp[leaf]), call.axis_name)

    return jax.tree_util.tree_map_with_path(spec, arg)


def gathering_loss(call):
    """``call.loss`` that first gathers its FSDP parameters' shards whole, each with its own
    compressed all-gather, whose VJP reduce-scatters that parameter's gradient (compressed,
    summed over the data axis) as soon as the backward pass has produced it."""
    if not call.fsdp:
        return call.loss
    nnx = flax_compat.nnx

    def loss(*args):
        args, modules, decoded = list(args), {}, []
        for i, by_path in call.fsdp_paths.items():
            if not by_path:
                continue
            if i in call.graphs:
                graph, state = nnx().split(args[i])
                modules[i] = args[i]
                at_use = call.keep_for_backward == "packets"
                gathered = (_decoding_at_use(call, i, state) if at_use
                            else _gather_fsdp_leaves(call, i, state))
                decoded.append(gathered)
                args[i] = nnx().merge(graph, gathered)
            else:
                args[i] = _gather_fsdp_leaves(call, i, args[i])
        out = call.loss(*args)
        _check_decoded_once(decoded)
        for i, module in modules.items():  # its other state, as the loss left it
            nnx().update(module, nnx().state(args[i], nnx().Not(nnx().Param)))
        return out

    return loss


def _check_decoded_once(states) -> None:
    """A ``ValueError`` if the model read a weight decoded at use more than once: each read
    decodes it again, and the backward pass reduce-scatters each read's part of the gradient
    on its own (twice the bytes, the same noise twice) instead of the gradient once."""
    for state in states:
        flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=flax_compat.is_variable)[0]
        for path, variable in flat:
            count = flax_compat.decode_count(variable)
            if count is not None and count > 1:
                name = jax.tree_util.keystr(path)
                raise ValueError(
                    f"cgx.value_and_grad(..., keep_for_backward='packets'): the model reads "
                    f"the FSDP weight {name} {count} times (tied weights?); each read would "
                    f"decode it and reduce-scatter its own part of the gradient. Read it "
                    f"once (x = w[...], then use x), or pass keep_for_backward='weights'")


def _gather_fsdp_leaves(call, i: int, tree):
    """``tree`` (argument ``i`` as it travelled) with its FSDP shards gathered whole over the
    data axis (``weight_codecs``; their gradients reduce-scattered with ``codecs``), one
    gather each, so that the backward pass reduce-scatters each gradient as soon as it has
    it: one custom VJP for all would hold every full gradient until the last
    (docs/performance.md measures both)."""
    by_path = call.fsdp_paths[i]
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in flat]
    for n, (path, shard) in enumerate(flat):
        j = by_path.get(jax.tree_util.keystr(path))
        if j is not None:
            leaves[n] = _gather_fsdp_leaf(call, j, shard, gather_key(call.key, j))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _decoding_at_use(call, i: int, state):
    """``state`` (an NNX module's, as it travelled) whose FSDP parameters sharded over the
    data axis alone hold their shard and its gathered packets, and are decoded wherever the
    model reads them (``flax_compat.decoded_at_use``); the others gathered as
    ``_gather_fsdp_leaves`` gathers them."""
    by_path = call.fsdp_paths[i]
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    variables, treedef = jax.tree_util.tree_flatten(state, is_leaf=flax_compat.is_variable)
    for n, (path, shard) in enumerate(flat):
        j = by_path.get(jax.tree_util.keystr(path))
        if j is None:
            continue
        leaf_key = gather_key(call.key, j)
        if spec_axes(call.specs[j]) != [call.axis_name]:  # blocks: gathered at the start
            variables[n] = variables[n].copy(_gather_fsdp_leaf(call, j, shard, leaf_key))
            continue
        settings, packets = start_gather(
            [shard], [call.weight_codecs[j]], call.axis_name, key=leaf_key,
            grad_codecs=[call.codecs[j]], backend=call.backend, paths=[call.paths[j]])
        decode = functools.partial(_decode_one, settings, call.fsdp[j])
        variables[n] = flax_compat.decoded_at_use((shard, packets, leaf_key), decode)
    return jax.tree_util.tree_unflatten(treedef, variables)


def _decode_one(settings, dim: int, shard, packets, key):
    return finish_gather(settings, [shard], packets, key, axes=[dim], tiled=True)[0]


def _gather_fsdp_leaf(call, j: int, shard, key):
    """FSDP leaf ``j`` gathered whole over the data axis by ``sharded.gather_leaves``. A leaf
    also sharded over other mesh axes is gathered block by block, in a ``shard_map`` manual
    over those axes (else XLA would gather each block whole, in f32, to feed the kernels),
    each block drawing its own noise."""
    def gather(block, key):
        return gather_leaves([block], [call.weight_codecs[j]], call.axis_name,
                             axes=[call.fsdp[j]], tiled=True, key=key,
                             grad_codecs=[call.codecs[j]], backend=call.backend,
                             paths=[call.paths[j]])[0]

    other = P(*(None if d == call.fsdp[j] else entry for d, entry in enumerate(call.specs[j])))
    axes = tuple(a for a in call.mesh.axis_names if a in spec_axes(other))
    if not axes:
        return gather(shard, key)

    def on_block(block, key):
        return to_local(gather(block, block_key(key, lax.axis_index(axes))), axes)

    # The key goes in as an argument: shard_map cannot close over a value typed by an
    # explicit axis (a traced key is, on an explicit mesh).
    return jax.shard_map(on_block, in_specs=(other, P()), out_specs=other,
                         axis_names=set(axes))(lay_out(shard, other, call.mesh), key)


def refuse_unseen_sharding(leaves: list, paths: list, axis_name: str, given: bool) -> list:
    """``leaves`` unchanged, through a ``custom_partitioning`` op that reads their layout when
    XLA's partitioner knows it and refuses a leaf sharded over ``axis_name``.

    Inside ``jax.jit`` on a mesh whose data axis is automatic, a parameter's placement is
    decided after tracing, so cgx traces such a leaf as replicated over the data axis. One
    placed ``P(axis_name, ...)`` would then be trained data-parallel in silence (XLA gathers
    its weight in f32, its gradient comes back replicated): an FSDP user would not get FSDP.
    The traced program cannot change at compile time, so the partitioner's call raises cgx's
    error there, naming ``param_specs=``. After partitioning the op is the identity."""
    if not leaves:
        return leaves

    def check(arg_shapes):
        for shape, path in zip(arg_shapes, paths):
            spec = getattr(shape.sharding, "spec", None)
            if spec is not None and axis_name in spec_axes(spec):
                told = "param_specs gives it P() (replicated)" if given else (
                    "cgx traced it as replicated: inside jax.jit an array's layout over the "
                    "automatic mesh axes is decided after tracing")
                name = f"parameter {path!r}" if path else "the parameter"
                raise ValueError(
                    f"cgx.value_and_grad: {name} is placed sharded over the data "
                    f"axis {axis_name!r} ({spec}), but {told}; it would be trained "
                    f"data-parallel (its weight gathered whole in f32, its gradient "
                    f"replicated), not FSDP. Pass param_specs=jax.tree.map(lambda a: "
                    f"a.sharding.spec, params), built outside jit from the placed "
                    f"parameters, or make {axis_name!r} an explicit mesh axis "
                    f"(jax.make_mesh's default), or place the parameter replicated (P())")
        return tuple(shape.sharding for shape in arg_shapes)

    def partition(mesh, arg_shapes, result_shape):
        shardings = check(arg_shapes)
        return mesh, lambda *xs: xs, shardings, shardings

    @custom_partitioning
    def placed(*xs):
        return xs

    dims = tuple(tuple(f"d{i}_{k}" for k in range(x.ndim)) for i, x in enumerate(leaves))
    placed.def_partition(partition, infer_sharding_from_operands=lambda _, a, r: check(a),
                         sharding_rule=SdyShardingRule(operand_mappings=dims,
                                                       result_mappings=dims))
    return list(placed(*leaves))
