"""Third-party-style GSPMD FSDP training, as a Flax NNX tutorial writes it, for
tests/test_fsdp.py: a 128-2048-128 MLP whose kernels are annotated ``('fsdp', None)`` (biases
replicated), a hand-written momentum SGD whose state is sharded like the parameters, an
``nnx.jit`` step. ``step_fn(..., use_cgx=True)`` is the one-line port: the three lines marked
``# cgx`` differ (the loss takes the batch as arguments, the gradient comes from
``cgx.value_and_grad``, the step counter is passed)."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import cgx_jax as cgx


class MLP(nnx.Module):
    def __init__(self, din, dmid, dout, *, rngs, kernel_axes=("fsdp", None)):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, kernel_axes))
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, kernel_axes))

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def make_model(mesh, seed=0, sizes=(128, 2048, 128), kernel_axes=("fsdp", None), cls=MLP):
    """The model (``cls``, an ``MLP``) created sharded as its annotations say, and its
    momentum (zeros, sharded like the parameters)."""
    with jax.set_mesh(mesh):
        @nnx.jit
        def create():
            model = cls(*sizes, rngs=nnx.Rngs(seed), kernel_axes=kernel_axes)
            state = nnx.state(model)
            nnx.update(model, jax.lax.with_sharding_constraint(
                state, nnx.get_partition_spec(state)))
            return model

        model = create()
    params = nnx.state(model, nnx.Param)
    momentum = jax.tree.map(lambda p: jax.device_put(jnp.zeros(p.shape, p.dtype), p.sharding),
                            params)
    return model, momentum


def step_fn(mesh, use_cgx: bool, lr=0.05, beta=0.9, **cgx_options):
    @nnx.jit
    def train_step(model, momentum, x, y, step):
        def loss_fn(model, x, y):  # cgx: the batch as arguments
            return jnp.mean((model(x) - y) ** 2)

        if use_cgx:
            loss, grads = cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="fsdp",  # cgx
                                             **cgx_options)(model, x, y, step=step)  # cgx
        else:
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        params = nnx.state(model, nnx.Param)
        momentum = jax.tree.map(lambda m, g: beta * m + g, momentum, grads)
        nnx.update(model, jax.tree.map(lambda p, m: p - lr * m, params, momentum))
        return loss, momentum

    return train_step


def batch(mesh, step, rows=192, din=128, dout=128):
    """Inputs and the targets of a fixed random teacher, rows split over 'fsdp'."""
    kx = jax.random.fold_in(jax.random.key(1), step)
    teacher = jax.random.normal(jax.random.key(2), (din, dout)) / jnp.sqrt(din)
    x = jax.random.normal(kx, (rows, din))
    y = jnp.tanh(x @ teacher)
    rows_spec = NamedSharding(mesh, P("fsdp", None))
    return jax.device_put(x, rows_spec), jax.device_put(y, rows_spec)


def train(mesh, use_cgx: bool, steps: int, seed=0, **cgx_options):
    """Losses of ``steps`` steps, and the model and momentum after them."""
    model, momentum = make_model(mesh, seed)
    train_step = step_fn(mesh, use_cgx, **cgx_options)
    losses = []
    with jax.set_mesh(mesh):
        for step in range(steps):
            x, y = batch(mesh, step)
            loss, momentum = train_step(model, momentum, x, y, jnp.int32(step))
            losses.append(float(loss))
    return losses, model, momentum
