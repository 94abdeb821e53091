"""Per-device memory of one FSDP training step, from the compiled program's
``memory_analysis()`` (docs/performance.md, "FSDP through cgx.value_and_grad"): a Flax NNX
model of 8 layers of 1024x1024 on 8 simulated CPU devices, its kernels sharded over 'fsdp'
(FSDP) or replicated (data parallelism), the step's gradient from ``nnx.value_and_grad``
(GSPMD) or ``cgx.value_and_grad``; the step updates the parameters in place (donated). The
rows with ``nnx.remat`` wrap each layer in it, the cgx one with
``keep_for_backward="packets"`` (weights decoded where the layers read them).

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
    def __init__(self, width, depth, kernel_axes, rngs, remat=False):
        init = nnx.initializers.lecun_normal()
        self.remat = remat
        self.layers = nnx.List([
            nnx.Linear(width, width, rngs=rngs,
                       kernel_init=nnx.with_partitioning(init, kernel_axes))
            for _ in range(depth)])

    def __call__(self, x):
        apply = lambda layer, x: jnp.tanh(layer(x))  # noqa: E731
        if self.remat:
            apply = nnx.remat(apply)
        for layer in self.layers:
            x = apply(layer, x)
        return x


def step_memory(mesh, kernel_axes, use_cgx, width=1024, depth=8, rows=256, remat=False,
                keep_for_backward="weights"):
    """(temporaries, arguments) in MiB per device of the compiled step."""
    with jax.set_mesh(mesh):
        @nnx.jit
        def create():
            model = Deep(width, depth, kernel_axes, nnx.Rngs(0), remat)
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
                grad_fn = cgx.value_and_grad(loss_fn, mesh=mesh, axis_name="fsdp",
                                             keep_for_backward=keep_for_backward)
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
    fsdp, dp, packets = ("fsdp", None), (None, None), dict(keep_for_backward="packets")
    rows = [("GSPMD FSDP (nnx.value_and_grad)", fsdp, False, {}),
            ("GSPMD FSDP, nnx.remat per layer", fsdp, False, dict(remat=True)),
            ("cgx FSDP (cgx.value_and_grad)", fsdp, True, {}),
            ("cgx FSDP, packets, nnx.remat", fsdp, True, dict(remat=True, **packets)),
            ("GSPMD data parallel", dp, False, {}),
            ("cgx data parallel", dp, True, {})]
    print(f"{'step':<34} {'temporaries':>11} {'arguments':>9} {'sum':>7}  (MiB per device)")
    for name, axes, use_cgx, options in rows:
        temp, args = step_memory(mesh, axes, use_cgx, **options)
        print(f"{name:<34} {temp:>11.1f} {args:>9.1f} {temp + args:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
