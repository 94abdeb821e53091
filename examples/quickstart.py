"""Quickstart: a data-parallel training step whose gradients cross the devices compressed,
by changing one line of a plain JAX step.

Runs on any machine: without accelerators it simulates 8 CPU devices. The same MLP is trained
twice on the same batches, with ``jax.value_and_grad`` and with ``cgx.value_and_grad`` (4-bit
gradients by default); it prints both losses, what each leaf sends, and the bytes per step.

    python examples/quickstart.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402


def init(key, sizes=(64, 512, 512, 10)):
    """An MLP's parameters: its three kernels are large enough for the default policy to
    compress them; the biases go exact."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch(step, size, teacher):
    """A batch of a fixed random teacher's classification task."""
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (size, 64))
    return x, jnp.argmax(jnp.tanh(x @ teacher[0]) @ teacher[1], axis=-1)


def make_step(use_cgx: bool, tx):
    if use_cgx:  # the one changed line: the gradient is averaged over "data", compressed
        grad_fn = cgx.value_and_grad(loss_fn, axis_name="data")
    else:
        grad_fn = jax.value_and_grad(loss_fn)

    @jax.jit
    def step(params, opt_state, x, y, i):
        loss, grads = grad_fn(params, x, y, step=i) if use_cgx else grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, grad_fn


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    args = parser.parse_args(argv)
    devices = min(8, len(jax.devices()))
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    key = jax.random.key(0)
    teacher = (jax.random.normal(jax.random.key(2), (64, 32)),
               jax.random.normal(jax.random.key(3), (32, 10)))
    tx = optax.adam(1e-3)
    losses = {}
    with jax.set_mesh(mesh):
        for use_cgx in (False, True):
            params = jax.device_put(init(key), P())
            opt_state = tx.init(params)
            step, grad_fn = make_step(use_cgx, tx)
            history = []
            for i in range(args.steps):
                x, y = batch(i, args.batch, teacher)
                x, y = jax.device_put(x, P("data")), jax.device_put(y, P("data"))
                params, opt_state, loss = step(params, opt_state, x, y, jnp.int32(i))
                history.append(float(loss))
            losses["cgx" if use_cgx else "exact"] = history
    sent = cgx.tree_wire_bytes(cgx.LayerPolicy(), init(key))
    f32 = 4 * sum(p.size for p in jax.tree.leaves(init(key)))
    print(cgx.summary(grad_fn, init(key)))
    print(f"\n{devices} devices, global batch {args.batch}, Adam 1e-3, {args.steps} steps")
    for mode, history in losses.items():
        print(f"{mode:<6} loss at step 1 {history[0]:.4f}, at the end {history[-1]:.4f}")
    print(f"bytes each participant sends per step: {sent:,} compressed, {f32:,} in f32 "
          f"({f32 / sent:.1f}x fewer)")
    return dict(losses=losses, wire_bytes=sent, f32_bytes=f32)


if __name__ == "__main__":
    main()
