"""Per-device memory of one FSDP training step, from the compiled program's
``memory_analysis()`` (docs/performance.md, "FSDP through cgx.value_and_grad"): a Flax NNX
model of 8 layers of 1024x1024 on 8 simulated CPU devices, its kernels sharded over 'fsdp'
(FSDP) or replicated (data parallelism), the step's gradient from ``nnx.value_and_grad``
(GSPMD) or ``cgx.value_and_grad``; the step updates the parameters in place (donated).

    python tools/fsdp_memory.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402


class Deep(nnx.Module):
    def __init__(self, width, depth, kernel_axes, rngs):
        init = nnx.initializers.lecun_normal()
        self.layers = nnx.List([
            nnx.Linear(width, width, rngs=rngs,
                       kernel_init=nnx.with_partitioning(init, kernel_axes))
            for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def step_memory(mesh, kernel_axes, use_cgx, width=1024, depth=8, rows=256):
    """(temporaries, arguments) in MiB per device of the compiled step."""
    with jax.set_mesh(mesh):
        @nnx.jit
        def create():
            model = Deep(width, depth, kernel_axes, nnx.Rngs(0))
            state = nnx.state(model)
            nnx.update(model, jax.lax.with_sharding_constraint(
                state, nnx.get_partition_spec(state)))
            return model

        graph, state = nnx.split(create())

        def loss_fn(model, x, y):
            return jnp.mean((model(x) - y) ** 2)

        def step(state, x, y, i):
            model = nnx.merge(graph, state)
            if use_cgx:
                grad_fn = cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="fsdp")
                loss, grads = grad_fn(model, x, y, step=i)
            else:
                loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads))
            return loss, nnx.state(model)

        x = jax.device_put(jnp.ones((rows, width)), NamedSharding(mesh, P("fsdp", None)))
        compiled = jax.jit(step, donate_argnums=0).lower(state, x, x, jnp.int32(0)).compile()
    memory = compiled.memory_analysis()
    return memory.temp_size_in_bytes / 2**20, memory.argument_size_in_bytes / 2**20


def main():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    print(f"{'step':<32} {'temporaries':>11} {'arguments':>9} {'sum':>7}  (MiB per device)")
    for name, axes, use_cgx in [("GSPMD FSDP (nnx.value_and_grad)", ("fsdp", None), False),
                                ("cgx FSDP (cgx.value_and_grad)", ("fsdp", None), True),
                                ("GSPMD data parallel", (None, None), False),
                                ("cgx data parallel", (None, None), True)]:
        temp, args = step_memory(mesh, axes, use_cgx)
        print(f"{name:<32} {temp:>11.1f} {args:>9.1f} {temp + args:>7.1f}")


if __name__ == "__main__":
    main()
