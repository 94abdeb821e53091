"""How much longer the first step waits with cgx: ``python -m cgx_jax.bench compile``.

Times the trace + lowering and the XLA compilation of one data-parallel training step
(``jax.shard_map`` over ``--devices`` simulated CPU devices, Adam), exact
(``lax.pmean`` of the gradients) against ``cgx.compressed_allreduce`` with its defaults,
for ``bench train``'s models: ``mlp`` (8 leaves), ``vit`` (80 leaves) and ``vit12`` (the
same ViT 12 layers deep, 152 leaves). Medians over ``--repeats`` rounds, the two steps
taking turns, every cache cleared before each; the compiled programs' custom calls, fusions
and instructions show where the difference comes from (docs/design.md section 6).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

MODELS = {"mlp": ("mlp", {}), "vit": ("vit", {}), "vit12": ("vit", {"depth": 12})}


def _step(mode, init, apply, example_shape, devices, batch):
    """The jitted step of ``mode`` and its example arguments."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    import cgx_jax as cgx
    from cgx_jax.bench.train import pmean_transform

    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    first = cgx.compressed_allreduce("d") if mode == "cgx" else pmean_transform("d")
    tx = optax.chain(first, optax.adam(1e-3))
    params = jax.eval_shape(init, jax.random.key(0))
    state = jax.eval_shape(tx.init, params)
    specs = cgx.state_specs(state, "d")

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("d"), P("d")),
                       out_specs=(P(), specs))
    def step(params, state, x, y):
        grads = cgx.local_value_and_grad(loss_fn, "d")(params, x, y)[1]
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jax.ShapeDtypeStruct((devices * batch, *example_shape), jnp.float32)
    y = jax.ShapeDtypeStruct((devices * batch,), jnp.int32)
    return jax.jit(step), (params, state, x, y)


def measure(mode, model, devices, batch) -> dict:
    """Seconds to trace + lower and to compile ``mode``'s step, and its program's counts."""
    import jax

    from cgx_jax.bench.train import model_fns

    name, kwargs = MODELS[model]
    init, apply, example_shape = model_fns(name)
    init_with = (lambda key: init(key, **kwargs)) if kwargs else init
    jax.clear_caches()
    step, args = _step(mode, init_with, apply, example_shape, devices, batch)
    start = time.perf_counter()
    lowered = step.lower(*args)
    traced = time.perf_counter()
    text = lowered.compile().as_text()
    compiled = time.perf_counter()
    return dict(model=model, mode=mode, leaves=len(jax.tree.leaves(args[0])),
                trace=traced - start, compile=compiled - traced,
                custom_calls=len(re.findall(r" custom-call\(", text)),
                fusions=len(re.findall(r" fusion\(", text)),
                instructions=sum(" = " in line for line in text.splitlines()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cgx_jax.bench compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="examples per device")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    # Read when the CPU backend starts, at the first jax.devices() below.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    import jax

    from cgx_jax.bench.common import cpu_description

    # A persistent compilation cache (JAX_COMPILATION_CACHE_DIR) would time its reads.
    jax.config.update("jax_enable_compilation_cache", False)
    if len(jax.devices()) < args.devices:
        p.error(f"--devices {args.devices}: this process has {len(jax.devices())} devices "
                f"(run it as its own process, before anything starts JAX's backend)")

    print(f"# trace + lower and compile of one data-parallel step, {args.devices} CPU devices, "
          f"Adam, median of {args.repeats}; CPU: {cpu_description()}")
    print(f"{'model':<6} {'leaves':>6} {'mode':<6} {'trace s':>8} {'compile s':>10} "
          f"{'total s':>8} {'x exact':>8} {'custom calls':>13} {'fusions':>8} {'instrs':>7}")
    for model in args.models:
        rounds = [[measure(mode, model, args.devices, args.batch) for mode in ("exact", "cgx")]
                  for _ in range(args.repeats)]
        totals = {}
        for i, mode in enumerate(("exact", "cgx")):
            runs = [r[i] for r in rounds]
            trace = statistics.median(r["trace"] for r in runs)
            compile_ = statistics.median(r["compile"] for r in runs)
            totals[mode] = statistics.median(r["trace"] + r["compile"] for r in runs)
            last = runs[-1]
            print(f"{model:<6} {last['leaves']:>6} {mode:<6} {trace:>8.2f} {compile_:>10.2f} "
                  f"{totals[mode]:>8.2f} {totals[mode] / totals['exact']:>8.2f} "
                  f"{last['custom_calls']:>13} {last['fusions']:>8} {last['instructions']:>7}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
