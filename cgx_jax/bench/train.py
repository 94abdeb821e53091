"""End-to-end data-parallel training steps across real processes on an emulated network:
``python -m cgx_jax.bench train --processes 4 --link 1gbit [--models mlp vit] ...``.

Each process is one participant (the allreduce benchmark's network: a namespace per
process behind ``tc tbf`` veth links, ``cgx_jax._src.netem``; docs/design.md section 9). Every
process runs plain library defaults: nothing in it is tuned beyond what a user's training
process has. Per model and mode it times the median seconds per step over ``--repeats``
steps after ``--warmup`` steps, the modes taking turns step by step (so a slow spell of a
shared machine hits them alike), and reports the global mean loss after all of them:

- ``floor``: the step with no all-reduce at all (each process applies its own gradient),
  the compute-only time any method pays;
- ``exact``: ``optax.chain(pmean, adam)``, the f32 all-reduce of every gradient leaf (Adam's
  learning rate: 1e-3 for the MLP, 1e-4 for the ViT);
- ``cgx``: ``optax.chain(cgx.compressed_allreduce(axis), adam)`` with library defaults;
- ``cgx 4b`` / ``cgx 2b``: every leaf of at least 16,384 values at 4 / 2 bits;
- ``adaptive``: per-layer bits fitted by ``cgx.fit_policy`` on the first step's gradients,
  on the byte budget of uniform 4 bits.

Sharded (FSDP) steps: every parameter whose first dimension divides by the process count is
sharded by rows (Adam's state with it), gathered whole for the step and its gradient
reduce-scattered; the few others stay replicated and their gradients go through ``pmean``:

- ``fsdp exact``: ``lax.all_gather`` per leaf, so ``lax.psum_scatter`` of the gradients;
- ``fsdp cgx``: ``cgx.compressed_all_gather`` of the sharded leaves, 8-bit weights, 4-bit
  gradients (the library's defaults);
- ``fsdp 4b``: the same with 4-bit weights;
- ``gspmd fsdp``: the same sharding written the GSPMD way (``jax.jit`` of
  ``jax.value_and_grad`` on the sharded parameters, XLA inserting the gathers and
  reduce-scatters in f32);
- ``gspmd fsdp cgx``: that step with ``cgx.value_and_grad`` in place of
  ``jax.value_and_grad`` (8-bit weights, 4-bit gradients), compared with ``gspmd fsdp``.

Models (gradients shaped as in real training): ``mlp``, an MLP 784-2048-2048-2048-10 (10M
parameters, the ``--batch`` per process of 28x28 inputs, ten classes); ``vit``, a ViT on
32x32x3 images (patch 4, width 512, depth 6, MLP 2048: 19M parameters). The data is
synthetic: inputs from a fixed seed per process and labels from a fixed random teacher, so
the loss falls and every run sees the same batches.

The report: s/step, the floor, the bytes one participant all-reduces per step against f32,
the speedup over ``exact``, the loss after the last step, and the step's memory per device
(the compiled step's arguments and temporaries, ``memory_analysis()``). ``--json``, ``--markdown``,
``--plot`` as in the allreduce benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cgx_jax._src.netem import shaped_network
from cgx_jax._src.sharded import WEIGHT_CODEC
from cgx_jax.bench import common
from cgx_jax.bench.common import (
    add_report_arguments,
    add_worker_arguments,
    check_network_arguments,
    ran_worker_or_report,
    run_links,
)

NS_PREFIX = "cgxtrain"
AXIS = "d"  # the one mesh axis: every device of every process
PORT = 23476
MODES = ("floor", "exact", "cgx", "cgx 4b", "cgx 2b", "adaptive", "fsdp exact", "fsdp cgx",
         "fsdp 4b", "gspmd fsdp", "gspmd fsdp cgx")
# The weight codec of each compressed FSDP mode (gradients: the library's default, 4 bits).
FSDP_WEIGHT_BITS = {"fsdp cgx": 8, "fsdp 4b": 4}
MODELS = ("mlp", "vit")
# Adam's learning rate per model: 1e-3 makes the ViT's loss jump from 2.6 to 6 in its first
# steps (one batch, one process), 1e-4 trains it steadily.
LEARNING_RATES = {"mlp": 1e-3, "vit": 1e-4}


# --------------------------------------------------------------------------- models

def mlp_init(key, hidden=2048):
    """Params of an MLP 784-hidden-hidden-hidden-10: {"layer{i}": {"kernel", "bias"}}."""
    import jax
    import jax.numpy as jnp

    sizes = (784, hidden, hidden, hidden, 10)
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "kernel": jax.random.normal(sub, (fan_in, fan_out)) / jnp.sqrt(fan_in),
            "bias": jnp.zeros((fan_out,))}
    return params


def mlp_apply(params, x):
    import jax

    layers = [params[f"layer{i}"] for i in range(len(params))]
    for layer in layers[:-1]:
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    return x @ layers[-1]["kernel"] + layers[-1]["bias"]


VIT = dict(patch=4, width=512, depth=6, mlp=2048, heads=8, image=32, channels=3)


def vit_init(key, width=VIT["width"], depth=VIT["depth"], mlp=VIT["mlp"], *,
             image=VIT["image"], channels=VIT["channels"], patch=VIT["patch"], classes=10):
    """Params of a ViT with pre-norm blocks (attention + MLP), a class token and a head, for
    ``image x image x channels`` inputs cut into ``patch x patch`` patches."""
    import jax
    import jax.numpy as jnp

    patches = (image // patch) ** 2
    keys = iter(jax.random.split(key, 4 + 4 * depth))

    def dense(fan_in, fan_out):
        return {"kernel": jax.random.normal(next(keys), (fan_in, fan_out)) / jnp.sqrt(fan_in),
                "bias": jnp.zeros((fan_out,))}

    def norm():
        return {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))}

    params = {"embed": dense(patch ** 2 * channels, width),
              "position": 0.02 * jax.random.normal(next(keys), (patches + 1, width)),
              "cls": jnp.zeros((1, width)), "norm": norm(), "head": dense(width, classes)}
    for i in range(depth):
        params[f"block{i}"] = {"norm1": norm(), "qkv": dense(width, 3 * width),
                               "out": dense(width, width), "norm2": norm(),
                               "fc1": dense(width, mlp), "fc2": dense(mlp, width)}
    return params


def vit_apply(params, images, heads=VIT["heads"]):
    """The logits of ``images`` ``(batch, height, width, channels)``; the patch size is read
    from the embedding's shape."""
    import jax
    import jax.numpy as jnp

    def layer_norm(p, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["bias"]

    def dense(p, x):
        return x @ p["kernel"] + p["bias"]

    b, _, _, channels = images.shape
    patch = round((params["embed"]["kernel"].shape[0] // channels) ** 0.5)
    side = images.shape[1] // patch
    x = images.reshape(b, side, patch, side, patch, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5).reshape(b, side * side, -1)
    x = dense(params["embed"], x)
    x = jnp.concatenate([jnp.broadcast_to(params["cls"], (b, 1, x.shape[-1])), x], axis=1)
    x = x + params["position"]
    depth = sum(name.startswith("block") for name in params)
    for i in range(depth):
        p = params[f"block{i}"]
        q, k, v = jnp.split(dense(p["qkv"], layer_norm(p["norm1"], x)), 3, axis=-1)
        q, k, v = (t.reshape(b, -1, heads, t.shape[-1] // heads) for t in (q, k, v))
        attention = jax.nn.dot_product_attention(q, k, v)
        x = x + dense(p["out"], attention.reshape(b, -1, q.shape[-1] * heads))
        x = x + dense(p["fc2"], jax.nn.gelu(dense(p["fc1"], layer_norm(p["norm2"], x))))
    return dense(params["head"], layer_norm(params["norm"], x[:, 0]))


def model_fns(name, hidden=2048):
    """(init(key), apply(params, x), input shape of one example)."""
    if name == "mlp":
        return lambda key: mlp_init(key, hidden), mlp_apply, (784,)
    return vit_init, vit_apply, (VIT["image"], VIT["image"], VIT["channels"])


# --------------------------------------------------------------------------- worker

def _worker(args) -> None:
    """One process of the benchmark: every model's modes, timed in turns; rank 0 writes the
    rows to ``args.out``."""
    from cgx_jax import launch as _launch

    if args.coordinator:
        os.environ[_launch.ENV_COORDINATOR] = args.coordinator
    rank, _ = _launch.initialize()

    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), (AXIS,))
    rows = []
    for model in args.models:
        rows += _model_rows(args, model, mesh, rank)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    multihost_utils.sync_global_devices("cgx_bench_train_done")


def _model_rows(args, model: str, mesh, rank: int) -> list[dict]:
    """The rows of one model: each mode's step built and compiled, then all of them timed."""
    import statistics

    import jax
    import optax

    init, apply, example_shape = model_fns(model, args.mlp_hidden)
    params = init(jax.random.key(0))

    def loss_fn(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    batches = synthetic_batches(mesh, apply, init(jax.random.key(1)), example_shape,
                                batch=args.batch, count=min(args.warmup + args.repeats, 8))
    tx = optax.adam(LEARNING_RATES[model])
    runs = {}  # mode -> its compiled step, current parameters and state, bytes, memory
    for mode in args.modes:
        if mode.startswith("fsdp"):
            run = _fsdp_run(mode, mesh, AXIS, params, loss_fn, tx)
        elif mode.startswith("gspmd"):
            run = _gspmd_fsdp_run(mode, mesh, AXIS, params, loss_fn, tx)
        else:
            run = _data_parallel_run(mode, mesh, AXIS, params, loss_fn, tx, batches[0])
        runs[mode] = _compiled(run, batches[0])
    steps = args.warmup + args.repeats
    times = _time_in_turns(runs, batches, steps)
    rows = []
    for mode, run in runs.items():
        timed = times[mode][args.warmup:]
        loss = float(run["loss"])
        rows.append(dict(model=model, mode=mode, seconds=statistics.median(timed),
                         times=timed, loss=loss, steps=steps,
                         parameters=sum(leaf.size for leaf in jax.tree.leaves(params)),
                         wire_bytes=run["wire_bytes"], f32_bytes=run["f32_bytes"],
                         memory_bytes=run["memory_bytes"]))
        if rank == 0:
            print(f"  {model:<4} {mode:<14} {rows[-1]['seconds'] * 1e3:9.1f} ms/step  "
                  f"loss {loss:.4f} after {steps} steps", flush=True)
    return rows


def synthetic_batches(mesh, apply, teacher, example_shape, *, batch: int, count: int,
                      first: int = 0) -> list:
    """The same ``count`` batches of ``batch`` examples per participant in every run (the
    loop cycles them): inputs from a seed per (step, participant), steps ``first`` on,
    labels from the teacher, placed as this process's shards of a global batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = list(mesh.devices.reshape(-1))
    local = [d for d in devices if d.process_index == jax.process_index()]
    sharding = NamedSharding(mesh, P(AXIS))
    batches = []
    for step in range(first, first + count):
        xs, ys = [], []
        for device in local:
            rng = np.random.default_rng([step, devices.index(device)])
            x = rng.standard_normal((batch, *example_shape), dtype=np.float32)
            y = np.asarray(jnp.argmax(apply(teacher, jnp.asarray(x)), -1), np.int32)
            xs.append(jax.device_put(x, device))
            ys.append(jax.device_put(y, device))
        batches.append(tuple(
            jax.make_array_from_single_device_arrays((mesh.size * batch, *a[0].shape[1:]),
                                                     sharding, a) for a in (xs, ys)))
    return batches


def _data_parallel_run(mode, mesh, axis, params, loss_fn, tx, batch) -> dict:
    """The step of a data-parallel mode (``floor``, ``exact``, ``cgx``, ``cgx 4b``/``2b``,
    ``adaptive``) and its placed parameters and state, placed as the step returns them (so
    the second step does not compile again); its bytes per step."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    n = mesh.size
    policy = _policy(mode, mesh, axis, params, loss_fn, batch)
    if mode != "floor":
        allreduce = (pmean_transform(axis) if policy is None
                     else cgx.compressed_allreduce(axis, policy=policy))
        tx = optax.chain(allreduce, tx)
    if mode == "floor":  # every participant its own copy, one row each
        param_specs = state_specs = P(axis)
        run_params, state = jax.tree.map(lambda leaf: jax.device_put(
            jnp.broadcast_to(leaf, (n, *leaf.shape)), NamedSharding(mesh, P(axis))),
            (params, tx.init(params)))
    else:
        param_specs = P()
        run_params = jax.device_put(params, NamedSharding(mesh, P()))
        state = cgx.shard_state(tx.init(params), mesh, axis)
        state_specs = cgx.state_specs(state, axis)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(param_specs, state_specs, P(axis), P()),
                       out_specs=(param_specs, state_specs, P()))
    def step(params, state, batch, key):
        del key  # the transform keeps its own
        if mode == "floor":  # this process's own model, its own gradient
            params, state = jax.tree.map(lambda v: v[0], (params, state))
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        else:
            loss, grads = cgx.local_value_and_grad(loss_fn, axis)(params, batch)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        if mode == "floor":
            params, state = jax.tree.map(lambda v: v[None], (params, state))
        return params, state, jax.lax.pmean(loss, axis)

    f32_bytes = sum(4 * leaf.size for leaf in jax.tree.leaves(params))
    wire = (0 if mode == "floor" else f32_bytes if policy is None
            else cgx.tree_wire_bytes(policy, params))
    return dict(step=step, params=run_params, state=state, wire_bytes=wire,
                f32_bytes=f32_bytes)


def pmean_transform(axis):
    """``lax.pmean`` over ``axis`` as an Optax transform: the exact all-reduce baseline."""
    import jax
    import optax

    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (jax.lax.pmean(updates, axis), state))


def summed_gradient(mesh, axis, loss_fn, params, batch):
    """The gradient of ``loss_fn`` summed over the participants of ``axis`` (replicated
    ``params``, ``batch`` split over ``axis``), as numpy: the same on every process."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    grad = jax.jit(jax.shard_map(jax.grad(loss_fn), mesh=mesh, in_specs=(P(), P(axis)),
                                 out_specs=P()))
    return jax.tree.map(lambda g: np.asarray(g.addressable_shards[0].data), grad(params, batch))


def _policy(mode, mesh, axis, params, loss_fn, batch):
    """The codecs of a data-parallel mode: None for ``floor`` and ``exact``; ``adaptive``
    fitted on the summed gradient of the first batch, the same on every process, so every
    process fits the same policy and compiles the same collectives."""

    import cgx_jax as cgx

    if mode in ("floor", "exact"):
        return None
    if mode == "cgx":
        return cgx.LayerPolicy()
    if mode != "adaptive":  # "cgx 4b", "cgx 2b"
        return cgx.LayerPolicy(default=cgx.Codec(bits=int(mode[4])))
    summed = summed_gradient(mesh, axis, loss_fn, params, batch)
    return cgx.fit_policy(summed, budget_bits=4.0, base=cgx.LayerPolicy())


def _compiled(run: dict, batch) -> dict:
    """``run`` with its step compiled once, ahead of time, and the compiled step's memory
    per device (its arguments and temporaries, ``memory_analysis()``)."""
    import jax

    run["step"] = run["step"].lower(run["params"], run["state"], batch,
                                    jax.random.key(0)).compile()
    memory = run["step"].memory_analysis()
    run["memory_bytes"] = None if memory is None else (
        memory.argument_size_in_bytes + memory.temp_size_in_bytes)
    return run


def _time_in_turns(runs: dict, batches, steps: int) -> dict:
    """Seconds of each step of each mode. The modes take turns, one step each, so a slow
    spell of the shared machine falls on all of them alike instead of on whichever mode was
    running then."""
    import jax

    times = {mode: [] for mode in runs}
    for step in range(steps):
        for mode, run in runs.items():
            start = time.perf_counter()
            run["params"], run["state"], run["loss"] = jax.block_until_ready(run["step"](
                run["params"], run["state"], batches[step % len(batches)],
                jax.random.fold_in(jax.random.key(0), step)))
            times[mode].append(time.perf_counter() - start)
    return times


def _fsdp_run(mode, mesh, axis, params, loss_fn, tx) -> dict:
    """The compiled FSDP step of ``mode`` and its placed parameters and Adam state: leaves
    whose first dimension divides by the participants sharded by rows, the rest replicated;
    its bytes as ``_fsdp_bytes`` counts."""
    import functools

    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx
    from cgx_jax._src.vma import to_local

    n = mesh.size
    specs = _fsdp_specs(params, n, axis)
    sharded = jax.tree.map(lambda s: s != P(), specs, is_leaf=lambda x: isinstance(x, P))
    place = lambda tree, specs: jax.tree.map(  # noqa: E731
        lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), tree, specs)
    state = tx.init(params)
    state_specs = optax.tree_map_params(tx, lambda _, s: s, state, specs,
                                        transform_non_params=lambda _: P())
    weight_bits = FSDP_WEIGHT_BITS.get(mode)
    weights = cgx.LayerPolicy(default=cgx.Codec(bits=weight_bits or 8, rounding="nearest"))

    def gather(shards, key):
        parts = jax.tree.map(lambda v, s: v if s else None, shards, sharded)
        if weight_bits is None:
            full = jax.tree.map(lambda v: jax.lax.all_gather(v, axis, tiled=True), parts)
        else:
            full = cgx.compressed_all_gather(parts, axis, tiled=True, key=key, policy=weights)
        return jax.tree.map(lambda f, v, s: f if s else v, full, shards, sharded,
                            is_leaf=lambda x: x is None)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, state_specs, P(axis), P()),
                       out_specs=(specs, state_specs, P()))
    def step(shards, state, batch, key):
        # Replicated leaves as local values, so their gradients are this participant's own.
        local = jax.tree.map(lambda v, s: v if s else to_local(v, axis), shards, sharded)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(gather(p, key), batch))(local)
        # A gathered leaf's gradient arrives summed over participants: the mean is /n.
        grads = jax.tree.map(lambda g, s: g / n if s else jax.lax.pmean(g, axis),
                             grads, sharded)
        updates, state = tx.update(grads, state, shards)
        return optax.apply_updates(shards, updates), state, jax.lax.pmean(loss, axis)

    return dict(step=step, params=place(params, specs), state=place(state, state_specs),
                **_fsdp_bytes(params, weights if weight_bits else None))


def _fsdp_bytes(params, weights) -> dict:
    """``wire_bytes``: what one participant's gathers and reduce-scatters carry per step
    (weights at ``weights``, gradients at the default ``LayerPolicy()``; f32 for None);
    ``f32_bytes``: the same in f32 (gather and reduce-scatter of every leaf)."""
    import jax

    import cgx_jax as cgx

    f32_bytes = 2 * sum(4 * leaf.size for leaf in jax.tree.leaves(params))
    wire = f32_bytes if weights is None else (cgx.tree_wire_bytes(weights, params)
                                              + cgx.tree_wire_bytes(cgx.LayerPolicy(), params))
    return dict(wire_bytes=wire, f32_bytes=f32_bytes)


def _fsdp_specs(params, n: int, axis):
    """FSDP's layout of ``params``: leaves whose first dimension divides by ``n`` sharded by
    rows over ``axis``, the rest replicated."""
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda p: P(axis) if p.ndim > 0 and p.shape[0] % n == 0 else P(),
                        params)


def _gspmd_fsdp_run(mode, mesh, axis, params, loss_fn, tx) -> dict:
    """The ``gspmd fsdp`` step (``jax.jit`` of ``jax.value_and_grad`` on parameters and Adam
    state sharded as ``_fsdp_specs``, XLA inserting the collectives) or, for ``gspmd fsdp
    cgx``, the same step with ``cgx.value_and_grad``; its bytes as ``_fsdp_bytes`` counts."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    specs = _fsdp_specs(params, mesh.size, axis)
    state = tx.init(params)
    state_specs = optax.tree_map_params(tx, lambda _, s: s, state, specs,
                                        transform_non_params=lambda _: P())
    shardings = [jax.tree.map(lambda s: NamedSharding(mesh, s), t,
                              is_leaf=lambda x: isinstance(x, P)) for t in (specs, state_specs)]
    use_cgx = mode == "gspmd fsdp cgx"
    grad_fn = (cgx.value_and_grad(loss_fn, mesh=mesh, axis_name=axis, param_specs=specs)
               if use_cgx else jax.value_and_grad(loss_fn))

    @functools.partial(jax.jit, out_shardings=(*shardings, None))
    def step(params, state, batch, key):
        if use_cgx:  # an integer that changes every step, for the rounding noise
            loss, grads = grad_fn(params, batch, step=jax.random.bits(key, dtype=jnp.uint32))
        else:
            loss, grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    weights = cgx.LayerPolicy(default=WEIGHT_CODEC) if use_cgx else None
    return dict(step=step, params=jax.device_put(params, shardings[0]),
                state=jax.device_put(state, shardings[1]), **_fsdp_bytes(params, weights))


# --------------------------------------------------------------------------- report

def add_ratios(rows: list[dict]) -> list[dict]:
    """Adds, per link and model, the floor and the speedup over ``exact``."""
    for r in rows:
        same = [o for o in rows if o["model"] == r["model"] and o.get("link") == r.get("link")]
        base = {o["mode"]: o["seconds"] for o in same}
        exact = ("fsdp exact" if r["mode"].startswith("fsdp") else  # each its own baseline
                 "gspmd fsdp" if r["mode"].startswith("gspmd") else "exact")
        r["floor_seconds"] = base.get("floor")
        r["vs_exact"] = base[exact] / r["seconds"] if exact in base else None
        r["wire_ratio"] = r["f32_bytes"] / r["wire_bytes"] if r["wire_bytes"] else None
    return rows


def fmt(value, spec):
    """``value`` formatted, or ``-`` for None."""
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = (f"{'link':<7} {'model':<5} {'params':>7} {'mode':<14} {'s/step':>8} "
              f"{'floor':>7} {'f32/wire':>9} {'x exact':>8} {'loss':>8} {'MiB/dev':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.get('link', ''):<7} {r['model']:<5} {r['parameters'] / 1e6:>6.1f}M "
            f"{r['mode']:<14} {r['seconds']:>8.3f} {fmt(r['floor_seconds'], '7.3f'):>7} "
            f"{fmt(r['wire_ratio'], '8.2f'):>9} {fmt(r['vs_exact'], '7.2f'):>8} "
            f"{r['loss']:>8.4f} {fmt(_mib(r), '8.1f'):>8}")
    return "\n".join(lines)


def _mib(row):
    """The step's memory per device in MiB (arguments and temporaries), or None."""
    return None if row.get("memory_bytes") is None else row["memory_bytes"] / 2**20


def format_markdown(rows: list[dict], title: str) -> str:
    lines = [title, "", "| link | model | mode | s/step | floor | f32/wire bytes | x exact | "
             "loss | MiB/device |", "|:---|:---|:---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.get('link', '')} | {r['model']} ({r['parameters'] / 1e6:.1f}M) "
                     f"| {r['mode']} | {r['seconds']:.3f} | {fmt(r['floor_seconds'], '.3f')} "
                     f"| {fmt(r['wire_ratio'], '.2f')} | {fmt(r['vs_exact'], '.2f')} "
                     f"| {r['loss']:.4f} | {fmt(_mib(r), '.1f')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    """Seconds per step per mode, one panel per model, the floor as a dotted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and r["mode"] != "floor"]
        labels = [f"{r['mode']}\n{r.get('link', '')}" for r in mine]
        ax.bar(range(len(mine)), [r["seconds"] for r in mine], color="tab:blue")
        if mine and mine[0]["floor_seconds"]:
            ax.axhline(mine[0]["floor_seconds"], color="gray", linestyle=":",
                       label="no all-reduce (floor)")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(mine)), labels, fontsize=7)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{model} ({mine[0]['parameters'] / 1e6:.1f}M parameters)" if mine else model)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(result: dict, args) -> None:
    title = (f"training steps, {result['processes']} processes, batch {result['batch']} per "
             f"process, Adam, median of {result['repeats']} steps after {result['warmup']}")
    common.write_reports(result, args, title, format_table, format_markdown, plot)


# --------------------------------------------------------------------------- orchestrator

def _run_link(args, link: str, tmp: str) -> tuple[int, list[dict], str]:
    from cgx_jax.launch import launch

    warnings = []

    def warn(message: str) -> None:
        warnings.append(message)
        print(f"cgx_jax.bench train: {message}", file=sys.stderr, flush=True)

    out = os.path.join(tmp, f"rows_{link}.json")
    with shaped_network(args.processes, link, subnet=args.subnet, prefix=args.netns_prefix,
                        warn=warn) as network:
        coordinator = f"{network.address(0)}:{PORT}" if network else None
        wrap = network.wrap if network else list
        print(f"# training across {args.processes} processes, "
              f"{f'{link} tbf per link' if network else 'unshaped loopback'}", flush=True)
        command = [sys.executable, "-m", "cgx_jax.bench.train", "--worker", "--out", out,
                   "--models", *args.models, "--modes", *args.modes, "--batch",
                   str(args.batch), "--mlp-hidden", str(args.mlp_hidden),
                   "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        command += ["--coordinator", coordinator] if coordinator else []
        code = launch(wrap(command), args.processes, 1, timeout=args.timeout)
    rows = []
    if code == 0 and os.path.exists(out):
        with open(out) as f:
            rows = json.load(f)
    for r in rows:
        r["link"] = link if network else "none"
    return code, rows, (warnings[0] if warnings and not network else "")


def run(args) -> int:
    start = time.monotonic()
    code, rows, notes = run_links("train", args.link,
                                  lambda link, tmp: _run_link(args, link, tmp))
    if code != 0 or not rows:
        print(f"cgx_jax.bench train: workers failed (exit code {code})", file=sys.stderr)
        return code or 1
    result = dict(processes=args.processes, links=args.link, notes=notes, batch=args.batch,
                  repeats=args.repeats, warmup=args.warmup,
                  wall_seconds=round(time.monotonic() - start, 1),
                  command="python -m cgx_jax.bench train " + " ".join(args.argv),
                  rows=add_ratios(rows))
    write_reports(result, args)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m cgx_jax.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--link", nargs="+", default=["1gbit"],
                   help="tc rate of every process's link (1gbit, 10gbit, 100mbit) or none")
    p.add_argument("--models", nargs="+", default=["mlp"], choices=MODELS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--batch", type=int, default=32, help="examples per process and step")
    p.add_argument("--mlp-hidden", type=int, default=2048,
                   help="hidden width of the mlp model (default 2048: 10M parameters)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--subnet", default="10.214.0")
    p.add_argument("--netns-prefix", default=NS_PREFIX)
    add_report_arguments(p, "seconds per step per mode, one panel per model")
    add_worker_arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    if ran_worker_or_report(args, _worker, write_reports):
        return 0
    for name in ("batch", "repeats", "mlp_hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    check_network_arguments(p, args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
