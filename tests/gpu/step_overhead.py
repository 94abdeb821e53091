"""What compression costs on one GPU, each figure next to its exact baseline from the same run.

1. ``compressed_psum`` of a flat f32 array (the default ``Codec()``) and of the example ViT's
   gradient pytree (the default policy) under ``jax.pmap`` and ``jax.shard_map``, next to
   ``lax.psum`` of the same values. With one GPU there is no wire: the time is what encoding,
   the reduction kernel and decoding cost.
2. One training step of the example ViT (``examples/vit/model.py``, Flax NNX, the example's
   ``jax.shard_map`` step) at ViT-S/16 size on 224x224 inputs, with the exact ``lax.pmean``
   transform and with ``cgx.compressed_allreduce`` (library defaults): the difference is what
   compression adds to a step.

    python tests/gpu/step_overhead.py [--json PATH] [--batch 128] [--depth 12]

Timing: each call is dispatched ``--calls`` times back to back and waited for once (JAX
dispatch is asynchronous, so the host's dispatch overlaps the device's work), the median of
``--repeats`` such runs after a warm-up. The inputs are random (timing only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

from cgx_jax.bench.common import median_seconds

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                           "examples", "vit")


def psum_rows(device, tree, label, calls, repeats, **how):
    """compressed_psum (``how``: its codec= or policy=; none: the default policy) vs lax.psum
    of `tree` on one device, under pmap and shard_map."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import cgx_jax as cgx

    key = jax.random.key(0)
    values = sum(x.size for x in jax.tree.leaves(tree))
    stacked = jax.device_put(jax.tree.map(lambda v: v[None], tree), device)
    mesh = Mesh(np.array([device]), ("d",))
    reducers = {
        "lax.psum": lambda t: jax.lax.psum(t, "d"),
        "cgx.compressed_psum": lambda t: cgx.compressed_psum(t, "d", key=key, **how),
    }
    rows = []
    for style in ("pmap", "shard_map"):
        for name, reduce in reducers.items():
            if style == "pmap":
                fn = jax.pmap(reduce, axis_name="d", devices=[device])
            else:
                fn = jax.jit(jax.shard_map(
                    lambda t, reduce=reduce: jax.tree.map(
                        lambda v: v[None], reduce(jax.tree.map(lambda v: v[0], t))),
                    mesh=mesh, in_specs=P("d"), out_specs=P("d")))
            seconds = median_seconds(lambda: fn(stacked), repeats, calls, warmup=2)
            rows.append(dict(what=f"{name} ({style})", input=label, values=values,
                             ms=seconds * 1e3, gb_per_s=values * 4 / seconds / 1e9))
    return rows


def vit_step_rows(device, args):
    """The example's training step with the exact pmean transform and with cgx, one GPU."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    sys.path.insert(0, EXAMPLE_DIR)
    import train  # the example's model, optimizer and shard_map step
    model = train.ViT(image_size=args.image, channels=3, num_classes=1000, patch=args.patch,
                      dim=args.dim, depth=args.depth, heads=args.heads, mlp_ratio=4.0,
                      rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.device_get(params)  # host copies: each mode's step donates its own
    leaves = jax.tree.leaves(params)
    n_params = sum(x.size for x in leaves)
    mesh = Mesh(np.array([device]), (train.AXIS,))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.image, args.image, 3)).astype(np.float32)
    y = rng.integers(0, 1000, args.batch).astype(np.int32)
    x, y = jax.device_put((x, y), NamedSharding(mesh, P(train.AXIS)))
    opt_args = types.SimpleNamespace(lr=1e-3, warmup=0.1, weight_decay=0.05)

    rows = []
    for mode, allreduce in (("exact lax.pmean", train.exact_pmean()),
                            ("cgx defaults", cgx.compressed_allreduce(train.AXIS))):
        tx = train.make_optimizer(allreduce, opt_args, 1000)
        step = train.make_train_step(graphdef, tx, mesh, 1000, 0.1)
        state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))

        def call():
            nonlocal state
            p, o, loss = step(*state, x, y)
            state = (p, o)
            return loss

        start = time.perf_counter()
        jax.block_until_ready(call())
        compile_s = time.perf_counter() - start
        seconds = median_seconds(call, args.repeats, args.calls, warmup=2)
        rows.append(dict(what=f"ViT step, {mode}", params=n_params, batch=args.batch,
                         ms=seconds * 1e3, images_per_s=args.batch / seconds,
                         compile_and_first_step_s=compile_s))
    grads = jax.tree.map(lambda p: p * 1e-3, params)  # a gradient-shaped tree
    wire = cgx.tree_wire_bytes(cgx.LayerPolicy(), grads)
    return rows, grads, dict(params=n_params, leaves=len(leaves), wire_bytes=int(wire),
                             f32_bytes=4 * n_params)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flat", type=int, default=64 << 20, help="values of the flat array")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--platform", default="gpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import cgx_jax as cgx

    device = jax.devices(args.platform)[0]
    print(f"# {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    steps, grads, model = vit_step_rows(device, args)
    exact, compressed = steps[0]["ms"], steps[1]["ms"]
    flat = jax.random.normal(jax.random.key(1), (args.flat,), jnp.float32)
    # A 1-D leaf is exact under the default policy: the flat array gets the default codec.
    collectives = (psum_rows(device, flat, f"flat f32 [{args.flat}]", args.calls, args.repeats,
                             codec=cgx.Codec())
                   + psum_rows(device, grads, f"ViT gradient tree ({model['leaves']} leaves)",
                               args.calls, args.repeats))

    print(f"\n## ViT-S/16-shaped model: {model['params'] / 1e6:.1f}M parameters, "
          f"{model['leaves']} leaves, f32 {model['f32_bytes'] / 1e6:.1f} MB, "
          f"wire {model['wire_bytes'] / 1e6:.1f} MB per step with the default policy")
    print(f"{'step':<28} {'batch':>5} {'ms':>9} {'img/s':>8} {'compile s':>9}")
    for r in steps:
        print(f"{r['what']:<28} {r['batch']:>5} {r['ms']:>9.2f} {r['images_per_s']:>8.0f} "
              f"{r['compile_and_first_step_s']:>9.1f}")
    print(f"compression adds {compressed - exact:.2f} ms per step, "
          f"{(compressed - exact) / exact:+.1%} of the exact step")
    print(f"\n## compressed_psum on one {device.device_kind}")
    print(f"{'reduction':<34} {'input':<30} {'ms':>8} {'GB/s f32':>9}")
    for r in collectives:
        print(f"{r['what']:<34} {r['input']:<30} {r['ms']:>8.3f} {r['gb_per_s']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.device_kind, jax=jax.__version__, model=model,
                           steps=steps, collectives=collectives), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
