"""cgx.value_and_grad with the model styles users bring (cgx_jax/_src/data_parallel.py,
cgx_jax/_src/trees.py; docs/design.md section 6): a plain pytree of arrays placed with
NamedShardings (the JAX docs' MLP) keeps its sharding without param_specs= over explicit
mesh axes, and over automatic axes gets a warning naming the fix; an Equinox model with
activation functions among its leaves works as it is, with the gradients
equinox.filter_value_and_grad gives; summary and init_residual take such models too."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import cgx_jax as cgx

# Every leaf compressed, biases too: then any f32 all-gather in the HLO is a gradient.
EIGHT_BITS = cgx.LayerPolicy(default=cgx.Codec(bits=8, bucket_size=256, rounding="nearest"),
                             min_size=1, min_ndim=1)
EXACT = cgx.LayerPolicy(default=None)
# The layers' specs over 'model' (the second and third weights sharded, as in the JAX docs'
# "Distributed arrays and automatic parallelization" MLP); the last layer replicated.
SPECS = [(P(), P()), (P(None, "model"), P("model")), (P("model", None), P()), (P(), P())]
# Explicit axes refuse a product whose two contracted dimensions are both sharded (it is
# ambiguous without an out_sharding): there the third weight is replicated.
EXPLICIT_SPECS = [(P(), P()), (P(None, "model"), P("model")), (P(), P()), (P(), P())]


def mlp_params(key):
    sizes = [(64, 128), (128, 256), (256, 128), (128, 16)]
    keys = jax.random.split(key, len(sizes))
    return [(jax.random.normal(k, shape) / np.sqrt(shape[0]), jnp.zeros(shape[1]))
            for k, shape in zip(keys, sizes)]


def mlp_loss(params, x, y):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return jnp.mean((x @ w + b - y) ** 2)


def placed(mesh, cpu_devices, specs=SPECS):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    params = jax.tree.map(put, mlp_params(jax.random.key(0)), specs,
                          is_leaf=lambda s: isinstance(s, P))
    x = put(jax.random.normal(jax.random.key(1), (32, 64)), P("batch"))
    y = put(jax.random.normal(jax.random.key(2), (32, 16)), P("batch"))
    return params, x, y


def mesh_4x2(cpu_devices, axis_type):
    return jax.make_mesh((4, 2), ("batch", "model"), axis_types=(axis_type, axis_type),
                         devices=cpu_devices[:8])


def step_and_hlo(grad_fn, mesh, params, x, y):
    step = jax.jit(lambda p, x, y: grad_fn(p, x, y, step=jnp.int32(0)))
    with jax.set_mesh(mesh):
        out = step(params, x, y)
        hlo = step.lower(params, x, y).compile().as_text()
    return out, hlo


def assert_sharded_like(grads, params):
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)


def assert_only_packets_gathered(hlo):
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    assert gathers, "no packet was gathered"
    assert all(line.split("=")[1].strip().startswith("u8[") for line in gathers), gathers


def assert_within_eight_bits(grads, params, x, y):
    want = jax.grad(mlp_loss)(jax.device_get(params), jax.device_get(x), jax.device_get(y))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert np.linalg.norm(g - w) <= 0.02 * np.linalg.norm(w) + 1e-7


def test_explicit_axes_keep_the_sharding_without_param_specs(cpu_devices):
    mesh = mesh_4x2(cpu_devices, AxisType.Explicit)
    params, x, y = placed(mesh, cpu_devices, EXPLICIT_SPECS)
    grad_fn = cgx.value_and_grad(mlp_loss, mesh=mesh, axis_name="batch", policy=EIGHT_BITS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the types say it all: no warning
        (value, grads), hlo = step_and_hlo(grad_fn, mesh, params, x, y)
    assert_sharded_like(grads, params)
    assert re.search(r"= u8\[\S+ all-gather\(", hlo), "no packet was gathered"
    assert_within_eight_bits(grads, params, x, y)
    assert abs(float(value) - float(mlp_loss(*jax.device_get((params, x, y))))) < 1e-5


def test_automatic_axes_inside_jit_keep_the_sharding_without_param_specs(cpu_devices):
    """Plain arrays placed over an automatic 'model' axis, traced by jit (no layout at trace
    time): their gradients are reduced where XLA's partitioner knows the layout, so they
    come back sharded like the parameters, without a warning, each device moving only u8
    packets of its own shard."""
    mesh = mesh_4x2(cpu_devices, AxisType.Auto)
    params, x, y = placed(mesh, cpu_devices)
    grad_fn = cgx.value_and_grad(mlp_loss, mesh=mesh, axis_name="batch", policy=EIGHT_BITS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (value, grads), hlo = step_and_hlo(grad_fn, mesh, params, x, y)
    assert "CustomSPMDPartitioning" not in hlo  # partitioned away
    assert_sharded_like(grads, params)
    assert_only_packets_gathered(hlo)
    assert_within_eight_bits(grads, params, x, y)
    assert abs(float(value) - float(mlp_loss(*jax.device_get((params, x, y))))) < 1e-5


def test_automatic_axes_with_error_feedback_warn_with_the_fix(cpu_devices):
    """Error feedback's residual is placed before tracing, so a layout decided after
    tracing is taken as replicated, with a warning that says how to pass param_specs."""
    mesh = mesh_4x2(cpu_devices, AxisType.Auto)
    params, x, y = placed(mesh, cpu_devices)
    grad_fn = cgx.value_and_grad(mlp_loss, mesh=mesh, axis_name="batch", policy=EIGHT_BITS,
                                 error_feedback=True)
    residual = cgx.init_residual(params, mesh=mesh, axis_name="batch", policy=grad_fn)
    step = jax.jit(lambda p, x, y, r: grad_fn(p, x, y, step=jnp.int32(0), residual=r))
    with pytest.warns(UserWarning, match=re.escape(
            "with error feedback cannot see how parameters ['0/0', '0/1', '1/0'] ... are "
            "sharded over the automatic mesh axes ('model',)")) as caught:
        _, grads, _ = step(params, x, y, residual)
    assert "param_specs=jax.tree.map(lambda a: a.sharding.spec, params)" in str(
        caught[0].message)
    assert_within_eight_bits(grads, params, x, y)  # right values, replicated over 'model'
    assert all(g.sharding.is_fully_replicated for g in jax.tree.leaves(grads))


def test_automatic_axes_with_the_arrays_own_specs_keep_the_sharding(cpu_devices):
    mesh = mesh_4x2(cpu_devices, AxisType.Auto)
    params, x, y = placed(mesh, cpu_devices)
    specs = jax.tree.map(lambda a: a.sharding.spec, params)  # the warning's one line
    grad_fn = cgx.value_and_grad(mlp_loss, mesh=mesh, axis_name="batch", policy=EIGHT_BITS,
                                 param_specs=specs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (_, grads), hlo = step_and_hlo(grad_fn, mesh, params, x, y)
    assert_sharded_like(grads, params)
    assert_only_packets_gathered(hlo)
    assert_within_eight_bits(grads, params, x, y)


def test_placed_arrays_outside_jit_need_no_param_specs(cpu_devices):
    mesh = mesh_4x2(cpu_devices, AxisType.Auto)
    params, x, y = placed(mesh, cpu_devices)
    grad_fn = cgx.value_and_grad(mlp_loss, mesh=mesh, axis_name="batch", policy=EIGHT_BITS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax.set_mesh(mesh):
            _, grads = grad_fn(params, x, y, step=jnp.int32(0))
    assert_sharded_like(grads, params)


def test_replicated_parameters_say_so_with_an_empty_spec(cpu_devices):
    mesh = mesh_4x2(cpu_devices, AxisType.Auto)
    params, x, y = placed(mesh, cpu_devices)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    grad_fn = cgx.value_and_grad(mlp_loss, mesh=mesh, axis_name="batch", policy=EIGHT_BITS,
                                 param_specs=P())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (_, grads), _ = step_and_hlo(grad_fn, mesh, params, x, y)
    assert_within_eight_bits(grads, params, x, y)


# ---------------------------------------------------------------------------
# Models with leaves that are not arrays
# ---------------------------------------------------------------------------

def test_plain_pytrees_with_ints_and_functions_and_a_float_argument(cpu_devices):
    """Non-array leaves are passed to the loss as they are and get no gradient (None), in
    parameters and in the other arguments (here a Python float, not split over the data
    axis)."""
    mesh = jax.make_mesh((8,), ("batch",), devices=cpu_devices[:8])
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 8).reshape(64, 8), "act": jnp.tanh,
              "depth": 2, "steps": jnp.arange(3)}

    def loss(params, x, scale):
        h = x
        for _ in range(params["depth"]):
            h = params["act"](h @ params["w"][:, :8] if h.shape[1] == 64 else h)
        return scale * jnp.mean(h ** 2) + 0.0 * params["steps"].sum()

    x = jax.random.normal(jax.random.key(0), (16, 64))
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="batch", policy=EXACT)
    # jax.jit takes arrays only: the function and the int come in through the closure.
    value, grads = jax.jit(lambda w, steps, x: grad_fn({**params, "w": w, "steps": steps}, x,
                                                        0.5))(params["w"], params["steps"], x)
    assert grads["act"] is None and grads["depth"] is None and grads["steps"] is None
    want_value, want = jax.value_and_grad(
        lambda w: loss({**params, "w": w}, x, 0.5))(params["w"])
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    np.testing.assert_allclose(grads["w"], want, rtol=1e-5, atol=1e-7)


def test_an_equinox_model_works_as_it_is(cpu_devices):
    eqx = pytest.importorskip("equinox")
    mesh = jax.make_mesh((8,), ("batch",), devices=cpu_devices[:8])
    model = eqx.nn.MLP(64, 16, 256, 3, key=jax.random.key(0))  # relu and identity are leaves

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    x = jax.random.normal(jax.random.key(1), (64, 64))
    y = jax.random.normal(jax.random.key(2), (64, 16))
    want_value, want = eqx.filter_value_and_grad(loss)(model, x, y)

    exact = cgx.value_and_grad(loss, mesh=mesh, axis_name="batch", policy=EXACT)
    value, grads = eqx.filter_jit(exact)(model, x, y)
    assert type(grads) is type(model)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)

    # Compressed, with error feedback: the residual holds the arrays only.
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="batch", error_feedback=True,
                                 policy=cgx.LayerPolicy(default=cgx.Codec(bits=8)))
    residual = cgx.init_residual(model, mesh=mesh, axis_name="batch", policy=grad_fn)
    assert jax.tree.structure(residual) == jax.tree.structure(want)
    table = cgx.summary(grad_fn, model)
    assert "layers/0/weight" in table and "activation" not in table, table
    step = eqx.filter_jit(lambda m, x, y, r, s: grad_fn(m, x, y, step=s, residual=r))
    for s in range(2):
        value, grads, residual = step(model, x, y, residual, jnp.int32(s))
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    assert jax.tree.structure(residual) == jax.tree.structure(want)
    # (in numpy: the two arrays may live on different meshes)
    weight, expected = np.asarray(grads.layers[1].weight), np.asarray(want.layers[1].weight)
    assert not np.array_equal(weight, expected)  # compressed...
    assert np.linalg.norm(weight - expected) < 0.05 * np.linalg.norm(expected)  # ...8 bits


def test_nnx_module_gradients_have_the_type_nnx_value_and_grad_gives(cpu_devices):
    """An NNX module with Dropout, BatchNorm and an nnx.List: the gradient is what
    nnx.value_and_grad (the call NNX users replace) returns, an nnx.State of the module's
    Params with the same structure and attribute access (grads.layers[0].kernel). The
    Module type jax.value_and_grad would give is not on offer: jax.grad refuses such a
    module (its RNG counts are integers)."""
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)])
            self.norm = nnx.BatchNorm(32, use_running_average=True, rngs=rngs)
            self.drop = nnx.Dropout(0.0, rngs=rngs)

        def __call__(self, x):
            return self.layers[1](self.drop(self.norm(self.layers[0](x))))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    mesh = jax.make_mesh((8,), ("batch",), devices=cpu_devices[:8])
    model, x = Net(nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (16, 16))
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
        jax.grad(loss)(model, x)
    want_value, want = nnx.value_and_grad(loss)(model, x)
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="batch", policy=EXACT)
    with jax.set_mesh(mesh):
        value, grads = nnx.jit(grad_fn)(model, x)
    assert type(grads) is type(want)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    assert grads.layers[0].kernel.shape == (16, 32)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("given_specs", [False, True], ids=["partitioner", "param_specs"])
def test_each_model_shard_of_a_gradient_draws_its_own_noise(cpu_devices, given_specs):
    """A weight whose two column halves over 'model' are equal has a gradient with equal
    halves; 4-bit stochastic rounding must still give them different noise (each distinct
    shard its own), whether the layout comes from param_specs or from XLA's partitioner, so
    the mean's halves differ, each within the codec's bound of the exact gradient."""
    mesh = mesh_4x2(cpu_devices, AxisType.Auto)
    half = jax.random.normal(jax.random.key(3), (64, 128)) / 8
    w = jax.device_put(jnp.concatenate([half, half], 1), NamedSharding(mesh, P(None, "model")))
    x = jax.device_put(jax.random.normal(jax.random.key(4), (32, 64)),
                       NamedSharding(mesh, P("batch")))
    loss = lambda w, x: jnp.mean((x @ w) ** 2)  # noqa: E731
    four_bits = cgx.LayerPolicy(default=cgx.Codec(bits=4, bucket_size=128), min_size=1)
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="batch", policy=four_bits,
                                 param_specs=P(None, "model") if given_specs else None)
    with jax.set_mesh(mesh):
        _, g = jax.jit(lambda w, x: grad_fn(w, x, step=jnp.int32(5)))(w, x)
    assert g.sharding.is_equivalent_to(w.sharding, 2)
    want = np.asarray(jax.grad(loss)(*jax.device_get((w, x))))
    got = np.asarray(g)
    np.testing.assert_array_equal(want[:, :128], want[:, 128:])
    assert not np.array_equal(got[:, :128], got[:, 128:])
    assert np.linalg.norm(got - want) <= 0.25 * np.linalg.norm(want)
