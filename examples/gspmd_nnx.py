"""A Flax NNX model trained the GSPMD way (``nnx.jit``, ``nnx.Optimizer``, weights sharded over
a ``'model'`` mesh axis, batches over ``'data'``), exact and with cgx compressed gradients.

The model follows the shape of Flax's "Scale up on multiple devices" guide: blocks of two
matrices sharded over ``'model'`` (the first by columns, the second by rows), stacked with
``nnx.vmap`` and applied with ``nnx.scan``. The cgx version of the training step differs from
the exact one in the lines marked ``# cgx``: the loss takes the batch as arguments (so it can
be split over ``'data'``), the gradient comes from ``cgx.value_and_grad``, and the model's
sharding constraint no longer names ``'data'`` (each participant holds only its rows)::

    python examples/gspmd_nnx.py                    # 8x1 and 2x4: exact, cgx, cgx-ef
    python examples/gspmd_nnx.py --meshes 2x4 --seeds 0 1 2

``cgx-ef`` adds error feedback: the step takes the residual (``cgx.init_residual``) and
returns the new one.

On a CPU the 8 devices are simulated (``--xla_force_host_platform_device_count``), so
ms/step is compute, not network time.
"""

from __future__ import annotations

import argparse
import os
import time

if "--help" not in os.sys.argv and "-h" not in os.sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402


class Block(nnx.Module):
    """relu(x @ up) @ down, ``up`` sharded by columns and ``down`` by rows over 'model'."""

    def __init__(self, width: int, data_axis, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(width, width, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, (None, "model")))
        self.down = nnx.Param(init(rngs.params(), (width, width)),
                              out_sharding=("model", None))
        self.data_axis = data_axis

    def __call__(self, x):
        hidden = jax.nn.relu(self.up(x))
        hidden = jax.lax.with_sharding_constraint(hidden, P(self.data_axis, "model"))
        return hidden @ self.down[...]


class Stack(nnx.Module):
    """``depth`` blocks made with ``nnx.vmap`` and applied in sequence with ``nnx.scan``."""

    def __init__(self, width: int, depth: int, data_axis, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(rngs):
            return Block(width, data_axis, rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                  transform_metadata={nnx.PARTITION_NAME: None})
        def apply(block, x):
            return block(x)

        return apply(self.blocks, x)


def make_model(mesh, width: int, depth: int, data_axis, seed: int = 0):
    """The model created sharded on ``mesh`` as its annotations say."""
    with jax.set_mesh(mesh):
        @nnx.jit
        def create():
            model = Stack(width, depth, data_axis, nnx.Rngs(seed))
            state = nnx.state(model)
            nnx.update(model, jax.lax.with_sharding_constraint(
                state, nnx.get_partition_spec(state)))
            return model

        model = create()
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def exact_step_fn():
    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return train_step


def cgx_step_fn(mesh, seed: int = 0):
    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model, x, y):  # cgx: the batch as arguments
            return jnp.mean((model(x) - y) ** 2)

        grad_fn = cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="data",  # cgx
                                     key=jax.random.key(seed))
        loss, grads = grad_fn(model, x, y, step=optimizer.step[...])
        optimizer.update(model, grads)
        return loss

    return train_step


def cgx_error_feedback_step_fn(mesh, seed: int = 0):
    """The cgx step with error feedback: the residual (what each participant's compression
    lost, one row per participant, sharded like its parameter) goes in and comes back."""
    @nnx.jit
    def train_step(model, optimizer, residual, x, y):
        def loss_fn(model, x, y):
            return jnp.mean((model(x) - y) ** 2)

        grad_fn = cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="data",
                                     error_feedback=True, key=jax.random.key(seed))
        loss, grads, residual = grad_fn(model, x, y, step=optimizer.step[...],
                                        residual=residual)
        optimizer.update(model, grads)
        return loss, residual

    return train_step


def run(mesh_shape, mode: str, steps: int, width: int, depth: int, batch: int,
        seed: int = 0) -> dict:
    """Trains one model; ``seed`` sets its initial weights, its batches and cgx's noise."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    # cgx: the constraint names 'model' only (P(None, 'model') instead of P('data', 'model'))
    model, optimizer = make_model(mesh, width, depth, "data" if mode == "exact" else None,
                                  seed)
    rows = NamedSharding(mesh, P("data", None))
    if mode == "cgx-ef":
        residual = cgx.init_residual(model, mesh=mesh, axis_name="data")
        ef_step = cgx_error_feedback_step_fn(mesh, seed)

        def train_step(model, optimizer, x, y):
            nonlocal residual
            loss, residual = ef_step(model, optimizer, residual, x, y)
            return loss
    else:
        train_step = cgx_step_fn(mesh, seed) if mode == "cgx" else exact_step_fn()
    test_x, test_y = teacher_batch(width, 1024, seed=10**6)  # never a training batch
    times = []
    with jax.set_mesh(mesh):
        for step in range(steps):
            batch_xy = teacher_batch(width, batch, seed=seed * 10**5 + step)
            x, y = (jax.device_put(a, rows) for a in batch_xy)
            start = time.perf_counter()
            float(train_step(model, optimizer, x, y))
            times.append(time.perf_counter() - start)
        test_loss = float(jnp.mean((model(test_x) - test_y) ** 2))
    steady = sorted(times[2:]) or times
    return dict(mesh="x".join(map(str, mesh_shape)), mode=mode, steps=steps, seed=seed,
                test_loss=test_loss, ms=1e3 * steady[len(steady) // 2])


def teacher_batch(width: int, rows: int, seed: int):
    """Fresh inputs and the targets of a fixed random teacher block (the same for every run;
    targets of unit variance), so the loss on held-out inputs measures learning, not
    memorising: it starts near 1 and the student (two such blocks) learns half of it."""
    k1, k2 = jax.random.split(jax.random.key(1234))
    first = jax.random.normal(k1, (width, width)) * jnp.sqrt(2 / width)
    second = jax.random.normal(k2, (width, width)) / jnp.sqrt(width)
    x = jax.random.normal(jax.random.fold_in(jax.random.key(7), seed), (rows, width))
    return x, jax.nn.relu(x @ first) @ second


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", default=["8x1", "2x4"],
                        help="data x model mesh shapes (default: 8x1 2x4)")
    parser.add_argument("--modes", nargs="+", default=["exact", "cgx", "cgx-ef"],
                        choices=("exact", "cgx", "cgx-ef"),
                        help="exact GSPMD, cgx 4-bit defaults, cgx with error feedback")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="rows per step, all devices")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="one run per seed (initial weights, batches, cgx noise)")
    args = parser.parse_args(argv)
    print(f"{'mesh':<5} {'mode':<7} {'seed':>4} {'steps':>5} {'test loss':>10} {'ms/step':>8}")
    results = []
    for shape in args.meshes:
        mesh_shape = tuple(int(n) for n in shape.split("x"))
        for mode, seed in ((mode, seed) for seed in args.seeds for mode in args.modes):
            r = run(mesh_shape, mode, args.steps, args.width, args.depth, args.batch, seed)
            results.append(r)
            print(f"{r['mesh']:<5} {r['mode']:<7} {r['seed']:>4} {r['steps']:>5} "
                  f"{r['test_loss']:>10.6f} {r['ms']:>8.1f}", flush=True)
    return results


if __name__ == "__main__":
    main()
