"""Data-parallel ViT training with compressed gradient all-reduce: exact baseline vs CGX.

Trains a small Vision Transformer (Flax NNX) with ``jax.shard_map`` over all devices (8
simulated CPU devices when there is no accelerator) three ways, with the same seed and data
order: ``baseline`` (exact f32 ``lax.pmean`` of the gradients), ``cgx`` (4-bit stochastic
``cgx.compressed_allreduce``) and ``adaptive`` (per-layer bits fitted by ``cgx.fit_policy``
after a warmup). Prints a side-by-side table of test accuracy, loss, time per step and bytes
all-reduced per step.

    python examples/vit/train.py                        # digits (bundled), all modes, seed 0
    python examples/vit/train.py --seeds 0 1 2 --json metrics.json --plot curves.png
    python examples/vit/train.py --dataset cifar10 --data-dir ~/data/cifar-10-batches-py

Sharded (FSDP) training, with the parameters and the optimizer state split by rows over the
devices, written the GSPMD way (``jax.jit`` of the loss on the global batch): ``fsdp-exact``
takes ``jax.value_and_grad`` (XLA gathers each weight and reduce-scatters its gradient in
f32), ``fsdp`` swaps in ``cgx.value_and_grad`` (8-bit weights; gradients reduce-scattered at
``--bits``):

    python examples/vit/train.py --mode baseline fsdp-exact fsdp --seeds 0 1 2

Across processes, with Orbax checkpoints every 50 steps and up to 3 restarts after a crash
(each restart resumes from the newest checkpoint, bit for bit the run it continues; any mode
but ``adaptive``):

    python -m cgx_jax.launch -n 2 --devices-per-process 4 --max-restarts 3 -- \\
        python examples/vit/train.py --mode cgx --checkpoint-dir /tmp/vit-ckpt

On CPU the program waits for each step's loss before dispatching the next (many collective
programs in flight can abort the process on small machines: see the README's CPU notes).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Without an accelerator, simulate 8 devices (CPU only; GPUs are used as they are).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402
from cgx_jax.launch import ENV_PROCESS_ID, initialize, restart_count  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint  # noqa: E402
import data as datasets  # noqa: E402
from model import ViT  # noqa: E402

MODES = ("baseline", "cgx", "adaptive")  # data parallel: "all"
FSDP_MODES = ("fsdp-exact", "fsdp")
AXIS = "batch"


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", nargs="+", default=["all"], choices=(*MODES, *FSDP_MODES, "all"),
                   help="runs to train and compare (all: baseline, cgx, adaptive)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="seeds (model init, data order, rounding noise); one run per mode each")
    p.add_argument("--dataset", default="digits", choices=("digits", "cifar10"))
    p.add_argument("--data-dir", default=None, help="folder of the CIFAR-10 python batches")
    # Training.
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--steps", type=int, default=None, help="total steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over devices")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    p.add_argument("--warmup", type=float, default=0.1, help="warmup, fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--shift", type=int, default=0,
                   help="augmentation: random shift of up to this many pixels (0: none)")
    # Model.
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch", type=int, default=4,
                   help="patch size (digits 8x8: 4 tokens; cifar10 32x32: 64 tokens)")
    p.add_argument("--mlp-ratio", type=float, default=2.0)
    # Compression.
    p.add_argument("--bits", type=int, default=4, help="bits of the cgx mode")
    p.add_argument("--bucket-size", type=int, default=128)
    p.add_argument("--min-size", type=int, default=1024,
                   help="leaves with fewer values stay exact (LayerPolicy.min_size)")
    p.add_argument("--budget-bits", type=float, default=4.0, help="adaptive: mean bits budget")
    p.add_argument("--adapt-after", type=int, default=None,
                   help="adaptive: warmup steps before fitting the policy (default: one epoch)")
    p.add_argument("--error-feedback", action="store_true",
                   help="cgx: error feedback (a residual per device, in the optimizer state)")
    # Checkpoints.
    p.add_argument("--checkpoint-dir", default=None,
                   help="save Orbax checkpoints here and resume from the newest one found "
                        "(one run: one --mode, not adaptive, and one seed)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    # Output.
    p.add_argument("--tiny", action="store_true",
                   help="smoke-test size: depth 1, width 32, 2 heads, 4 steps, batch 64")
    p.add_argument("--json", default=None, metavar="PATH", help="write the metrics as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the runs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="print the per-leaf policy summaries")
    args = p.parse_args(argv)
    if args.tiny:
        args.depth, args.dim, args.heads, args.batch_size = 1, 32, 2, 64
        args.steps = args.steps or 4
    modes = tuple(m for m in (*MODES, *FSDP_MODES)
                  if m in args.mode or ("all" in args.mode and m in MODES))
    args.modes = modes
    if args.checkpoint_dir and (len(modes) != 1 or modes[0] == "adaptive"
                                or len(args.seeds) != 1):
        raise SystemExit(f"--checkpoint-dir resumes one run: give one --mode (not adaptive) "
                         f"and one seed, not --mode {' '.join(args.mode)} --seeds "
                         f"{' '.join(map(str, args.seeds))}")
    if args.checkpoint_every < 1:
        raise SystemExit(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    return args


def cgx_policy(args) -> cgx.LayerPolicy:
    # The default LayerPolicy keeps leaves under 16,384 values exact, which is every matrix of
    # a ViT this small: lower min_size so the attention and MLP matrices are compressed.
    return cgx.LayerPolicy(default=cgx.Codec(bits=args.bits, bucket_size=args.bucket_size),
                           min_size=args.min_size)


def fit_adaptive_policy(grads, args) -> cgx.LayerPolicy:
    """Per-layer bits from one batch's gradients (``cgx.fit_policy``), on the byte budget of
    uniform ``--budget-bits``."""
    return cgx.fit_policy(grads, budget_bits=args.budget_bits, bucket_size=args.bucket_size,
                          base=cgx_policy(args))


def fsdp_weights(args, mode):
    """The layer policy of the weights ``fsdp`` gathers: 8 bits, nearest rounding, the
    matrices of at least ``--min-size`` values (None: ``fsdp-exact``, no compression)."""
    if mode != "fsdp":
        return None
    return cgx.LayerPolicy(default=cgx.Codec(bits=8, bucket_size=args.bucket_size,
                                             rounding="nearest"), min_size=args.min_size)


def wire_stats(policy, params, mode, args):
    """(bytes one participant sends per step, f32 bytes, per-leaf bits of the gradients)
    under ``policy`` (``None``: exact f32), counted as ``cgx.summary`` does (compressed
    leaves padded to whole buckets). FSDP modes gather the weights and reduce-scatter the
    gradients: twice the bytes, the weights at ``fsdp_weights``."""
    leaves = jax.tree.leaves(params)
    f32 = sum(4 * x.size for x in leaves)
    wire = f32 if policy is None else cgx.tree_wire_bytes(policy, params)
    if mode in FSDP_MODES:
        weights = fsdp_weights(args, mode)
        f32, wire = 2 * f32, wire + (f32 if weights is None
                                     else cgx.tree_wire_bytes(weights, params))
    codecs = [None] * len(leaves) if policy is None else policy.resolve_leaves(params)
    bits = {name: (32 if c is None else c.bits)
            for name, c in zip(cgx.leaf_paths(params), codecs)}
    return int(wire), int(f32), bits


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------

def exact_pmean():
    """The baseline all-reduce: exact f32 ``lax.pmean`` of the gradients."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (jax.lax.pmean(updates, AXIS), state))


def make_optimizer(allreduce, args, total_steps):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, int(args.warmup * total_steps)), total_steps, args.lr * 0.01)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(allreduce, optax.adamw(schedule, weight_decay=args.weight_decay,
                                              mask=decay_mask))


def loss_fn(graphdef, params, x, y, num_classes, smoothing):
    logits = nnx.merge(graphdef, params)(x)
    labels = optax.smooth_labels(jax.nn.one_hot(y, num_classes), smoothing)
    return optax.softmax_cross_entropy(logits, labels).mean()


def make_train_step(graphdef, tx, mesh, num_classes, smoothing, state_specs):
    """One jitted data-parallel step: params replicated, the optimizer state laid out by
    ``state_specs`` (replicated but for an error-feedback residual, one row per device), the
    global batch split over ``AXIS``; each device's gradient is local and ``tx`` (its first
    link) all-reduces it, so every replica applies the same update."""

    def step(params, opt_state, x, y):
        # Local loss and gradients: jax.grad of the replicated params would reduce them
        # exactly first (shard_map's check_vma typing), and tx would then reduce them again.
        loss, grads = cgx.local_value_and_grad(
            lambda p: loss_fn(graphdef, p, x, y, num_classes, smoothing), AXIS)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

    # The all-reduced gradients are typed invariant (replicated), so shard_map's default
    # check_vma=True accepts replicated params and optimizer state as outputs.
    return jax.jit(jax.shard_map(step, mesh=mesh,
                                 in_specs=(P(), state_specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(), state_specs, P())),
                   donate_argnums=(0, 1))


def fsdp_spec(leaf, num_devices):
    """FSDP layout: a leaf whose first dimension divides by the devices is split by rows."""
    return P(AXIS) if leaf.ndim and leaf.shape[0] % num_devices == 0 else P()


def make_fsdp_step(graphdef, params, tx, mesh, num_classes, smoothing, use_cgx, args, seed):
    """One jitted FSDP step written the GSPMD way: each device holds its rows of the split
    leaves (and their Adam state), and ``jax.value_and_grad`` of the loss on the global batch
    lets XLA gather the weights and reduce-scatter their gradients in f32 (``fsdp-exact``).
    ``fsdp`` swaps in ``cgx.value_and_grad``: each split weight gathered at 8 bits
    (``fsdp_weights``), its gradient reduce-scattered at ``--bits``; the leaves that are not
    split are replicated and their gradients all-reduced (``cgx_policy``). The optimizer
    updates the f32 rows."""
    specs = jax.tree.map(lambda v: fsdp_spec(v, mesh.size), params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    state_shardings = jax.tree.map(lambda v: NamedSharding(mesh, fsdp_spec(v, mesh.size)),
                                   jax.eval_shape(tx.init, params))
    loss = lambda p, x, y: loss_fn(graphdef, p, x, y, num_classes, smoothing)  # noqa: E731
    if use_cgx:
        grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name=AXIS, param_specs=specs,
                                     policy=cgx_policy(args), key=jax.random.key(seed),
                                     weight_policy=fsdp_weights(args, "fsdp"))
    else:
        grad_fn = lambda p, x, y, step: jax.value_and_grad(loss)(p, x, y)  # noqa: E731

    @functools.partial(jax.jit, donate_argnums=(0, 1),
                       out_shardings=(shardings, state_shardings, None))
    def step(params, opt_state, x, y, step):
        value, grads = grad_fn(params, x, y, step=step)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    place = lambda tree, where: jax.tree.map(jax.device_put, tree, where)  # noqa: E731
    return step, place(params, shardings), place(tx.init(params), state_shardings)


def global_batch(x, sharding):
    """``x`` (the same host array in every process) as a global array split by ``sharding``:
    each process places only the rows of its own devices."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def make_eval(graphdef, num_classes):
    @jax.jit
    def logits_fn(params, x):
        return nnx.merge(graphdef, params)(x)

    def evaluate(params, x, y, chunk=1000):
        params = jax.device_get(params)  # evaluate once, on the default device
        logits = np.concatenate([np.asarray(logits_fn(params, x[i:i + chunk]))
                                 for i in range(0, len(x), chunk)])
        logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(
            1, keepdims=True)) - logits.max(1, keepdims=True)
        return float((logits.argmax(1) == y).mean()), float(-logp[np.arange(len(y)), y].mean())

    return evaluate


def host_gradients(graphdef, params, x, y, args, num_classes):
    """Gradients of the global batch on one device (the mean of the per-device gradients)."""
    grad_fn = jax.jit(jax.grad(
        lambda p: loss_fn(graphdef, p, x, y, num_classes, args.label_smoothing)))
    return jax.device_get(grad_fn(jax.device_get(params)))


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kwargs):
        pass

    def close(self):
        pass


def progress_bar(total, desc, show):
    if not show:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the progress bar is optional
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def train_run(mode, seed, args, ds, mesh, show_progress):
    n_dev = mesh.size
    steps_per_epoch = len(ds.x_train) // args.batch_size
    total = args.steps or args.epochs * steps_per_epoch
    model = ViT(image_size=ds.image_size, channels=ds.channels, num_classes=ds.num_classes,
                patch=args.patch, dim=args.dim, depth=args.depth, heads=args.heads,
                mlp_ratio=args.mlp_ratio, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    policy = None if mode in ("baseline", "fsdp-exact") else cgx_policy(args)

    def build(policy):
        allreduce = (exact_pmean() if policy is None
                     else cgx.compressed_allreduce(AXIS, policy=policy, key=jax.random.key(seed),
                                                   error_feedback=args.error_feedback))
        tx = make_optimizer(allreduce, args, total)
        specs = cgx.state_specs(tx.init(params), AXIS)
        return tx, make_train_step(graphdef, tx, mesh, ds.num_classes, args.label_smoothing,
                                   specs)

    if mode in FSDP_MODES:
        tx = make_optimizer(optax.identity(), args, total)
        train_step, params, opt_state = make_fsdp_step(
            graphdef, params, tx, mesh, ds.num_classes, args.label_smoothing, mode == "fsdp",
            args, seed)
    else:
        tx, train_step = build(policy)
        params = jax.device_put(params, NamedSharding(mesh, P()))
        opt_state = cgx.shard_state(tx.init(params), mesh, AXIS)
    batch_sharding = NamedSharding(mesh, P(AXIS))
    evaluate = make_eval(graphdef, ds.num_classes)
    adapt_at = (args.adapt_after if args.adapt_after is not None
                else min(steps_per_epoch, total // 2)) if mode == "adaptive" else None

    losses, evals, step_times, compile_steps = [], [], [], {0}
    step = 0
    aug_rng = np.random.default_rng([seed, 1])  # same augmentation in every mode
    checkpoints = checkpoint.manager(args.checkpoint_dir) if args.checkpoint_dir else None
    saved = checkpoints.latest_step() if checkpoints else None
    if saved is not None:
        (params, opt_state), host = checkpoint.restore(checkpoints, saved, (params, opt_state))
        step, losses, evals = saved, host["losses"], host["evals"]
        aug_rng.bit_generator.state = host["data_rng"]
        print(f"resumed from the checkpoint of step {step} in {args.checkpoint_dir} "
              f"(restart {restart_count()})", flush=True)
    epoch, done_in_epoch = divmod(step, steps_per_epoch)

    def save_checkpoint():  # the state after `step` steps, and where the data stands
        checkpoint.save(checkpoints, step, (params, opt_state), {
            "losses": losses, "evals": evals, "data_rng": aug_rng.bit_generator.state})

    bar = progress_bar(total, f"{mode} seed {seed}", show_progress)
    bar.update(step)
    while step < total:
        batches = datasets.epoch_batches(len(ds.x_train), args.batch_size, seed, epoch)
        for idx in itertools.islice(batches, done_in_epoch, None):
            if step == adapt_at:  # adaptive: fit per-layer bits once, rebuild the step
                grads = host_gradients(graphdef, params, ds.x_train[idx], ds.y_train[idx], args,
                                       ds.num_classes)
                policy = fit_adaptive_policy(grads, args)
                tx, train_step = build(policy)  # same state structure: opt_state carries over
                compile_steps.add(step)
            x = datasets.random_shift(ds.x_train[idx], aug_rng, args.shift)
            x, y = (global_batch(a, batch_sharding) for a in (x, ds.y_train[idx]))
            start = time.perf_counter()
            if mode in FSDP_MODES:  # the rounding noise is folded from the step
                params, opt_state, loss = train_step(params, opt_state, x, y, np.int32(step))
            else:
                params, opt_state, loss = train_step(params, opt_state, x, y)
            loss = float(loss)  # wait for every step: bounds the collectives in flight
            step_times.append(time.perf_counter() - start)
            losses.append(loss)
            step += 1
            bar.update(1)
            if step % 5 == 0 or step == total:
                recent = [t for i, t in enumerate(step_times[-5:], len(step_times) - 5)
                          if i not in compile_steps] or step_times[-1:]
                bar.set_postfix(loss=f"{loss:.3f}",
                                img_s=f"{args.batch_size / np.mean(recent):.0f}")
            if step == total:
                break
            if checkpoints and step % args.checkpoint_every == 0:
                save_checkpoint()
        epoch, done_in_epoch = epoch + 1, 0
        if step % steps_per_epoch == 0 or step == total:
            acc, test_loss = evaluate(params, ds.x_test, ds.y_test)
            evals.append({"step": step, "test_accuracy": acc, "test_loss": test_loss})
    bar.close()
    if checkpoints and step != saved:  # the final state, with the final evaluation
        save_checkpoint()
    if checkpoints:
        checkpoints.close()
    if mode == "adaptive" and args.verbose:
        print(f"adaptive policy (fitted at step {adapt_at}):")
        print(cgx.summary(policy, jax.device_get(params)))

    timed = [t for i, t in enumerate(step_times) if i not in compile_steps]
    wire, f32, bits = wire_stats(policy, jax.device_get(params), mode, args)
    last = losses[-min(len(losses), steps_per_epoch):]
    return {
        "mode": mode,
        "seed": seed,
        "policy": describe_policy(mode, args),
        "steps": total,
        "devices": n_dev,
        "test_accuracy": evals[-1]["test_accuracy"],
        "test_loss": evals[-1]["test_loss"],
        "final_loss": float(np.mean(last)),  # mean train loss over the last epoch
        "step_time_s": float(np.mean(timed)) if timed else float("nan"),
        "compile_and_first_step_s": float(step_times[0]),
        "bytes_per_step": wire,
        "f32_bytes_per_step": f32,
        "compression_vs_f32": f32 / wire,
        "adapted_at_step": adapt_at,
        "layer_bits": bits,
        "loss_history": losses,
        "eval_history": evals,
    }


def describe_policy(mode, args):
    if mode == "baseline":
        return "exact f32 pmean"
    if mode == "cgx":
        return f"{args.bits} bit/{args.bucket_size} stochastic"
    if mode == "fsdp-exact":
        return "FSDP, exact f32"
    if mode == "fsdp":
        return f"FSDP, 8b weights, {args.bits}b grads"
    return f"fit_policy, budget {args.budget_bits:g} bits"


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------

def results_table(runs, modes, seeds):
    lines = [f"{'mode':<9} {'policy':<26} {'test acc':>8} {'final loss':>10} {'test loss':>9} "
             f"{'ms/step':>8} {'bytes/step':>11} {'vs f32':>7}"]
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        mean = lambda k: float(np.mean([r[k] for r in rs]))  # noqa: E731
        lines.append(
            f"{mode:<9} {rs[0]['policy']:<26} {100 * mean('test_accuracy'):>7.2f}% "
            f"{mean('final_loss'):>10.4f} {mean('test_loss'):>9.4f} "
            f"{1e3 * mean('step_time_s'):>8.1f} {int(mean('bytes_per_step')):>11,} "
            f"{mean('compression_vs_f32'):>6.1f}x")
    if len(seeds) > 1:
        lines += ["", "test accuracy (%) per seed", f"{'mode':<9} " + " ".join(
            f"{'seed ' + str(s):>8}" for s in seeds) + f" {'mean':>8} {'vs baseline':>11}"]
        base = [r["test_accuracy"] for r in runs if r["mode"] == "baseline"]
        for mode in modes:
            accs = [r["test_accuracy"] for s in seeds for r in runs
                    if r["mode"] == mode and r["seed"] == s]
            if not accs:
                continue
            delta = (f"{100 * (np.mean(accs) - np.mean(base)):>+10.2f}p" if base else "")
            lines.append(f"{mode:<9} " + " ".join(f"{100 * a:>8.2f}" for a in accs)
                         + f" {100 * np.mean(accs):>8.2f} {delta:>11}")
    return "\n".join(lines)


def summarize(runs, modes, seeds):
    out = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        if rs:
            out[mode] = {
                "test_accuracy_mean": float(np.mean([r["test_accuracy"] for r in rs])),
                "test_accuracy_per_seed": {str(r["seed"]): r["test_accuracy"] for r in rs},
                "final_loss_mean": float(np.mean([r["final_loss"] for r in rs])),
                "step_time_s_mean": float(np.mean([r["step_time_s"] for r in rs])),
                "bytes_per_step": rs[0]["bytes_per_step"],
                "compression_vs_f32": rs[0]["compression_vs_f32"],
            }
    return out


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_bits) = plt.subplots(1, 3, figsize=(17, 4.5),
                                                   gridspec_kw={"width_ratios": [1, 1, 1.6]})
    colors = {"baseline": "tab:blue", "cgx": "tab:orange", "adaptive": "tab:green",
              "fsdp-exact": "tab:purple", "fsdp": "tab:red"}
    seen = set()
    for r in runs:
        label = r["mode"] if r["mode"] not in seen else None
        seen.add(r["mode"])
        losses = np.asarray(r["loss_history"])
        window = max(1, min(10, len(losses) // 10))
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax_loss.plot(np.arange(window, len(losses) + 1), smooth, color=colors[r["mode"]],
                     alpha=0.8, label=label)
        ax_acc.plot([e["step"] for e in r["eval_history"]],
                    [100 * e["test_accuracy"] for e in r["eval_history"]],
                    color=colors[r["mode"]], alpha=0.8, label=label)
    ax_loss.set(xlabel="step", ylabel="train loss (label-smoothed)", title="training loss")
    ax_acc.set(xlabel="step", ylabel="test accuracy (%)", title="test accuracy")
    ax_acc.set_ylim(max(0, min(80, ax_acc.get_ylim()[0])), 100)
    for ax in (ax_loss, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    compressed = [m for m in ("cgx", "adaptive") if any(r["mode"] == m for r in runs)]
    shown = compressed or ["baseline"]
    all_bits = [next(r for r in runs if r["mode"] == m)["layer_bits"] for m in shown]
    names = [n for n in all_bits[0] if any(b[n] < 32 for b in all_bits)] or list(all_bits[0])
    exact = len(all_bits[0]) - len(names)
    width = 0.8 / len(shown)
    for i, (mode, bits) in enumerate(zip(shown, all_bits)):
        ax_bits.bar(np.arange(len(names)) + i * width, [bits[n] for n in names], width,
                    color=colors[mode], label=mode)
    ax_bits.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=90, fontsize=7)
    ax_bits.set(ylabel="bits per value", title=f"per-layer bits on the wire "
                f"({exact} small or 1-D leaves exact, not shown)")
    ax_bits.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = parse_args(argv)
    if ENV_PROCESS_ID in os.environ:
        initialize()  # under python -m cgx_jax.launch: one run across the processes
    modes = list(args.modes)
    ds = datasets.load(args.dataset, args.data_dir)
    devices = jax.devices()
    if args.batch_size % len(devices):
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by the "
                         f"{len(devices)} devices")
    mesh = Mesh(np.array(devices), (AXIS,))
    steps_per_epoch = len(ds.x_train) // args.batch_size
    total = args.steps or args.epochs * steps_per_epoch

    probe = nnx.state(ViT(image_size=ds.image_size, channels=ds.channels,
                          num_classes=ds.num_classes, patch=args.patch, dim=args.dim,
                          depth=args.depth, heads=args.heads, mlp_ratio=args.mlp_ratio,
                          rngs=nnx.Rngs(0)), nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(probe))
    print(f"{ds.name}: {len(ds.x_train)} train / {len(ds.x_test)} test images "
          f"{ds.x_train.shape[1:]}, {ds.num_classes} classes")
    print(f"ViT: patch {args.patch}, width {args.dim}, depth {args.depth}, {args.heads} heads, "
          f"mlp ratio {args.mlp_ratio:g}: {n_params:,} parameters in "
          f"{len(jax.tree.leaves(probe))} leaves")
    print(f"data parallel over {len(devices)} {devices[0].platform} devices: global batch "
          f"{args.batch_size} ({args.batch_size // len(devices)} per device), {total} steps "
          f"({total / steps_per_epoch:.1f} epochs), AdamW peak lr {args.lr:g} warmup-cosine, "
          f"label smoothing {args.label_smoothing:g}")
    if "cgx" in modes or "adaptive" in modes:
        policy = cgx_policy(args)
        wire, f32, bits = wire_stats(policy, probe, "cgx", args)
        n_comp = sum(b < 32 for b in bits.values())
        print(f"cgx policy: {describe_policy('cgx', args)} for matrices of >= {args.min_size} "
              f"values: {n_comp} of {len(bits)} leaves compressed, {wire:,} bytes all-reduced "
              f"per step vs {f32:,} in f32 ({f32 / wire:.1f}x)")
        if args.verbose:
            print(cgx.summary(policy, probe))
    print()

    show_progress = not args.quiet and sys.stderr.isatty()
    runs = []
    for seed in args.seeds:
        for mode in modes:
            run = train_run(mode, seed, args, ds, mesh, show_progress)
            runs.append(run)
            if not args.quiet:
                print(f"{mode:<9} seed {seed}: test acc {100 * run['test_accuracy']:.2f}%, "
                      f"final loss {run['final_loss']:.4f}, "
                      f"{1e3 * run['step_time_s']:.1f} ms/step"
                      + (f" (policy fitted at step {run['adapted_at_step']})"
                         if mode == "adaptive" else ""), flush=True)
    print()
    print(results_table(runs, modes, args.seeds))
    print("\nms/step: mean wall time of a step after compilation (waits for the loss). "
          "bytes/step: what one participant all-reduces per step (compressed leaves padded to "
          "whole buckets; FSDP: its gathers and reduce-scatters), vs f32: ratio to the same "
          "in f32.")

    metrics = {
        "config": {k: v for k, v in vars(args).items() if k != "modes"},
        "dataset": ds.name,
        "devices": len(devices),
        "platform": devices[0].platform,
        "parameters": int(n_params),
        "modes": modes,
        "runs": runs,
        "summary": summarize(runs, modes, args.seeds),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(metrics, f, indent=1)
        print(f"metrics written to {args.json}")
    if args.plot:
        plot(runs, args.plot)
        print(f"plot written to {args.plot}")
    return metrics


if __name__ == "__main__":
    main()
