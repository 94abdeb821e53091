"""What the jit and NNX entry points leave behind besides the gradients (docs/design.md
section 6): replicas that stay identical on a 2-D mesh (each distinct shard drawing its own
noise), and an NNX module's other state (RNG streams, BatchNorm statistics) advanced as
``nnx.value_and_grad`` over the global batch would advance it, under ``cgx.value_and_grad``
(jit) and ``cgx.local_value_and_grad`` (``nnx.shard_map``, ``pmap``)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import cgx_jax as cgx

AUTO = (AxisType.Auto, AxisType.Auto)
FOUR_BITS = cgx.LayerPolicy(min_size=1024)  # 4-bit stochastic buckets of 1024


def mesh_of(cpu_devices, shape):
    if len(shape) == 1:
        return jax.make_mesh(shape, ("data",), axis_types=(AxisType.Auto,),
                             devices=cpu_devices[:8])
    return jax.make_mesh(shape, ("data", "model"), axis_types=AUTO, devices=cpu_devices[:8])


def buffers_by_shard(array):
    """{shard index: [the buffer of every device holding that shard]}."""
    shards = {}
    for shard in array.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        shards.setdefault(key, []).append(np.asarray(shard.data))
    return shards


# ---------------------------------------------------------------------------
# A. Replicas identical, distinct shards with their own noise
# ---------------------------------------------------------------------------

def column_constant_loss(params, x):
    """w's exact gradient is the same in every column (so in every 'model' shard of it);
    v's is a dense matrix."""
    return jnp.mean(x @ params["w"]) + jnp.mean((x @ params["v"]) ** 2)


@pytest.mark.parametrize("error_feedback", (False, True), ids=("plain", "error_feedback"))
@pytest.mark.parametrize("shape", ((2, 4), (8,)), ids=("2x4", "8"))
def test_replicas_identical_and_every_shard_its_own_noise(cpu_devices, shape, error_feedback):
    mesh = mesh_of(cpu_devices, shape)
    w_spec = P(None, "model") if len(shape) == 2 else P()
    specs = {"w": w_spec, "v": P()}
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.device_put(jax.random.normal(k[0], (128, 128)), NamedSharding(mesh, w_spec)),
              "v": jax.device_put(jax.random.normal(k[1], (128, 128)) / 8,
                                  NamedSharding(mesh, P()))}
    x = jax.device_put(jax.random.normal(k[2], (32, 128)), NamedSharding(mesh, P("data")))
    grad_fn = cgx.value_and_grad(column_constant_loss, mesh=mesh, axis_name="data",
                                 policy=FOUR_BITS, param_specs=specs,
                                 error_feedback=error_feedback)
    step = jax.jit(grad_fn)
    extra = {"residual": cgx.init_residual(params, mesh=mesh, axis_name="data",
                                           param_specs=specs, policy=grad_fn)
             } if error_feedback else {}
    _, exact = jax.value_and_grad(column_constant_loss)(params, x)
    for number in range(2):
        out = step(params, x, step=jnp.int32(number), **extra)
        grads = out[1]
        if error_feedback:
            extra["residual"] = out[2]
        for name in ("w", "v"):
            assert grads[name].sharding.is_equivalent_to(NamedSharding(mesh, specs[name]), 2)
            shards = buffers_by_shard(grads[name])
            for index, copies in shards.items():  # every replica of a shard: the same bytes
                for copy in copies[1:]:
                    np.testing.assert_array_equal(copy, copies[0], err_msg=f"{name} {index}")
            got, want = np.asarray(grads[name]), np.asarray(exact[name])
            assert np.linalg.norm(got - want) < 0.4 * np.linalg.norm(want), name
        if len(shape) == 2:  # four equal exact shards, four different roundings
            distinct = [copies[0] for copies in buffers_by_shard(grads["w"]).values()]
            assert len(distinct) == 4
            for i in range(4):
                for j in range(i):
                    assert not np.array_equal(distinct[i], distinct[j]), (i, j)
    if len(shape) == 2 and not error_feedback:
        # Each device encodes its own shard: only u8 packets are gathered, over 'data' (2).
        hlo = step.lower(params, x, step=jnp.int32(0)).compile().as_text()
        gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
        assert gathers and all(re.search(r"= u8\[2,", line) for line in gathers), gathers


# ---------------------------------------------------------------------------
# B. NNX state: RNG streams, dropout masks, batch statistics
# ---------------------------------------------------------------------------

class DropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.ones((x.shape[0], 64))) * self.linear(x)


def dropout_loss(model, x):
    y = model(x)
    mask = model.drop(jnp.ones_like(y))  # a second draw, returned to be looked at
    return jnp.mean(y ** 2), mask


class BatchNormNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def bn_loss(model, x):
    return jnp.mean(model(x) ** 2)


def batch(rows=64, seed=1, shift=True):
    x = np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)
    if shift:  # rows differ in mean between participants, so local and global stats differ
        x += np.repeat(np.arange(8, dtype=np.float32), rows // 8)[:, None] / 4
    return jnp.asarray(x)


def expected_statistics(model, x, participants):
    """numpy: the running mean and variance after one step whose statistics are averaged over
    ``participants`` equal shards of ``x`` (the mean is then the global batch's)."""
    h = np.asarray(x) @ np.asarray(model.linear.kernel[...]) + np.asarray(model.linear.bias[...])
    shards = np.split(h.astype(np.float64), participants)
    mean = np.mean([s.mean(0) for s in shards], axis=0)
    var = np.mean([s.var(0) for s in shards], axis=0)
    return 0.1 * mean, 0.9 + 0.1 * var  # from mean 0, var 1


def cgx_step(mesh, error_feedback, has_aux=False, loss=bn_loss):
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="data", policy=FOUR_BITS,
                                 error_feedback=error_feedback, has_aux=has_aux)
    if not error_feedback:
        return nnx.jit(lambda m, x, s: grad_fn(m, x, step=s)[:2])

    def run(model, x, step):
        residual = cgx.init_residual(model, mesh=mesh, axis_name="data", policy=grad_fn)
        return nnx.jit(lambda m, x, s, r: grad_fn(m, x, step=s, residual=r)[:2])(
            model, x, step, residual)
    return run


@pytest.mark.parametrize("error_feedback", (False, True), ids=("plain", "error_feedback"))
@pytest.mark.parametrize("shape", ((8,), (2, 4)), ids=("8", "2x4"))
def test_batch_statistics_are_the_global_batchs(cpu_devices, shape, error_feedback):
    mesh = mesh_of(cpu_devices, shape)
    x = batch()
    model, reference = BatchNormNet(nnx.Rngs(0)), BatchNormNet(nnx.Rngs(0))
    want_mean, want_var = expected_statistics(model, x, shape[0])
    with jax.set_mesh(mesh):
        cgx_step(mesh, error_feedback)(model, x, jnp.int32(0))
    nnx.value_and_grad(bn_loss)(reference, x)  # GSPMD's: one global batch
    for stat in (model.norm.mean[...], model.norm.var[...]):
        assert stat.sharding.is_fully_replicated
        copies = [np.asarray(s.data) for s in stat.addressable_shards]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    # The mean over equal shards is the global batch's mean: nnx.value_and_grad's.
    np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norm.mean[...], want_mean, rtol=1e-4, atol=1e-6)
    # The variance is the mean of the participants' (no cross-participant term).
    np.testing.assert_allclose(model.norm.var[...], want_var, rtol=1e-4, atol=1e-6)
    assert not np.allclose(model.norm.var[...], reference.norm.var[...], rtol=1e-3)


class FSDPNet(nnx.Module):
    """BatchNormNet with its kernel sharded over 'data' (FSDP) and a dropout after it."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
        self.linear = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
        self.norm = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.linear(x)))


def test_fsdp_modules_write_back_their_batch_statistics_and_rng_counts(cpu_devices):
    """Under FSDP (the kernel gathered inside the loss) the module's other state is written
    back from the gathered module: BatchNorm's running statistics as for data parallelism,
    the dropout stream advanced as nnx.value_and_grad advances it."""
    mesh = mesh_of(cpu_devices, (8,))
    x = batch()
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: FSDPNet(nnx.Rngs(0)))()
        nnx.update(model, jax.device_put(nnx.state(model), nnx.get_named_sharding(
            nnx.state(model), mesh)))
        reference = nnx.jit(lambda: FSDPNet(nnx.Rngs(0)))()
        _, grads = cgx_step(mesh, False)(model, x, jnp.int32(0))
        nnx.value_and_grad(bn_loss)(reference, x)  # GSPMD's: one global batch
    spec = model.linear.kernel[...].sharding.spec
    assert spec[0] == "data" and grads["linear"]["kernel"][...].sharding.spec[0] == "data"
    want_mean, want_var = expected_statistics(reference, x, 8)
    np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(model.norm.var[...], want_var, rtol=1e-4, atol=1e-6)
    assert np.any(np.asarray(want_mean) != 0)
    assert int(model.drop.rngs.count[...]) == int(reference.drop.rngs.count[...]) == 1


@pytest.mark.parametrize("error_feedback", (False, True), ids=("plain", "error_feedback"))
@pytest.mark.parametrize("shape", ((8,), (2, 4)), ids=("8", "2x4"))
def test_dropout_advances_and_differs_between_participants(cpu_devices, shape, error_feedback):
    mesh = mesh_of(cpu_devices, shape)
    participants = shape[0]
    x = batch(shift=False)
    model, reference = DropoutNet(nnx.Rngs(0)), DropoutNet(nnx.Rngs(0))
    step = cgx_step(mesh, error_feedback, has_aux=True, loss=dropout_loss)
    losses, masks = [], []
    with jax.set_mesh(mesh):
        for number in range(3):
            (loss, mask), _ = step(model, x, jnp.int32(number))
            losses.append(float(loss))
            masks.append(np.asarray(mask))
    for _ in range(3):
        nnx.value_and_grad(dropout_loss, has_aux=True)(reference, x)
    # Two draws per call, as nnx.value_and_grad's.
    assert int(model.drop.rngs.count[...]) == int(reference.drop.rngs.count[...]) == 6
    assert len(set(losses)) == 3, losses
    # aux is averaged over participants: equal masks would average to 0 or 2 everywhere.
    for mask in masks:
        assert mask.shape == (x.shape[0] // participants, 64)
        mixed = np.mean((mask != 0) & (mask != 2))
        assert mixed > 0.3, mixed
        assert abs(mask.mean() - 1) < 0.1
    assert not np.array_equal(masks[0], masks[1])


# ---------------------------------------------------------------------------
# local_value_and_grad in nnx.shard_map and pmap
# ---------------------------------------------------------------------------

def test_local_value_and_grad_in_shard_map_carries_state_back(cpu_devices):
    mesh = mesh_of(cpu_devices, (8,))
    x = batch()
    model, reference = BatchNormNet(nnx.Rngs(0)), BatchNormNet(nnx.Rngs(0))
    model.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))
    want_mean, want_var = expected_statistics(model, x, 8)

    def loss(model, x):
        return bn_loss(model, x), model.drop(jnp.ones((x.shape[0], 64)))

    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
    def step(model, x):
        (_, mask), grads = cgx.local_value_and_grad(loss, "data", has_aux=True)(model, x)
        return cgx.compressed_pmean(grads, "data", codec=cgx.Codec(rounding="nearest")), mask

    _, masks = step(model, x)
    nnx.value_and_grad(bn_loss)(reference, x)
    np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.norm.var[...], want_var, rtol=1e-4, atol=1e-6)
    assert int(model.drop.rngs.count[...]) == 1
    rows = np.asarray(masks).reshape(8, -1)
    assert len({row.tobytes() for row in rows}) == 8  # each participant its own mask


def test_local_value_and_grad_in_pmap_averages_statistics(cpu_devices):
    x = batch().reshape(8, 8, 16)
    model, reference = BatchNormNet(nnx.Rngs(0)), BatchNormNet(nnx.Rngs(0))
    graph, state = nnx.split(model)

    @functools.partial(jax.pmap, axis_name="data", in_axes=(None, 0), devices=cpu_devices[:8])
    def step(state, x):
        model = nnx.merge(graph, state)
        cgx.local_value_and_grad(bn_loss, "data")(model, x)
        return nnx.state(model)

    after = step(state, x)
    nnx.value_and_grad(bn_loss)(reference, x.reshape(64, 16))
    means = np.asarray(after["norm"]["mean"][...])
    for row in means[1:]:  # every device the same statistics
        np.testing.assert_array_equal(row, means[0])
    np.testing.assert_allclose(means[0], reference.norm.mean[...], rtol=1e-5, atol=1e-6)
    assert np.asarray(after["norm"]["var"][...]).shape == (8, 64)


class Counter(nnx.Variable):
    pass


class CountingNet(BatchNormNet):
    def __init__(self, rngs):
        super().__init__(rngs)
        self.positives = Counter(jnp.int32(0))

    def __call__(self, x):
        self.positives[...] = jnp.sum(x > 0).astype(jnp.int32)
        return super().__call__(x)


def test_integer_state_that_differs_between_participants_is_refused(cpu_devices):
    mesh = mesh_of(cpu_devices, (8,))

    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    def step(model, x):
        _, grads = cgx.local_value_and_grad(bn_loss, "data")(model, x)
        return cgx.compressed_pmean(grads, "data", codec=cgx.Codec(rounding="nearest"))

    with pytest.raises(ValueError, match=r"variable \['positives'\].*int32.*'data'"):
        step(CountingNet(nnx.Rngs(0)), batch())
