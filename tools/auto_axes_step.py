"""Step time of plain arrays sharded over an automatic 'model' axis under ``jax.jit``
(docs/performance.md, "Automatic mesh axes"): a 784-2048-2048-2048-10 MLP on a 4x2
('batch', 'model') mesh of simulated CPU devices, its weights placed by columns and rows over
'model', a global batch of 256 split over 'batch', one SGD step per call. Four gradients in
the same run: ``jax.value_and_grad`` (XLA's exact all-reduce), and ``cgx.value_and_grad``
with the layout from XLA's partitioner (no ``param_specs``), given by ``param_specs`` from
the placed arrays, or taken as replicated (``param_specs=P()``, what a plain pytree got
before the partitioner read it). Median of 15 steps after 3, the best of two rounds.

    python tools/auto_axes_step.py
"""

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402

SIZES = [784, 2048, 2048, 2048, 10]
SPECS = [(P(None, "model"), P("model")), (P("model", None), P()),
         (P(None, "model"), P("model")), (P(), P())]


def setup(mesh):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    keys = jax.random.split(jax.random.key(0), len(SPECS))
    params = [(jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n))
              for k, m, n in zip(keys, SIZES[:-1], SIZES[1:])]
    params = jax.tree.map(put, params, SPECS, is_leaf=lambda s: isinstance(s, P))
    x = put(jax.random.normal(jax.random.key(1), (256, SIZES[0])), P("batch"))
    y = put(jax.nn.one_hot(jnp.arange(256) % SIZES[-1], SIZES[-1]), P("batch"))
    return params, x, y


def loss(params, x, y):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(x @ w + b) * y, -1))


def sgd_step(grad_fn, takes_step):
    @jax.jit
    def step(params, x, y, i):
        value, grads = grad_fn(params, x, y, step=i) if takes_step else grad_fn(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value
    return step


def median_ms(step, mesh, params, x, y, warmup=3, steps=15):
    times = []
    with jax.set_mesh(mesh):
        for i in range(warmup + steps):
            start = time.perf_counter()
            params, value = step(params, x, y, jnp.int32(i))
            value.block_until_ready()
            times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times[warmup:])), float(value)


def main():
    mesh = jax.make_mesh((4, 2), ("batch", "model"), axis_types=(AxisType.Auto,) * 2)
    params, x, y = setup(mesh)
    cgx_grad = lambda **kw: cgx.value_and_grad(loss, mesh=mesh, axis_name="batch", **kw)  # noqa: E731
    modes = {
        "jax.value_and_grad (exact)": sgd_step(jax.value_and_grad(loss), False),
        "cgx, layout from XLA's partitioner": sgd_step(cgx_grad(), True),
        "cgx, param_specs from the arrays": sgd_step(cgx_grad(param_specs=jax.tree.map(
            lambda a: a.sharding.spec, params)), True),
        "cgx, taken as replicated (param_specs=P())": sgd_step(cgx_grad(param_specs=P()),
                                                              True),
    }
    best, losses = {}, {}
    for _ in range(2):
        for name, step in modes.items():
            ms, losses[name] = median_ms(step, mesh, params, x, y)
            best[name] = min(best.get(name, ms), ms)
    base = best["jax.value_and_grad (exact)"]
    print("| gradient | ms/step | x exact | loss after 18 steps |")
    print("|---|---:|---:|---:|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} | {losses[name]:.4f} |")


if __name__ == "__main__":
    main()
