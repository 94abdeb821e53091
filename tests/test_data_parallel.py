"""cgx.value_and_grad (cgx_jax/_src/data_parallel.py, docs/design.md section 6): compressed
data-parallel gradients from inside plain jax.jit / nnx.jit, on 1-D and 2-D (data x model)
meshes, with replicated and model-sharded parameters."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import cgx_jax as cgx
from cgx_jax._src.vma import local_value_and_grad

AUTO = (AxisType.Auto, AxisType.Auto)
CODEC8 = cgx.Codec(bits=8, bucket_size=256, rounding="nearest")
NEAREST8 = cgx.LayerPolicy(default=CODEC8, min_size=1024)


def mesh_1d(cpu_devices, axis_types=(AxisType.Auto,)):
    return jax.make_mesh((8,), ("data",), axis_types=axis_types, devices=cpu_devices[:8])


def mesh_2d(cpu_devices):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO, devices=cpu_devices[:8])


def mse(params, x, y):
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def regression(seed=0, d=64, rows=32, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 5)
    params = {"w1": jax.random.normal(k[0], (d, 128), dtype) / 8,
              "b1": jnp.zeros((128,), dtype),
              "w2": jax.random.normal(k[1], (128, 16), dtype) / 8}
    x = jax.random.normal(k[2], (rows, d), dtype)
    y = jax.random.normal(k[3], (rows, 16), dtype)
    return params, x, y


def test_matches_shard_map_reference_bit_for_bit_and_exact_within_the_bound(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    grad_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=NEAREST8)
    value, grads = jax.jit(grad_fn)(params, x, y)

    # The same computation written by hand: local gradients, cgx's mean (nearest rounding).
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                       out_specs=(P(), P()))
    def reference(params, x, y):
        loss, g = local_value_and_grad(mse, "data")(params, x, y)
        return jax.lax.pmean(loss, "data"), cgx.compressed_pmean(g, "data", policy=NEAREST8)

    want_value, want = jax.jit(reference)(params, x, y)
    assert float(value) == float(want_value)
    for name in params:
        np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(want[name]))

    exact_value, exact = jax.value_and_grad(mse)(params, x, y)
    np.testing.assert_allclose(float(value), float(exact_value), rtol=1e-5)
    np.testing.assert_allclose(grads["b1"], exact["b1"], rtol=1e-4, atol=1e-7)  # exact leaf
    for name in ("w1", "w2"):  # 8-bit nearest: within one unit of each local bucket's range
        scale = float(jnp.max(jnp.abs(exact[name])))
        assert float(jnp.max(jnp.abs(grads[name] - exact[name]))) < 0.02 * scale
        assert grads[name].shape == params[name].shape and grads[name].dtype == jnp.float32


def test_an_eager_call_gives_the_jitted_bits_with_and_without_a_residual(cpu_devices):
    """Called outside jit, each stage runs as one compiled program (it used to run op by op):
    the same loss, gradients, residual and shardings as under jax.jit, with the default
    4-bit stochastic policy (the noise from the step)."""
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression(d=256)
    step = jnp.int32(7)
    grad_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data")
    ef_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data", error_feedback=True)
    residual = cgx.init_residual(params, mesh=mesh, axis_name="data", policy=ef_fn)
    for fn, extra in ((grad_fn, {}), (ef_fn, {"residual": residual})):
        eager = fn(params, x, y, step=step, **extra)
        jitted = jax.jit(lambda p, x, y, s, e, fn=fn: fn(p, x, y, step=s, **e))(
            params, x, y, step, extra)
        assert jax.tree.structure(eager) == jax.tree.structure(jitted)
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
            assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cgx.summary(grad_fn, params).count("4 bit") >= 1  # "w1" compressed: noise used


def test_explicit_mesh_axes_and_bf16(cpu_devices):
    mesh = mesh_1d(cpu_devices, axis_types=(AxisType.Explicit,))
    params, x, y = regression(dtype=jnp.bfloat16)
    policy = cgx.LayerPolicy(default=cgx.Codec(bits=8), min_size=1024)  # stochastic
    grad_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=policy)
    value, grads = jax.jit(grad_fn)(params, x, y, step=jnp.int32(3))
    _, exact = jax.value_and_grad(mse)(params, x, y)
    assert jax.tree.map(lambda g: (g.shape, g.dtype), grads) == \
        jax.tree.map(lambda g: (g.shape, g.dtype), exact)
    # In numpy: the two arrays live on different meshes (jax 0.9 refuses mixing them).
    got, want = (np.asarray(g["w1"]).astype(np.float32) for g in (grads, exact))
    assert np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want)


def test_noise_comes_from_the_step(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    policy = cgx.LayerPolicy(min_size=1024)  # 4-bit stochastic
    grad_fn = jax.jit(cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=policy))
    a = grad_fn(params, x, y, step=jnp.int32(1))[1]["w1"]
    b = grad_fn(params, x, y, step=jnp.int32(1))[1]["w1"]
    c = grad_fn(params, x, y, step=jnp.int32(2))[1]["w1"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_a_step_that_could_repeat_is_an_error(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    grad_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data",
                                 policy=cgx.LayerPolicy(min_size=1024))
    with pytest.raises(ValueError, match=r"pass step=.*optimizer\.step"):
        jax.jit(grad_fn)(params, x, y)
    with pytest.raises(TypeError, match="Python int 5.*repeat every call"):
        grad_fn(params, x, y, step=5)
    with pytest.raises(TypeError, match="integer scalar"):
        grad_fn(params, x, y, step=jnp.float32(1))


def test_bad_arguments_name_what_is_wrong(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    with pytest.raises(ValueError, match=r"axis_name 'batch' is not an axis of the mesh"):
        cgx.value_and_grad(mse, mesh=mesh, axis_name="batch")
    with pytest.raises(TypeError, match="policy must be a cgx_jax.LayerPolicy"):
        cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=CODEC8)
    params, x, y = regression()
    with pytest.raises(ValueError, match="pass the batch as arguments"):
        cgx.value_and_grad(lambda p: mse(p, x, y), mesh=mesh, axis_name="data")(params)
    with pytest.raises(ValueError, match="argnums 3 names argument 3"):
        cgx.value_and_grad(mse, mesh=mesh, axis_name="data", argnums=3)(params, x, y)
    with pytest.raises(ValueError, match=r"'w1' has dimension 0 sharded over \('data', "
                                         r"'model'\) together"):
        cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=NEAREST8,
                           param_specs={"w1": P(("data", "model")), "b1": P(), "w2": P()})(
            params, x, y)
    with pytest.raises(ValueError, match=r"parameters \['w1'\] are sharded over 'data' "
                                         r"\(FSDP\).*no error feedback"):
        cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=NEAREST8,
                           error_feedback=True,
                           param_specs={"w1": P("data"), "b1": P(), "w2": P()})(
            params, x, y, residual=params)


def test_a_loss_sized_for_the_global_batch_gets_a_note_that_says_why(cpu_devices):
    """A loss that reshapes with the global batch size (as under GSPMD) fails on a
    participant's rows; the error keeps its type and gains a note naming the fix."""
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    rows = x.shape[0]

    def loss(params, x, y):
        return mse(params, x.reshape(rows, x.shape[-1]), y)

    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="data", policy=NEAREST8)
    with pytest.raises(TypeError, match="reshape") as caught:
        grad_fn(params, x, y)
    assert "on that participant's rows" in " ".join(getattr(caught.value, "__notes__", []))


class ShardedMLP(nnx.Module):
    """The Flax GSPMD guide's DotReluDot shape: weights sharded over 'model'."""

    def __init__(self, d, rngs, constraint=P(None, "model")):
        init = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(d, d, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, (None, "model")))
        self.w2 = nnx.Param(init(rngs.params(), (d, d)), out_sharding=("model", None))
        self.bias = nnx.Param(jnp.zeros((d,)))
        self.constraint = constraint

    def __call__(self, x):
        y = jax.lax.with_sharding_constraint(jax.nn.relu(self.dot1(x)), self.constraint)
        return y @ self.w2[...] + self.bias[...]


def sharded_model(mesh, d=256, **kwargs):
    with jax.set_mesh(mesh):
        @nnx.jit
        def create():
            model = ShardedMLP(d, nnx.Rngs(0), **kwargs)
            state = nnx.state(model)
            nnx.update(model, jax.lax.with_sharding_constraint(
                state, nnx.get_partition_spec(state)))
            return model
        return create()


def nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def data(mesh, d=256, rows=64, seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    spec = NamedSharding(mesh, P("data", None))
    return (jax.device_put(jax.random.normal(k1, (rows, d)), spec),
            jax.device_put(jax.random.normal(k2, (rows, d)), spec))


def model_and_optimizer(mesh):
    model = sharded_model(mesh)
    with jax.set_mesh(mesh):  # Adam's moments take the parameters' sharding annotations
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def train(mesh, steps, use_cgx, policy=None):
    model, optimizer = model_and_optimizer(mesh)
    x, y = data(mesh)
    grad_fn = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data", policy=policy)

    @nnx.jit
    def step(model, optimizer, x, y):
        if use_cgx:
            loss, grads = grad_fn(model, x, y, step=optimizer.step[...])
        else:
            loss, grads = nnx.value_and_grad(nnx_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    with jax.set_mesh(mesh):
        losses = [float(step(model, optimizer, x, y)) for _ in range(steps)]
    return model, optimizer, losses


def test_nnx_optimizer_on_a_2d_mesh_trains_like_exact_and_keeps_shardings(cpu_devices):
    mesh = mesh_2d(cpu_devices)
    eight_bits = cgx.LayerPolicy(default=cgx.Codec(bits=8))
    model, optimizer, losses = train(mesh, 60, use_cgx=True, policy=eight_bits)
    _, _, exact = train(mesh, 60, use_cgx=False)
    _, _, defaults = train(mesh, 60, use_cgx=True)  # 4 bits: slower, but it trains
    assert exact[-1] < 0.2 * exact[0]
    assert abs(losses[-1] - exact[-1]) < 0.02 * exact[-1], (losses[-1], exact[-1])
    assert defaults[-1] < 0.3 * defaults[0]
    for param, spec in ((model.dot1.kernel, P(None, "model")), (model.w2, P("model", None))):
        assert param[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), spec
    assert int(optimizer.step[...]) == 60


def test_2d_step_gathers_no_model_sharded_gradient(cpu_devices):
    mesh = mesh_2d(cpu_devices)
    model, optimizer = model_and_optimizer(mesh)
    x, y = data(mesh)
    graph, state = nnx.split((model, optimizer))

    def step(state, x, y):
        model, optimizer = nnx.merge(graph, state)
        loss, grads = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data")(
            model, x, y, step=optimizer.step[...])
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    with jax.set_mesh(mesh):
        hlo = jax.jit(step).lower(state, x, y).compile().as_text()
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    # Only the packets travel gathered (u8), over the data axis; no f32 gradient is gathered.
    assert gathers and all(line.split("=")[1].strip().startswith("u8[") for line in gathers), \
        gathers
    # Each device encodes its own shard: the packets hold 256 * 256 / 4 values per device.
    assert all("u8[2," in line for line in gathers), gathers


def test_the_policy_decides_on_the_whole_parameter_not_the_shard(cpu_devices):
    """A 128x128 kernel has 16,384 values (the default min_size) but each of the 4 model
    shards only 4,096: it is compressed as cgx.summary says, on every shard."""
    mesh = mesh_2d(cpu_devices)
    model = sharded_model(mesh, d=128)
    x, y = data(mesh, d=128)
    grad_fn = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data")
    table = cgx.summary(grad_fn, nnx.state(model, nnx.Param))
    assert re.search(r"dot1/kernel\s+\(128, 128\)\s+4 bit", table), table
    with jax.set_mesh(mesh):
        step = nnx.jit(lambda m, x, y: grad_fn(m, x, y, step=jnp.int32(3)))
        _, grads = step(model, x, y)
        _, exact = nnx.jit(nnx.value_and_grad(nnx_loss))(model, x, y)
        hlo = step.lower(model, x, y).compile().as_text()
    assert re.search(r"= u8\[\S+ all-gather\(", hlo), "no packet was gathered"
    got, want = np.asarray(grads["dot1"]["kernel"][...]), np.asarray(exact["dot1"]["kernel"][...])
    assert not np.array_equal(got, want)  # quantized...
    # ...by 4 bits: stochastic rounding of a mean of two errs about 0.2 relative (L2)
    assert np.linalg.norm(got - want) < 0.4 * np.linalg.norm(want)
    np.testing.assert_allclose(grads["bias"][...], exact["bias"][...], rtol=1e-5, atol=1e-7)


class ExplicitMLP(nnx.Module):
    """Weights sharded over an explicit 'model' axis (no sharding constraints: explicit
    meshes carry the shardings in the types)."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(128, 256, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(init, (None, "model")))
        self.dot2 = nnx.Linear(256, 16, rngs=rngs)

    def __call__(self, x):
        return self.dot2(jax.nn.relu(self.dot1(x)))


def test_explicit_2d_mesh_with_a_model_sharded_nnx_module(cpu_devices):
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=cpu_devices[:8],
                         axis_types=(AxisType.Explicit, AxisType.Explicit))
    with jax.set_mesh(mesh):
        model = ExplicitMLP(nnx.Rngs(0))
    x, y = data(mesh, d=128)
    y = y[:, :16]
    grad_fn = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data", policy=NEAREST8)
    with jax.set_mesh(mesh):
        loss, grads = nnx.jit(lambda m, x, y: grad_fn(m, x, y))(model, x, y)
        want_loss, want = nnx.jit(nnx.value_and_grad(nnx_loss))(model, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got, exact = grads["dot1"]["kernel"][...], want["dot1"]["kernel"][...]
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    # 8-bit nearest rounding of a mean of two: within one unit of each bucket's range.
    assert not np.array_equal(np.asarray(got), np.asarray(exact))
    assert np.linalg.norm(got - exact) < 0.02 * np.linalg.norm(exact)


def test_a_constraint_naming_the_data_axis_gets_a_cgx_error(cpu_devices):
    mesh = mesh_2d(cpu_devices)
    model = sharded_model(mesh, constraint=P("data", "model"))
    x, y = data(mesh)
    grad_fn = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"names 'data'.*P\(None, 'model'\)"):
        nnx.jit(lambda m, x, y: grad_fn(m, x, y, step=jnp.int32(0)))(model, x, y)


@pytest.mark.parametrize("annotate, words", [
    (lambda x, w: jnp.einsum("bd,de->be", x, w, out_sharding=P("data", None)),
     "an out_sharding= of jnp.einsum in the loss names 'data' (P('data', None))"),
    (lambda x, w: jnp.dot(x, w, out_sharding=P("data", None)), "an out_sharding= of a matmul"),
    (lambda x, w: jax.sharding.reshard(x @ w, P("data", None)), "a jax.sharding.reshard"),
    (lambda x, w: jax.lax.with_sharding_constraint(x @ w, P("data", None)),
     "a jax.lax.with_sharding_constraint"),
], ids=["einsum", "dot", "reshard", "constraint"])
def test_each_annotation_naming_the_data_axis_gets_a_cgx_error(cpu_devices, annotate, words):
    """Explicit axes (the Training Cookbook's model): the loss runs under jax.value_and_grad;
    under cgx.value_and_grad its annotations of the data axis get cgx's words and the fix."""
    mesh = mesh_1d(cpu_devices, (AxisType.Explicit,))
    loss = lambda w, x: jnp.mean(annotate(x, w) ** 2)  # noqa: E731
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((128, 64)), P())
        x = jax.device_put(jnp.ones((16, 128)), P("data", None))
        jax.jit(jax.value_and_grad(loss))(w, x)
        with pytest.raises(ValueError) as info:
            jax.jit(cgx.value_and_grad(loss, axis_name="data"))(w, x, step=jnp.int32(0))
    message = str(info.value)
    assert message.startswith("cgx.value_and_grad runs the loss once per data-parallel "
                              "participant, manual over 'data'")
    assert words in message and "P('data', None) becomes P(None, None)" in message


def test_a_named_sharding_on_an_automatic_data_axis_gets_a_cgx_error_and_its_fix_works(
        cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()

    def loss(spec_or_sharding):
        def mse_constrained(params, x, y):
            hidden = jax.lax.with_sharding_constraint(x @ params["w1"], spec_or_sharding)
            return jnp.mean((jax.nn.relu(hidden + params["b1"]) @ params["w2"] - y) ** 2)
        return mse_constrained

    grad_fn = cgx.value_and_grad(loss(NamedSharding(mesh, P(None, None))), axis_name="data",
                                 policy=NEAREST8)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="a NamedSharding built on the "
                                           "mesh, where 'data' is automatic"):
        jax.jit(grad_fn)(params, x, y)
    fixed = cgx.value_and_grad(loss(P(None, None)), axis_name="data", policy=NEAREST8)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(fixed)(params, x, y)
    want_value, want = jax.jit(cgx.value_and_grad(mse, mesh=mesh, axis_name="data",
                                                  policy=NEAREST8))(params, x, y)
    assert float(value) == float(want_value)
    jax.tree.map(np.testing.assert_array_equal, grads, want)


def test_the_mesh_set_by_set_mesh_is_used_when_none_is_given(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    want_value, want = jax.jit(cgx.value_and_grad(mse, mesh=mesh, axis_name="data",
                                                  policy=NEAREST8))(params, x, y)
    grad_fn = cgx.value_and_grad(mse, axis_name="data", policy=NEAREST8)
    with jax.set_mesh(mesh):
        value, grads = jax.jit(grad_fn)(params, x, y)  # inside jit: the abstract mesh only
        eager_value, eager = grad_fn(params, x, y)
        residual = cgx.init_residual(params, axis_name="data", policy=grad_fn)
    assert float(value) == float(want_value) == float(eager_value)
    jax.tree.map(np.testing.assert_array_equal, grads, want)
    jax.tree.map(np.testing.assert_array_equal, eager, want)
    assert residual["w1"].sharding == NamedSharding(mesh, P("data"))
    with pytest.raises(ValueError, match=r"no mesh: pass mesh=, or call inside "
                                         r"jax.sharding.set_mesh\(mesh\)"):
        jax.jit(grad_fn)(params, x, y)
    with pytest.raises(ValueError, match="no mesh: pass mesh="):
        cgx.init_residual(params, axis_name="data")
    other = jax.make_mesh((8,), ("batch",), devices=cpu_devices[:8])
    with jax.set_mesh(other), pytest.raises(ValueError, match="axis_name 'data' is not an "
                                             "axis of the mesh, whose axes are .'batch',."):
        jax.jit(grad_fn)(params, x, y)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh .* got str"):
        cgx.value_and_grad(mse, mesh="data", axis_name="data")


def test_has_aux_and_several_argnums(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()

    def loss_with_aux(params, scale, x, y):
        loss = mse(params, x, y) * scale["s"]
        return loss, {"loss": loss}

    grad_fn = cgx.value_and_grad(loss_with_aux, mesh=mesh, axis_name="data", argnums=(0, 1),
                                 has_aux=True, policy=NEAREST8)
    (value, aux), (g_params, g_scale) = jax.jit(grad_fn)(params, {"s": jnp.float32(2.0)}, x, y)
    (want_value, _), (_, want_scale) = jax.value_and_grad(
        loss_with_aux, argnums=(0, 1), has_aux=True)(params, {"s": jnp.float32(2.0)}, x, y)
    np.testing.assert_allclose(float(aux["loss"]), float(want_value), rtol=1e-5)
    np.testing.assert_allclose(float(g_scale["s"]), float(want_scale["s"]), rtol=1e-4)
    assert set(g_params) == {"w1", "b1", "w2"}


def test_policy_patterns_match_the_paths_of_the_gradients_as_returned(cpu_devices):
    """A policy's patterns see the paths that fit_policy, summary and init_residual see
    (``w2``, not ``0/w2``): an exclusion keeps its leaf exact, and a policy fitted on the
    returned gradients drives the step and its residual (it failed with "matches no leaf")."""
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    _, want = jax.value_and_grad(mse)(params, x, y)
    policy = cgx.LayerPolicy(default=CODEC8, min_size=1024, exclude=("^w2$",))
    _, grads = jax.jit(cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=policy))(
        params, x, y)
    np.testing.assert_allclose(grads["w2"], want["w2"], rtol=1e-5, atol=1e-8)  # exact psum
    assert np.abs(np.asarray(grads["w1"]) - want["w1"]).max() > 1e-6  # 8 bits
    fitted = cgx.fit_policy(want, budget_bits=4.0, bucket_size=256,
                            base=cgx.LayerPolicy(min_size=1024))
    assert [path for path, _ in fitted.overrides] == ["^w1$", "^w2$"]
    grad_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=fitted,
                                 error_feedback=True)
    residual = cgx.init_residual(params, mesh=mesh, axis_name="data", policy=grad_fn)
    _, grads, new_residual = jax.jit(grad_fn)(params, x, y, step=jnp.int32(0),
                                              residual=residual)
    assert jax.tree.map(jnp.shape, new_residual) == jax.tree.map(jnp.shape, residual)
    assert float(jnp.abs(new_residual["w1"]).max()) > 0  # compressed: something was lost
    for name in ("w1", "w2"):  # within a few 2-6 bit units of the exact mean
        scale = float(jnp.abs(want[name]).max())
        assert float(jnp.abs(grads[name] - want[name]).max()) < scale, name


def test_a_numpy_scalar_parameter_is_differentiated_like_an_array(cpu_devices):
    """Called eagerly (no jit turning it into an array), a np.float32 leaf of the parameters
    is a parameter as jax.value_and_grad takes it: its gradient comes back, not None."""
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    loss = lambda p, x, y: mse(p["net"], x, y) * p["scale"]  # noqa: E731
    tree = {"net": params, "scale": np.float32(2.0)}
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="data", policy=NEAREST8)
    value, grads = grad_fn(tree, x, y)
    want_value, want = jax.value_and_grad(loss)(tree, x, y)
    assert grads["scale"] is not None
    np.testing.assert_allclose(float(grads["scale"]), float(want["scale"]), rtol=1e-4)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)


def test_error_feedback_residual_is_per_participant_and_sharded_like_its_parameter(
        cpu_devices):
    mesh = mesh_2d(cpu_devices)
    model, optimizer = model_and_optimizer(mesh)
    x, y = data(mesh)
    residual = cgx.init_residual(model, mesh=mesh, axis_name="data")
    kernel = residual["dot1"]["kernel"][...]
    assert kernel.shape == (2, 256, 256)  # one row per data participant, no more
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "model")), 3)
    # Each device holds 1/8 of it: its row and its model shard, no full copy.
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 256, 64)}
    grad_fn = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data", error_feedback=True,
                                 policy=cgx.LayerPolicy(default=cgx.Codec(bits=2)))

    @nnx.jit
    def step(model, optimizer, residual, x, y):
        loss, grads, residual = grad_fn(model, x, y, step=optimizer.step[...],
                                        residual=residual)
        optimizer.update(model, grads)
        return loss, residual

    with jax.set_mesh(mesh):
        _, new = step(model, optimizer, residual, x, y)
        new_kernel = new["dot1"]["kernel"][...]
        assert new_kernel.sharding.is_equivalent_to(kernel.sharding, 3)
        # 2-bit compression loses something on every participant, differently on each.
        assert float(jnp.max(jnp.abs(new_kernel))) > 0
        assert not np.array_equal(np.asarray(new_kernel[0]), np.asarray(new_kernel[1]))
        # An exact leaf loses nothing: one zero per participant, not a copy of the leaf.
        assert new["bias"][...].shape == (2, 1)
        assert float(jnp.max(jnp.abs(new["bias"][...]))) == 0
        with pytest.raises(ValueError, match="pass residual="):
            nnx.jit(lambda m, x, y: grad_fn(m, x, y, step=jnp.int32(0)))(model, x, y)
        # A residual made for another policy: a clear error naming the fix, not garbage.
        every_leaf = cgx.value_and_grad(nnx_loss, mesh=mesh, axis_name="data",
                                        error_feedback=True, policy=cgx.LayerPolicy(
                                            default=cgx.Codec(bits=2), min_size=1, min_ndim=1))
        with pytest.raises(ValueError, match=r"residual leaf 'bias' has shape \(2, 1\).*"
                                             r"policy=grad_fn"):
            nnx.jit(lambda m, x, y, r: every_leaf(m, x, y, step=jnp.int32(0), residual=r))(
                model, x, y, residual)


def test_error_feedback_is_bit_for_bit_compressed_allreduces(cpu_devices):
    """Five SGD steps with 2-bit nearest rounding: the same parameters and residuals as
    optax.chain(compressed_allreduce(error_feedback=True), sgd) under shard_map."""
    mesh = mesh_1d(cpu_devices)
    params, x, y = regression()
    policy = cgx.LayerPolicy(default=cgx.Codec(bits=2, bucket_size=256, rounding="nearest"),
                             min_size=1024)
    grad_fn = cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=policy,
                                 error_feedback=True)
    sgd = optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, residual, x, y):
        _, grads, residual = grad_fn(params, x, y, residual=residual)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, residual

    tx = optax.chain(cgx.compressed_allreduce("data", policy=policy, error_feedback=True),
                     optax.sgd(0.1))
    state = cgx.shard_state(tx.init(params), mesh, "data")
    specs = cgx.state_specs(state, "data")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                       out_specs=(P(), specs))
    def reference(params, state, x, y):
        _, grads = local_value_and_grad(mse, "data")(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    got, opt_state = params, sgd.init(params)
    residual = cgx.init_residual(params, mesh=mesh, axis_name="data", policy=grad_fn)
    want = params
    for _ in range(5):
        got, opt_state, residual = step(got, opt_state, residual, x, y)
        want, state = reference(want, state, x, y)
    for name in params:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
        np.testing.assert_array_equal(np.asarray(residual[name]),
                                      np.asarray(state[0].residual[name]))
    assert float(jnp.max(jnp.abs(residual["w1"]))) > 0


def test_summary_reads_the_policy_of_a_transform_or_grad_fn(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    params, _, _ = regression()
    nothing = cgx.LayerPolicy(min_size=10**9)
    for source in (cgx.compressed_allreduce("data", policy=nothing),
                   cgx.value_and_grad(mse, mesh=mesh, axis_name="data", policy=nothing)):
        table = cgx.summary(source, params)
        assert "bit" not in table and table.splitlines()[-1].split()[-2] == "1.0x", table
    assert "4 bit/128" in cgx.summary(cgx.compressed_allreduce("data"),
                                       {"w": jnp.zeros((256, 256))})
    with pytest.raises(TypeError, match="optax.chain does not show its members"):
        cgx.summary(optax.chain(cgx.compressed_allreduce("data"), optax.sgd(0.1)), params)


def test_state_helpers_refuse_an_nnx_optimizer_instead_of_misplacing_it(cpu_devices):
    mesh = mesh_1d(cpu_devices)
    model = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
    tx = optax.chain(cgx.compressed_allreduce("data", error_feedback=True), optax.adam(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for state in (optimizer, nnx.state(optimizer)):
        with pytest.raises(TypeError, match="cgx.value_and_grad.*error_feedback=True"):
            cgx.shard_state(state, mesh, "data")
        with pytest.raises(TypeError, match="not an"):
            cgx.state_specs(state, "data")
