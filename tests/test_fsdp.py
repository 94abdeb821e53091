"""FSDP through cgx.value_and_grad (cgx_jax/_src/data_parallel.py, docs/design.md section 10): a
third-party-style GSPMD FSDP tutorial (tests/fsdp_scripts.py) ported by three lines, against
the nnx.value_and_grad step it replaces: losses, gradients (exact codecs, decoded weights,
the codec's bound), types, structure and shardings, what the compiled step moves, and the
errors of what is not supported."""

import re

import fsdp_scripts as fs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import load_script
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from test_sharded import roundtrip

import cgx_jax as cgx

EXACT = cgx.LayerPolicy(default=None)
W8 = cgx.Codec(bits=8, bucket_size=64, rounding="nearest")


def fsdp_mesh(shape=(8,), names=("fsdp",)):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def grad_step(mesh, use_cgx, **options):
    """The jitted ``(model, x, y, step) -> (loss, grads)``: nnx.value_and_grad under GSPMD,
    or the cgx port."""
    @nnx.jit
    def grad(model, x, y, i):
        def loss_fn(model, x, y):
            return jnp.mean((model(x) - y) ** 2)
        if use_cgx:
            return cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="fsdp", **options)(
                model, x, y, step=i)
        return nnx.value_and_grad(loss_fn)(model, x, y)
    return grad


def grads_of(mesh, model, use_cgx, step=0, **options):
    """(loss, grads) of the batch of ``step``."""
    with jax.set_mesh(mesh):
        x, y = fs.batch(mesh, step)
        return grad_step(mesh, use_cgx, **options)(model, x, y, jnp.int32(step))


def assert_like_nnx(got, want, model):
    """The same type, structure and dtypes as nnx.value_and_grad's gradients, sharded like
    the parameters (nnx's leave jit as XLA lays them out: replicated here)."""
    assert type(got) is type(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    for g, w, p in zip(jax.tree.leaves(got), jax.tree.leaves(want), params):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)


def relative_errors(got, want):
    return [float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w)))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]


@pytest.mark.parametrize("kernel_axes", [("fsdp", None), (None, "fsdp")])
def test_exact_codecs_give_nnx_value_and_grad(kernel_axes):
    """Kernels sharded by rows or by columns over 'fsdp'."""
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh, kernel_axes=kernel_axes)
    loss, grads = grads_of(mesh, model, True, policy=EXACT, weight_policy=EXACT)
    want_loss, want = grads_of(mesh, model, False)
    assert_like_nnx(grads, want, model)
    assert grads["linear1"]["kernel"].sharding.is_equivalent_to(
        NamedSharding(mesh, P(*kernel_axes)), 2)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_weights_are_used_as_every_participant_decodes_them():
    """8-bit weights, exact gradients: the loss and gradients are nnx.value_and_grad's at the
    weights decoded as the numpy model decodes each shard (the gather's wiring)."""
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh)
    loss, grads = grads_of(mesh, model, True, policy=EXACT,
                           weight_policy=cgx.LayerPolicy(default=W8))
    decoded, _ = fs.make_model(mesh)
    for layer in (decoded.linear1, decoded.linear2):
        kernel = np.asarray(layer.kernel[...])
        shards = np.split(kernel, 8, axis=0)
        layer.kernel[...] = jax.device_put(np.concatenate([roundtrip(s, W8) for s in shards]),
                                           layer.kernel[...].sharding)
    want_loss, want = grads_of(mesh, decoded, False)
    _, exact = grads_of(mesh, model, False)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    assert max(relative_errors(grads, exact)) > 1e-5  # the weights did travel at 8 bits


def local_gradients(model, mesh, num=8):
    """Each participant's exact gradient of its own rows' loss (plain jax, one device)."""
    x, y = (np.asarray(a) for a in fs.batch(mesh, 0))
    rows = len(x) // num
    loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    host = nnx.merge(nnx.graphdef(model), jax.device_get(nnx.state(model)))
    return [nnx.grad(loss)(host, x[k * rows:(k + 1) * rows], y[k * rows:(k + 1) * rows])
            for k in range(num)]


def test_compressed_gradients_are_within_the_codec_bound_and_unbiased():
    """Exact weights, the default 4-bit stochastic gradients: every value of a kernel's
    gradient within one quantization step of each participant's local gradient (its range /
    15, averaged over participants) of nnx's; the mean over 8 steps' noise much closer (no
    bias); the same step gives the same bits, biases (exact) nnx's."""
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh)
    _, want = grads_of(mesh, model, False)
    grad = grad_step(mesh, True, weight_policy=EXACT)  # compiled once: only the step varies
    with jax.set_mesh(mesh):
        x, y = fs.batch(mesh, 0)
        runs = [grad(model, x, y, jnp.int32(step))[1] for step in range(8)]
    assert_like_nnx(runs[0], want, model)
    local = local_gradients(model, mesh)
    for layer in ("linear1", "linear2"):
        exact = np.asarray(want[layer]["kernel"][...], np.float64)
        unit = np.mean([np.ptp(np.asarray(g[layer]["kernel"][...])) / 15 for g in local])
        errors = [np.asarray(r[layer]["kernel"][...], np.float64) - exact for r in runs]
        assert np.max(np.abs(errors)) <= unit * (1 + 1e-4), layer
        single, mean = np.mean(np.abs(errors[0])), np.mean(np.abs(np.mean(errors, axis=0)))
        assert 0 < mean < 0.5 * single, (layer, mean, single)  # 8 draws: about 1/sqrt(8)
        np.testing.assert_allclose(runs[0][layer]["bias"][...], want[layer]["bias"][...],
                                   rtol=1e-5, atol=1e-7)
    again = grads_of(mesh, model, True, weight_policy=EXACT)[1]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)  # the same step and key: the same bits


def collectives(hlo):
    """(op, [(dtype, dims) of each output]) of every collective of compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) (all-gather|all-to-all|reduce-scatter|all-reduce|"
                      r"collective-permute)(-start)?\(", line)
        if m:
            shapes = [(dtype, tuple(int(d) for d in dims.split(",") if d))
                      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))]
            found.append((m.group(2), shapes))
    return found


def weights_travel_as_packets(hlo, batch_rows):
    """Whether every collective of more than 2,048 floats (the biases) carries activations
    (a dimension of ``batch_rows``, the rows of one participant: model-parallel traffic, as
    in the original) rather than weights or their gradients; and something was gathered and
    exchanged as u8 packets."""
    found = collectives(hlo)
    large = [(op, dims) for op, shapes in found for dtype, dims in shapes
             if dtype != "u8" and np.prod(dims) > 2048]
    packets = {op for op, shapes in found for dtype, _ in shapes if dtype == "u8"}
    return all(batch_rows in dims for _, dims in large) and packets >= {"all-gather",
                                                                        "all-to-all"}


def compiled_step_hlo(mesh, use_cgx, kernel_axes=("fsdp", None), **options):
    model, momentum = fs.make_model(mesh, kernel_axes=kernel_axes)
    graph, state = nnx.split(model)
    step = fs.step_fn(mesh, use_cgx, **options)

    def pure(state, momentum, x, y, i):
        m = nnx.merge(graph, state)
        loss, momentum = step(m, momentum, x, y, i)
        return loss, momentum, nnx.state(m)

    with jax.set_mesh(mesh):
        x, y = fs.batch(mesh, 0)
        return jax.jit(pure).lower(state, momentum, x, y, jnp.int32(0)).compile().as_text()


def test_the_compiled_step_moves_only_packets_of_the_large_weights_and_gradients():
    mesh = fsdp_mesh()
    assert not weights_travel_as_packets(compiled_step_hlo(mesh, False), 24)  # f32 kernels
    assert weights_travel_as_packets(compiled_step_hlo(mesh, True), 24)


def test_the_tutorial_ported_in_three_lines_trains_as_the_original():
    """60 steps: the loss within 5% of the original's (here within 1%), parameters and
    momentum still sharded over 'fsdp' as the original keeps them."""
    mesh = fsdp_mesh()
    want, model_want, momentum_want = fs.train(mesh, False, 60)
    got, model_got, momentum_got = fs.train(mesh, True, 60)
    assert want[-1] < 0.3 * want[0]  # it learns
    assert abs(got[-1] - want[-1]) < 0.01 * want[-1], (got[-1], want[-1])
    for tree_got, tree_want in ((nnx.state(model_got, nnx.Param),
                                 nnx.state(model_want, nnx.Param)),
                                (momentum_got, momentum_want)):
        assert jax.tree.structure(tree_got) == jax.tree.structure(tree_want)
        for g, w in zip(jax.tree.leaves(tree_got), jax.tree.leaves(tree_want)):
            assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    assert momentum_got["linear2"]["kernel"].sharding.is_equivalent_to(
        NamedSharding(mesh, P("fsdp", None)), 2)


def test_what_is_not_supported_is_a_clear_error():
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh)
    with pytest.raises(ValueError, match=r"param_specs gives parameter 'linear1/kernel' the "
                                         r"spec P\(\), but it is sharded over the "
                                         r"data axis 'fsdp'"):
        grads_of(mesh, model, True, param_specs=P())
    with pytest.raises(ValueError, match=r"cgx.init_residual: parameters \['linear1/kernel', "
                                         r"'linear2/kernel'\] are sharded over 'fsdp'"):
        cgx.init_residual(model, mesh=mesh, axis_name="fsdp")
    with pytest.raises(ValueError, match="pass step="):
        with jax.set_mesh(mesh):
            x, y = fs.batch(mesh, 0)
            nnx.jit(lambda m, x, y: cgx.value_and_grad(
                lambda m, x, y: jnp.mean((m(x) - y) ** 2), mesh=mesh, axis_name="fsdp")(
                m, x, y))(model, x, y)


@pytest.mark.parametrize("kernel_axes", [("fsdp", None), ("fsdp", "model")])
def test_a_2d_mesh_with_weights_sharded_over_both_axes(kernel_axes):
    """('fsdp', 'model') mesh, kernels sharded over 'fsdp' only or over both: exact codecs
    give nnx's gradients, sharded like the parameters; the compiled step moves only packets of
    the kernels (no f32 gather of a shard over 'model')."""
    mesh = fsdp_mesh((4, 2), ("fsdp", "model"))
    model, _ = fs.make_model(mesh, kernel_axes=kernel_axes)
    loss, grads = grads_of(mesh, model, True, policy=EXACT, weight_policy=EXACT)
    want_loss, want = grads_of(mesh, model, False)
    assert_like_nnx(grads, want, model)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    assert weights_travel_as_packets(compiled_step_hlo(mesh, True, kernel_axes), 48)


def test_the_step_keeps_fsdp_memory():
    """tools/fsdp_memory.py (docs/performance.md) on 8 layers of 512x512: the cgx FSDP
    step's arguments are the original FSDP step's (the parameters' shards; the step counter
    aside), and its whole memory (arguments and temporaries) within 1.5x of the original
    FSDP step's and below 0.6x of the cgx data-parallel step's."""
    tool = load_script("tools/fsdp_memory.py", "fsdp_memory")
    mesh = fsdp_mesh()
    sizes = dict(width=512, depth=8, rows=64)
    fsdp = tool.step_memory(mesh, ("fsdp", None), False, **sizes)
    cgx_fsdp = tool.step_memory(mesh, ("fsdp", None), True, **sizes)
    cgx_dp = tool.step_memory(mesh, (None, None), True, **sizes)
    assert abs(cgx_fsdp[1] - fsdp[1]) < 1e-3 and cgx_fsdp[1] < 0.25 * cgx_dp[1]
    assert sum(cgx_fsdp) < 1.5 * sum(fsdp) and sum(cgx_fsdp) < 0.6 * sum(cgx_dp), (
        fsdp, cgx_fsdp, cgx_dp)


def test_the_shard_map_route_gathers_only_the_leaves_its_specs_shard():
    """compressed_all_gather(state, specs=nnx.get_partition_spec(state)) inside the
    shard_map that split the state: the kernels gathered whole, each shard as the numpy model
    decodes it at the default 8 bits; the replicated biases (and nothing else) as they were.
    axis=/tiled= beside specs=, or a spec that is not a PartitionSpec, are refused."""
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh)
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)

    def gather(**options):
        def body(state):
            full = cgx.compressed_all_gather(state, "fsdp", specs=specs, **options)
            return jax.tree.map(lambda v: v[None], full)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,),
                                     out_specs=P("fsdp")))(state)

    full = gather()
    weights = cgx.Codec(bits=8, bucket_size=1024, rounding="nearest")  # the weights' default
    for layer in ("linear1", "linear2"):
        kernel = np.asarray(state[layer]["kernel"][...])
        want = np.concatenate([roundtrip(s, weights) for s in np.split(kernel, 8)])
        got = np.asarray(full[layer]["kernel"][...])
        assert got.shape == (8,) + kernel.shape
        np.testing.assert_array_equal(got[3], want)
        np.testing.assert_array_equal(np.asarray(full[layer]["bias"][...])[5],
                                      np.asarray(state[layer]["bias"][...]))
    with pytest.raises(ValueError, match="pass specs= or axis=/tiled=, not both"):
        gather(tiled=True)
    with pytest.raises(ValueError, match="specs must be a tree prefix of x"):
        jax.jit(jax.shard_map(lambda st: cgx.compressed_all_gather(st, "fsdp", specs=[P()]),
                              mesh=mesh, in_specs=(specs,), out_specs=P()))(state)


def test_the_documented_nnx_step_runs_and_matches_nnx_on_explicit_axes():
    """docs/fsdp.md's NNX FSDP step, run as written (jax.make_mesh's default Explicit axes, an
    nnx.Optimizer whose step seeds the noise), against the same script with
    nnx.value_and_grad: the loss and the parameters' updates after 3 Adam steps close to it
    but not equal (compressed), kernels and their Adam moments still sharded by rows."""
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "fsdp.md")).read()
    section = doc.split("## A Flax NNX FSDP step", 1)[1].split("## In `shard_map`")[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    swapped = ("cgx.value_and_grad(loss_fn, mesh=mesh, axis_name=\"fsdp\")(\n"
               "        model, x, y, step=optimizer.step[...])")
    assert swapped in code
    runs = {}
    for name, source in (("cgx", code), ("nnx", code.replace(
            swapped, "nnx.value_and_grad(loss_fn)(model, x, y)"))):
        runs[name] = {}
        exec(source, runs[name])  # noqa: S102
    cgx_run, nnx_run = runs["cgx"], runs["nnx"]
    assert cgx_run["mesh"].axis_types == (AxisType.Explicit,)
    assert abs(float(cgx_run["loss"]) - float(nnx_run["loss"])) < 0.01 * float(nnx_run["loss"])
    got, want = (nnx.state(r["model"], nnx.Param) for r in (cgx_run, nnx_run))
    with jax.set_mesh(cgx_run["mesh"]):
        start = nnx.state(cgx_run["MLP"](nnx.Rngs(0)), nnx.Param)
    for g, w, s in zip(*(jax.tree.leaves(t) for t in (got, want, start))):
        moved, moved_want = np.asarray(g) - np.asarray(s), np.asarray(w) - np.asarray(s)
        # Adam's first steps are near lr * sign(g): 4-bit noise flips the signs of small
        # gradients (measured: 0.07-0.10 for the exact biases, 0.29-0.31 for the kernels).
        assert np.linalg.norm(moved - moved_want) < 0.5 * np.linalg.norm(moved_want)
        assert g.sharding.spec == w.sharding.spec
    assert not np.array_equal(got["up"]["kernel"][...], want["up"]["kernel"][...])
    assert got["up"]["kernel"][...].sharding.spec == P("fsdp", None)
    moments = nnx.state(cgx_run["optimizer"], nnx.OptState)["opt_state"][0]
    assert moments["mu"]["down"]["kernel"][...].sharding.spec == P("fsdp", None)
    assert int(cgx_run["optimizer"].step[...]) == 3


class RematMLP(fs.MLP):
    """The tutorial's MLP with each layer under ``nnx.remat``, the second reading its kernel
    as ``get_value()`` (the first as ``[...]``, inside ``nnx.Linear``)."""

    def __call__(self, x):
        hidden = nnx.remat(lambda layer, x: nnx.relu(layer(x)))(self.linear1, x)
        return nnx.remat(lambda layer, h: h @ layer.kernel.get_value() + layer.bias[...])(
            self.linear2, hidden)


class SlicedMLP(fs.MLP):
    """Reads only the first half of the output layer's kernel and bias, by index."""

    def __call__(self, x):
        hidden = nnx.relu(self.linear1(x))
        out = hidden @ self.linear2.kernel[:, :64] + self.linear2.bias[:64]
        return jnp.concatenate([out, jnp.zeros_like(out)], axis=-1)


@pytest.mark.parametrize("shape,names,kernel_axes,cls", [
    ((8,), ("fsdp",), ("fsdp", None), RematMLP),
    ((8,), ("fsdp",), ("fsdp", None), SlicedMLP),
    ((4, 2), ("fsdp", "model"), ("fsdp", "model"), RematMLP)])  # decoded at the start
def test_keeping_packets_for_backward_gives_the_same_gradients(shape, names, kernel_axes, cls):
    """keep_for_backward='packets' (weights decoded where the layers read them, by index
    too) gives the default's loss and gradients bit for bit (the same packets, keys and
    decoding), of nnx.value_and_grad's types, structure and shardings, and leaves the
    module's parameters as they were (plain nnx.Param, not the decoding ones)."""
    mesh = fsdp_mesh(shape, names)
    model, _ = fs.make_model(mesh, kernel_axes=kernel_axes, cls=cls)
    before = nnx.state(model, nnx.Param)
    loss, grads = grads_of(mesh, model, True, step=3, keep_for_backward="packets")
    want_loss, want = grads_of(mesh, model, True, step=3)
    _, exact = grads_of(mesh, model, False, step=3)
    assert_like_nnx(grads, exact, model)
    assert float(loss) == float(want_loss)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)
    assert max(relative_errors(grads, exact)) < 0.2
    after = nnx.state(model, nnx.Param)
    assert all(type(v) is nnx.Param for v in jax.tree.leaves(after, is_leaf=lambda v: isinstance(
        v, nnx.Variable)))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        assert a is b


def lowered_gradient_text(mesh, model, **options):
    """The StableHLO of the cgx gradient of one batch, before XLA's optimizations."""
    graph, state = nnx.split(model)

    def grad(state, x, y, i):
        loss_fn = lambda m, x, y: jnp.mean((m(x) - y) ** 2)  # noqa: E731
        return cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="fsdp", **options)(
            nnx.merge(graph, state), x, y, step=i)

    with jax.set_mesh(mesh):
        x, y = fs.batch(mesh, 0)
        return jax.jit(grad).lower(state, x, y, jnp.int32(0)).as_text()


def test_kept_packets_are_decoded_again_in_the_backward_of_a_remat_layer():
    """With 'packets' each kernel is decoded in the forward and again in its layer's
    backward (two decodes per kernel in the program), from the packets gathered once (one
    u8 all-gather per kernel, as with 'weights', which decodes each kernel once)."""
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh, cls=RematMLP)
    texts = {keep: lowered_gradient_text(mesh, model, keep_for_backward=keep)
             for keep in ("weights", "packets")}
    decodes = {k: t.count('custom_call @cgx_dequantize') for k, t in texts.items()}
    gathers = {k: len(re.findall(r"all_gather.*tensor<8x\d+xui8>", t)) for k, t in texts.items()}
    assert decodes == {"weights": 2, "packets": 4}, decodes
    assert gathers == {"weights": 2, "packets": 2}, gathers


def test_keep_for_backward_errors():
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh)
    with pytest.raises(ValueError, match=r"keep_for_backward must be one of \('weights', "
                                         r"'packets'\), got 'decoded'"):
        cgx.value_and_grad(lambda m, x: 0.0, mesh=mesh, axis_name="fsdp",
                           keep_for_backward="decoded")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    grad_fn = cgx.value_and_grad(lambda p, x: jnp.sum(x @ p["linear1"]["kernel"]), mesh=mesh,
                                 axis_name="fsdp", keep_for_backward="packets",
                                 param_specs={"linear1": {"kernel": P("fsdp", None),
                                                          "bias": P()},
                                              "linear2": {"kernel": P("fsdp", None),
                                                          "bias": P()}})
    with pytest.raises(ValueError, match=r"argument 0 is not an NNX module \(its parameters "
                                         r"\['linear1/kernel', 'linear2/kernel'\]"):
        with jax.set_mesh(mesh):
            grad_fn(params, fs.batch(mesh, 0)[0], step=jnp.int32(0))


def gradient_errors(mesh, spec, params, loss):
    """cgx's FSDP gradient (exact weights, default 4-bit gradients) less the exact one, per
    leaf, of plain-dict ``params`` placed with ``spec`` on the explicit-axes ``mesh``."""
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, NamedSharding(mesh, spec))
        x = jax.device_put(jax.random.normal(jax.random.key(5), (64, 256)),
                           NamedSharding(mesh, P("fsdp", None)))
        grad_fn = cgx.value_and_grad(loss, axis_name="fsdp", weight_policy=EXACT)
        _, got = jax.jit(grad_fn)(placed, x, step=jnp.int32(0))
        want = jax.jit(jax.grad(loss))(placed, x)
    for name in got:
        assert got[name].sharding.is_equivalent_to(placed[name].sharding, 2)
    return {name: np.asarray(got[name], np.float64) - np.asarray(want[name], np.float64)
            for name in got}


def correlation(a, b):
    assert np.std(a) > 0 and np.std(b) > 0  # both compressed
    return float(np.corrcoef(a.reshape(-1), b.reshape(-1))[0, 1])


def test_each_fsdp_leaf_and_each_model_block_draws_its_own_noise():
    """Equal gradients must not get equal noise: two equal row-sharded leaves (each leaf its
    own key), and the two equal column blocks of one leaf sharded over 'model' too (each
    block its own key). Shared noise would give a correlation of 1."""
    a = jax.random.normal(jax.random.key(4), (256, 256)) / 16
    loss = lambda p, x: sum(jnp.mean(jnp.tanh(x @ w)) for w in p.values())  # noqa: E731
    explicit = (AxisType.Explicit,)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=explicit)
    errors = gradient_errors(mesh, P("fsdp", None), {"a": a, "b": a}, loss)
    assert abs(correlation(errors["a"], errors["b"])) < 0.1
    mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=explicit * 2)
    errors = gradient_errors(mesh, P("fsdp", "model"), {"w": jnp.concatenate([a, a], 1)},
                             loss)["w"]
    assert abs(correlation(errors[:, :256], errors[:, 256:])) < 0.1


def test_fsdp_leaves_of_a_second_differentiated_argument():
    """argnums=(0, 1), each argument with a row-sharded leaf (and a replicated one): exact
    codecs give jax.grad's gradients, each sharded like its parameter."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    keys = jax.random.split(jax.random.key(6), 4)
    with jax.set_mesh(mesh):
        rows, whole = NamedSharding(mesh, P("fsdp", None)), NamedSharding(mesh, P())
        first = {"w": jax.device_put(jax.random.normal(keys[0], (256, 128)) / 16, rows)}
        second = {"v": jax.device_put(jax.random.normal(keys[1], (128, 64)) / 8, rows),
                  "c": jax.device_put(jax.random.normal(keys[2], (64,)), whole)}
        x = jax.device_put(jax.random.normal(keys[3], (64, 256)), rows)

        def loss(first, second, x):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ first["w"]) @ second["v"] + second["c"]))

        grad_fn = cgx.value_and_grad(loss, axis_name="fsdp", argnums=(0, 1), policy=EXACT,
                                     weight_policy=EXACT)
        value, got = jax.jit(grad_fn)(first, second, x, step=jnp.int32(0))
        want_value, want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(first, second, x)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w, p in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                       jax.tree.leaves((first, second))):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)



class TiedNet(nnx.Module):
    """One kernel read twice (tied weights): ``relu(x @ w) @ w``."""

    def __init__(self, din, dmid, dout, *, rngs, kernel_axes=("fsdp", None)):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel_axes)
        self.w = nnx.Param(init(rngs.params(), (din, din)))

    def __call__(self, x):
        return nnx.relu(x @ self.w[...]) @ self.w[...]


def test_a_weight_read_twice_is_refused_under_packets():
    """Tied weights under keep_for_backward='packets': each read would reduce-scatter its own
    part of the gradient (twice the bytes, the same noise twice), so it is a clear error;
    the default decodes once and gives nnx's gradient within the codec's error."""
    mesh = fsdp_mesh()
    model, _ = fs.make_model(mesh, sizes=(128, 128, 128), cls=TiedNet)
    with pytest.raises(ValueError, match=r"reads the FSDP weight .*'w'.* 2 times .*"
                                         r"keep_for_backward='weights'"):
        grads_of(mesh, model, True, keep_for_backward="packets")
    _, grads = grads_of(mesh, model, True)
    _, exact = grads_of(mesh, model, False)
    assert_like_nnx(grads, exact, model)
    assert max(relative_errors(grads, exact)) < 0.2


def test_a_placement_over_an_automatic_data_axis_is_read_or_refused():
    """Inside jit, a weight placed P('data', None) on a mesh of automatic axes is invisible
    when cgx traces: without param_specs= the step is refused when XLA compiles it (it would
    be data-parallel: the weight gathered in f32, the gradient replicated); with them it is
    FSDP (only packets gathered, the gradient sharded like the weight, near jax.grad's); a
    replicated weight runs as before, with nothing of the check left in the program."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))  # automatic axes
    rows = NamedSharding(mesh, P("data", None))
    w = jax.device_put(jax.random.normal(jax.random.key(0), (512, 256)), rows)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 512)), rows)
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
    want_loss, want = jax.value_and_grad(loss)(w, x)

    guessed = jax.jit(cgx.value_and_grad(loss, mesh=mesh, axis_name="data"))
    with pytest.raises(Exception, match=r"placed sharded over the data axis 'data' "
                                        r"\(P\('data', None\)\).*param_specs="):
        guessed(w, x, step=jnp.int32(0))
    told_replicated = jax.jit(cgx.value_and_grad(loss, mesh=mesh, axis_name="data",
                                                 param_specs=P()))
    with pytest.raises(Exception, match=r"param_specs gives it P\(\)"):
        told_replicated(w, x, step=jnp.int32(0))

    told = jax.jit(cgx.value_and_grad(loss, mesh=mesh, axis_name="data",
                                      param_specs=P("data", None)))
    value, grads = told(w, x, step=jnp.int32(0))
    assert grads.sharding.is_equivalent_to(rows, 2) and grads.dtype == w.dtype
    np.testing.assert_allclose(value, want_loss, rtol=1e-4)
    assert relative_errors(grads, want)[0] < 0.5
    hlo = told.lower(w, x, step=jnp.int32(0)).compile().as_text()
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    assert gathers and all(line.split("=")[1].strip().startswith("u8[") for line in gathers)

    replicated = jax.device_put(w, NamedSharding(mesh, P()))
    value, grads = guessed(replicated, x, step=jnp.int32(0))
    assert grads.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
    assert relative_errors(grads, want)[0] < 0.5
    hlo = guessed.lower(replicated, x, step=jnp.int32(0)).compile().as_text()
    assert "CustomSPMDPartitioning" not in hlo
