"""cgx_jax._src.vma and the data-parallel styles (docs/design.md section 6): ``pmap``,
``jax.shard_map`` with ``check_vma`` on and off, and Flax ``nnx.shard_map``; for each,
``compressed_pmean`` and the Optax transform (with and without error feedback) give the mean
of the local gradients (not N times it), already-reduced gradients are refused where JAX can
tell, and the compiled step holds no exact all-reduce of a compressed leaf."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import cpu_mesh
from jax.sharding import PartitionSpec as P
from models import NUM_DEVICES, init_params, loss_fn, teacher_data

import cgx_jax as cgx

AXIS = "batch"
# 8-bit nearest rounding: the reduced mean is within 1% of the exact one, an N-fold scale is not.
POLICY = cgx.LayerPolicy(default=cgx.Codec(bits=8, bucket_size=256, rounding="nearest"),
                         min_size=256)
STYLES = ("pmap", "shard_map", "shard_map_unchecked")
REDUCERS = ("compressed_pmean", "transform", "transform_error_feedback")
STEPS = 3


def reduce_fn(reducer):
    """(init(params) -> state, reduce(grads, state) -> (mean grads, state)) for one reducer."""
    if reducer == "compressed_pmean":
        return (lambda params: (), lambda g, s: (cgx.compressed_pmean(g, AXIS, policy=POLICY), s))
    tx = cgx.compressed_allreduce(AXIS, policy=POLICY,
                                  error_feedback=reducer == "transform_error_feedback")
    return tx.init, lambda g, s: tx.update(g, s)


def exact_local_mean(x, y, params):
    """The exact mean over participants of the local gradients, on one device."""
    grads = [jax.grad(loss_fn)(params, x[i], y[i]) for i in range(NUM_DEVICES)]
    return jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *grads)


def run(style, reducer, local=True):
    """STEPS steps of 'reduce the gradients of fixed params'; returns the last reduced means."""
    x, y = teacher_data()
    params = init_params()
    init, reduce = reduce_fn(reducer)
    grad_fn = (cgx.local_value_and_grad(loss_fn, AXIS) if local
               else jax.value_and_grad(loss_fn))

    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y)
        return reduce(grads, state)

    state = init(params)
    if style == "pmap":
        f = jax.pmap(lambda p, s, x, y: step(p, s, x, y), axis_name=AXIS,
                     devices=jax.devices("cpu")[:NUM_DEVICES])  # also on a 1-GPU machine
        replicate = lambda t: jax.tree.map(lambda v: jnp.stack([v] * NUM_DEVICES), t)  # noqa
        params_in, state = replicate(params), replicate(state)
        for _ in range(STEPS):
            means, state = f(params_in, state, x, y)
        return jax.tree.map(lambda v: np.asarray(v[0]), means), state
    mesh = cpu_mesh(NUM_DEVICES, (AXIS,))
    specs = cgx.state_specs(state, AXIS)
    f = jax.jit(jax.shard_map(
        lambda p, s, x, y: step(p, s, x[0], y[0]), mesh=mesh,
        in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs),
        check_vma=style == "shard_map"))
    state = cgx.shard_state(state, mesh, AXIS)
    for _ in range(STEPS):
        means, state = f(params, state, x, y)
    return jax.tree.map(np.asarray, means), state


def assert_mean_of_local_gradients(got, want):
    for name in ("dense1", "dense2"):
        for leaf in ("kernel", "bias"):
            g, w = got[name][leaf], want[name][leaf]
            assert g.shape == w.shape
            ratio = np.linalg.norm(g) / np.linalg.norm(w)
            assert abs(ratio - 1) < 0.01, (name, leaf, ratio)  # an N-fold sum gives ratio 8
            np.testing.assert_allclose(g, w, atol=0.02 * np.max(np.abs(w)))


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("reducer", REDUCERS)
def test_local_gradients_reduce_to_their_mean(style, reducer):
    x, y = teacher_data()
    got, _ = run(style, reducer)
    want = exact_local_mean(x, y, init_params())
    if reducer == "transform_error_feedback":
        # The residual feeds back, so step 3 reduces g + r: compare with a wider margin.
        for name in ("dense1", "dense2"):
            ratio = (np.linalg.norm(got[name]["kernel"])
                     / np.linalg.norm(want[name]["kernel"]))
            assert abs(ratio - 1) < 0.05, (name, ratio)
        return
    assert_mean_of_local_gradients(got, want)


@pytest.mark.parametrize("reducer", REDUCERS)
def test_already_reduced_gradients_are_refused_under_check_vma(reducer):
    with pytest.raises(ValueError, match=r"(?s)typed invariant over mesh axes \('batch',\).*"
                                         r"count it 8 times.*local_value_and_grad"):
        run("shard_map", reducer, local=False)


@pytest.mark.parametrize("style", ("pmap", "shard_map_unchecked"))
def test_plain_grad_is_local_where_nothing_is_typed(style):
    # pmap and check_vma=False insert no reduction in jax.grad: plain gradients are local,
    # nothing is refused, and the mean is right.
    x, y = teacher_data()
    got, _ = run(style, "compressed_pmean", local=False)
    assert_mean_of_local_gradients(got, exact_local_mean(x, y, init_params()))


def test_refusal_names_the_leaf_and_covers_the_inner_axis():
    mesh = cpu_mesh(8, ("outer", "inner"), shape=(4, 2))
    codec = cgx.Codec(bits=8, bucket_size=256, rounding="nearest")

    def f(w, x):  # varying over "outer" only: invariant over the inner axis
        w = jax.lax.pcast(w, "outer", to="varying")
        return cgx.compressed_psum({"w": w * x[0]}, "outer", codec=codec,
                                   inner_axis_name="inner")["w"]

    g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("outer")), out_specs=P())
    with pytest.raises(ValueError, match=r"leaf 'w' typed invariant over mesh axes \('inner',\)"):
        g(jnp.ones(256), jnp.ones((4, 256)))


def compiled_all_reduce_sizes(style, local):
    x, y = teacher_data()
    params = init_params()
    tx = cgx.compressed_allreduce(AXIS, policy=POLICY)
    grad_fn = cgx.local_value_and_grad(loss_fn, AXIS) if local else jax.value_and_grad(loss_fn)

    def step(p, s, x, y):
        _, g = grad_fn(p, x[0], y[0])
        return tx.update(g, s)

    mesh = cpu_mesh(NUM_DEVICES, (AXIS,))
    state = tx.init(params)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                              out_specs=(P(), P()), check_vma=style == "shard_map"))
    hlo = f.lower(params, state, x, y).compile().as_text()
    sizes = []
    for line in hlo.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            for dims in re.findall(r"f32\[([\d,]*)\]", line.split("=", 1)[0]):
                sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


@pytest.mark.parametrize("style", ("shard_map", "shard_map_unchecked"))
def test_compiled_step_has_no_exact_all_reduce_of_a_compressed_leaf(style):
    # The compressed kernels have 2048 and 1024 values; the exact leaves (biases) 64 and 16.
    sizes = compiled_all_reduce_sizes(style, local=True)
    assert all(size < 1024 for size in sizes), sizes


def test_hlo_check_sees_the_double_reduction_it_guards_against():
    # check_vma=False with params cast to varying by hand is not needed: with jax.grad of
    # replicated params under check_vma=True, JAX's own reduction is in the HLO, so the
    # check above can fail; here the refusal stops it first, so look at the gradient alone.
    x, y = teacher_data()
    mesh = cpu_mesh(NUM_DEVICES, (AXIS,))
    f = jax.jit(jax.shard_map(lambda p, x, y: jax.grad(loss_fn)(p, x[0], y[0]), mesh=mesh,
                              in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P()))
    hlo = f.lower(init_params(), x, y).compile().as_text()
    assert re.search(r"f32\[32,64\][^\n]* all-reduce", hlo)


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(32, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.dense2(jnp.tanh(self.dense1(x)))


def nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("local", (True, False))
def test_nnx_shard_map(local):
    x, y = teacher_data()
    model = Mlp(nnx.Rngs(0))
    mesh = cpu_mesh(NUM_DEVICES, (AXIS,))
    grad_fn = (cgx.local_value_and_grad(nnx_loss, AXIS) if local
               else nnx.value_and_grad(nnx_loss))

    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P())
    def reduced_grads(model, x, y):
        _, grads = grad_fn(model, x[0], y[0])
        return cgx.compressed_pmean(grads, AXIS, policy=POLICY)

    if not local:
        with pytest.raises(ValueError, match="typed invariant"):
            reduced_grads(model, x, y)
        return
    got = reduced_grads(model, x, y)
    assert isinstance(got, nnx.State)
    local_grads = [nnx.grad(nnx_loss)(model, x[i], y[i]) for i in range(NUM_DEVICES)]
    want = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *local_grads)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        ratio = np.linalg.norm(np.asarray(g)) / np.linalg.norm(w)
        assert abs(ratio - 1) < 0.01, ratio
    # The model passed in is unchanged (the helper differentiated a varying copy).
    assert jax.typeof(model.dense1.kernel[...]).shape == (32, 64)


@pytest.mark.parametrize("error_feedback", (False, True))
def test_nnx_shard_map_with_the_transform(error_feedback):
    x, y = teacher_data()
    model = Mlp(nnx.Rngs(0))
    mesh = cpu_mesh(NUM_DEVICES, (AXIS,))
    tx = cgx.compressed_allreduce(AXIS, policy=POLICY, error_feedback=error_feedback)
    state = cgx.shard_state(tx.init(nnx.state(model, nnx.Param)), mesh, AXIS)
    specs = cgx.state_specs(state, AXIS)

    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs))
    def reduced_grads(model, state, x, y):
        _, grads = cgx.local_value_and_grad(nnx_loss, AXIS)(model, x[0], y[0])
        return tx.update(grads, state)

    got, state = reduced_grads(model, state, x, y)
    local_grads = [nnx.grad(nnx_loss)(model, x[i], y[i]) for i in range(NUM_DEVICES)]
    want = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *local_grads)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        ratio = np.linalg.norm(np.asarray(g)) / np.linalg.norm(w)
        assert abs(ratio - 1) < 0.01, ratio
    if error_feedback:
        residual = jax.tree.leaves(state.residual)[0]
        assert residual.shape[0] == NUM_DEVICES and not residual.is_fully_replicated
