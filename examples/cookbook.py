"""A Training-Cookbook-style step (plain JAX, explicit mesh axes, FSDP), exact and with cgx.

The model is a byte-level decoder in plain dict pytrees: every kernel FSDP-sharded over the
``'fsdp'`` axis of ``jax.make_mesh``'s explicit mesh, the embeddings replicated, every
activation annotated with ``out_sharding=`` (the specs kept in one place, ``Specs``), Adam
written by hand on state sharded like the parameters, one ``jax.jit`` step. It trains on the
Python standard library's sources (``cgx_jax.bench.text_lm``'s data: every tenth module held
out). The cgx step differs in the three lines marked ``# cgx``:

1. the activation specs leave out the data axis (cgx runs the loss once per participant,
   on its own rows; docs/design.md section 6 says why JAX cannot keep them),
2. ``cgx.value_and_grad`` for ``jax.value_and_grad`` (the mesh is the one ``set_mesh``
   made current; FSDP kernels are gathered as 8-bit packets and their gradients
   reduce-scattered as 4-bit ones),
3. the step counter passed as ``step=`` (the rounding noise is folded from it).

Each mode prints its held-out loss after ``--steps`` steps (the same batches and
initialisation), its ms/step (compute on simulated devices, not network time), whether the
gradients kept the parameters' layouts, and the bytes of the compiled step's collectives by
element type. ``--one-batch`` trains on one batch throughout, as the Cookbook does
(memorisation), and reports that batch's loss instead::

    python examples/cookbook.py                 # exact and cgx, 60 steps, 8 devices
    python examples/cookbook.py --one-batch --steps 300
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

if "--help" not in sys.argv and "-h" not in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402
from cgx_jax.bench import text_lm  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Specs:
    """Where the model's tensors live: kernels FSDP over ``'fsdp'``; activations by batch."""
    kernel: P = P("fsdp", None)
    act: P = P("fsdp", None, None)  # (batch, sequence, features)


KERNELS = ("qkv", "proj", "up", "down", "out")


def init(key, width: int, depth: int, length: int, specs: Specs) -> dict:
    """The convergence benchmark's decoder (``text_lm.init``: ``embed``, ``position``,
    ``block{i}`` of ``norm1``, ``qkv``, ``proj``, ``norm2``, ``up``, ``down``; ``norm``,
    ``out``), its kernels placed FSDP, everything else replicated as created."""
    params = text_lm.init(key, text_lm.LMConfig(width=width, depth=depth, length=length))
    return jax.tree_util.tree_map_with_path(
        lambda path, w: jax.device_put(w, specs.kernel) if path[-1].key in KERNELS else w,
        params)


def forward(params, tokens, specs: Specs, heads: int):
    """Next-byte logits; every matmul in bf16 with its output's layout annotated."""
    def dense(x, w):
        return jnp.einsum("btd,de->bte", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                          out_sharding=specs.act).astype(jnp.float32)

    def rms_norm(x, scale):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale

    b, t = tokens.shape
    x = params["embed"].at[tokens].get(out_sharding=specs.act) + params["position"][:t]
    for i in range(sum(name.startswith("block") for name in params)):
        p = params[f"block{i}"]
        q, k, v = jnp.split(dense(rms_norm(x, p["norm1"]), p["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, -1) for a in (q, k, v))
        attention = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + dense(attention.reshape(b, t, -1), p["proj"])
        x = x + dense(jax.nn.gelu(dense(rms_norm(x, p["norm2"]), p["up"])), p["down"])
    return dense(rms_norm(x, params["norm"]), params["out"])


def adam(params, grads, state, i, lr, b1=0.9, b2=0.95, eps=1e-8):
    """One Adam step; ``state`` (m, v) is sharded like the parameters."""
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state[0], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state[1], grads)
    t = (i + 1).astype(jnp.float32)
    update = jax.tree.map(lambda m, v: m / (1 - b1 ** t) / (jnp.sqrt(v / (1 - b2 ** t)) + eps),
                          m, v)
    return jax.tree.map(lambda p, u: p - lr * u, params, update), (m, v)


def loss_of(specs: Specs, heads: int):
    def loss_fn(params, windows):
        logits = forward(params, windows[:, :-1], specs, heads)
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()
    return loss_fn


def make_step(use_cgx: bool, heads: int, lr: float):
    """The jitted step ``(params, opt_state, windows, i) -> (params, opt_state, loss, grads)``,
    the original (``jax.value_and_grad``) or its cgx port."""
    specs = Specs(act=P(None, None, None)) if use_cgx else Specs()  # cgx
    loss_fn = loss_of(specs, heads)
    if use_cgx:
        grad_fn = cgx.value_and_grad(loss_fn, axis_name="fsdp")  # cgx
    else:
        grad_fn = jax.value_and_grad(loss_fn)

    @jax.jit
    def step(params, opt_state, windows, i):
        if use_cgx:
            loss, grads = grad_fn(params, windows, step=i)  # cgx
        else:
            loss, grads = grad_fn(params, windows)
        params, opt_state = adam(params, grads, opt_state, i, lr)
        return params, opt_state, loss, grads

    return step


def collectives(hlo: str) -> list:
    """(op, element type, bytes) of each output of every collective of compiled HLO text."""
    itemsize = {"f32": 4, "bf16": 2, "u8": 1, "s32": 4, "u32": 4, "pred": 1}
    found = []
    for m in re.finditer(r"= (.*?) (all-gather|all-to-all|reduce-scatter|all-reduce|"
                         r"collective-permute)(-start)?\(", hlo):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            count = int(np.prod([int(d) for d in dims.split(",") if d]))
            found.append((m.group(2), dtype, count * itemsize.get(dtype, 4)))
    return found


def collective_bytes(hlo: str) -> dict:
    """Bytes of every collective's outputs, by element type."""
    totals = {}
    for _, dtype, size in collectives(hlo):
        totals[dtype] = totals.get(dtype, 0) + size
    return totals


def train(use_cgx: bool, args, corpus, held_out):
    """``args.steps`` steps from the seed's initialisation; the loss, ms/step, whether the
    gradients kept the parameters' layouts, and the step's collective bytes by type."""
    step = make_step(use_cgx, args.heads, args.lr)
    params = init(jax.random.key(args.seed), args.width, args.depth, args.length, Specs())
    opt_state = jax.tree.map(jnp.zeros_like, (params, params))
    batch = lambda i: jax.device_put(  # noqa: E731
        text_lm.train_batch(corpus.train, 0 if args.one_batch else i, args.batch,
                            args.length, args.seed), P("fsdp"))
    hlo = step.lower(params, opt_state, batch(0), jnp.int32(0)).compile().as_text()
    seconds = []
    for i in range(args.steps):
        start = time.perf_counter()
        params, opt_state, loss, grads = step(params, opt_state, batch(i), jnp.int32(i))
        loss.block_until_ready()
        seconds.append(time.perf_counter() - start)
    layouts_kept = all(g.sharding.spec == p.sharding.spec for g, p in
                       zip(jax.tree.leaves(grads), jax.tree.leaves(params)))
    measure = jax.jit(loss_of(Specs(), args.heads))  # every mode measured the same way
    windows = [batch(0)] if args.one_batch else [
        jax.device_put(w, P("fsdp")) for w in np.split(held_out, len(held_out) // args.batch)]
    return dict(loss=np.mean([float(measure(params, w)) for w in windows]),
                ms=1e3 * np.median(seconds[1:]), layouts=layouts_kept,
                collectives=collective_bytes(hlo))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["exact", "cgx"], choices=["exact", "cgx"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--length", type=int, default=128, help="context, bytes")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one-batch", action="store_true",
                   help="train on one batch (the Cookbook's memorisation); report its loss")
    args = p.parse_args(argv)
    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))  # explicit axes by default
    if args.batch % mesh.size or args.eval_windows % args.batch or args.width % mesh.size:
        p.error(f"--batch, --eval-windows / --batch and --width must divide by the "
                f"{mesh.size} devices")
    corpus = text_lm.corpus()
    held_out = text_lm.held_out_batches(corpus.held_out, args.eval_windows, args.length)
    results = {}
    with jax.set_mesh(mesh):
        for mode in args.modes:
            results[mode] = train(mode == "cgx", args, corpus, held_out)
    print(f"{mesh.size} devices, {args.steps} steps, global batch {args.batch} x "
          f"{args.length} bytes; {corpus.description}")
    measured = "its loss" if args.one_batch else "held-out"
    print(f"{'mode':6} {measured:>9} {'vs exact':>9} {'ms/step':>8} {'layouts':>8}  "
          f"collective bytes per step by type")
    for mode, r in results.items():
        gap = (f"{r['loss'] / results['exact']['loss'] - 1:+.2%}"
               if "exact" in results and mode != "exact" else "")
        types = ", ".join(f"{k} {v:,}" for k, v in sorted(r["collectives"].items()))
        print(f"{mode:6} {r['loss']:9.4f} {gap:>9} {r['ms']:8.1f} "
              f"{'kept' if r['layouts'] else 'CHANGED':>8}  {types}")
    return results


if __name__ == "__main__":
    main()
