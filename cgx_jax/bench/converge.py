"""Accuracy at equal steps, and time to the same accuracy: ``python -m cgx_jax.bench converge``.

Trains the same model from the same initialisation on the same batches once per mode, on
``--participants`` simulated CPU devices of one process (a ``jax.jit`` step, the batch split
over the data axis, parameters replicated), and measures the held-out loss every
``--eval-every`` steps:

- ``exact``: ``jax.value_and_grad``, XLA's f32 all-reduce of the gradients (the baseline);
- ``cgx``: ``cgx.value_and_grad`` with the library's defaults (``LayerPolicy()``: 4 bits
  stochastic, buckets of 128, leaves of 16,384+ values and 2+ dimensions);
- ``cgx ef``: the same with ``error_feedback=True`` (the residual carried step to step);
- ``adaptive``: per-layer bits fitted by ``cgx.fit_policy`` (its default relative errors)
  on the first batch's summed gradient, within uniform 4 bits' bytes;
- the variants (only when ``--modes`` names them): the defaults with one thing changed:
  ``cgx 8b``, ``cgx bucket 256``, ``cgx bucket 1024`` (the default before 0.1.0's change),
  ``cgx uncompressed`` (every leaf exact, through the per-participant path), ``cgx exact
  embed``, ``cgx exact out`` (the embedding or the output layer exact), ``cgx ef nearest``
  (error feedback with nearest rounding), ``adaptive squared`` (fitted on squared errors,
  ``fit_policy``'s measure before 0.1.0's change).

Every mode uses AdamW with a linear warmup and a cosine decay to a tenth, so the exact
held-out loss flattens by the last step. Tasks: ``lm`` (``text_lm``), a byte-level decoder on
the Python standard library's sources (offline on every machine); ``digits`` (``digits``),
``bench train``'s ViT on scikit-learn's handwritten digits under pixel noise, with held-out
accuracy.

Time at a link rate: with ``--profile PATH`` (what ``python -m cgx_jax.bench link`` wrote for
``--participants`` processes on a network), each mode's step time is one participant's
compute, timed here on one device with its share of the batch (the step with no
all-reduce), plus the all-reduce that ``cgx.estimate`` predicts for the mode's policy on that
profile (docs/design.md section 11). From it: the time each mode takes to reach the exact
run's final held-out loss (first at an evaluation step, so within ``--eval-every`` steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable

from cgx_jax.bench.common import cpu_description

MODES = ("exact", "cgx", "cgx ef", "adaptive")
# Variants of the defaults, run only when --modes names them, to find where the defaults'
# error matters: more bits, smaller buckets, the token embedding or the output layer (the
# LM's out, the ViT's head) sent exact. Each is
# LayerPolicy() with one field changed (built from the cgx_jax module, imported late).
VARIANTS = {
    "cgx 8b": lambda cgx: cgx.LayerPolicy(default=cgx.Codec(bits=8)),
    "cgx bucket 256": lambda cgx: cgx.LayerPolicy(default=cgx.Codec(bucket_size=256)),
    "cgx bucket 1024": lambda cgx: cgx.LayerPolicy(default=cgx.Codec(bucket_size=1024)),
    # Every leaf exact, through cgx's per-participant path: the run-to-run spread of a
    # trajectory that differs from exact's only in rounding.
    "cgx uncompressed": lambda cgx: cgx.LayerPolicy(default=None),
    "cgx exact embed": lambda cgx: cgx.LayerPolicy(exclude=("^embed",)),
    "cgx exact out": lambda cgx: cgx.LayerPolicy(exclude=("^out$", "^head/")),
    "cgx ef nearest": lambda cgx: cgx.LayerPolicy(default=cgx.Codec(rounding="nearest")),
}
# Fitted on the first batch, with fit_policy's error measure.
ADAPTIVE = {"adaptive": "relative", "adaptive squared": "squared"}
AXIS = "data"
TASKS = ("lm", "digits")
# Each task's model and training, where the command line leaves them out.
TASK_DEFAULTS = {
    "lm": dict(steps=3000, batch=32, width=128, depth=2, heads=4, lr=3e-3, warmup=50,
               eval_every=50),
    "digits": dict(steps=600, batch=128, width=128, depth=4, heads=4, lr=3e-3, warmup=50,
                   eval_every=25),
}


@dataclasses.dataclass(frozen=True)
class Task:
    """What the benchmark trains: initial ``params``; ``loss(params, *batch)``;
    ``batch(step)``, the global batch of a step (numpy arrays split over the participants
    by their first dimension); the ``held_out`` arrays; ``accuracy(params, *held_out)`` for a
    classification task, else None; ``notes`` for the report."""

    params: dict
    loss: Callable
    batch: Callable
    held_out: tuple
    accuracy: Callable | None
    notes: list


def lm_task(args) -> Task:
    """``text_lm``'s decoder on the standard library's sources."""
    import jax

    from cgx_jax.bench import text_lm

    corpus = text_lm.corpus()
    config = text_lm.LMConfig(width=args.width, depth=args.depth, heads=args.heads,
                              length=args.length)
    return Task(
        params=text_lm.init(jax.random.key(args.seed), config),
        loss=functools.partial(text_lm.loss, config=config),
        batch=lambda step: (text_lm.train_batch(corpus.train, step, args.batch, args.length,
                                                args.seed),),
        held_out=(text_lm.held_out_batches(corpus.held_out, args.eval_windows, args.length),),
        accuracy=None,
        notes=[corpus.description, f"byte-level decoder: width {config.width}, depth "
                                   f"{config.depth}, {config.heads} heads, context "
                                   f"{config.length} bytes; held-out loss in nats per byte on "
                                   f"{args.eval_windows} windows"])


def digits_task(args) -> Task:
    """``bench train``'s ViT on ``digits``' noisy handwritten digits."""
    import jax
    import jax.numpy as jnp
    import optax

    from cgx_jax.bench import digits
    from cgx_jax.bench.train import vit_apply, vit_init

    train, held_out, description = digits.load(args.noise)

    def loss(params, images, labels):
        logits = vit_apply(params, images, heads=args.heads)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def accuracy(params, images, labels):
        return jnp.mean(jnp.argmax(vit_apply(params, images, heads=args.heads), -1) == labels)

    return Task(
        params=vit_init(jax.random.key(args.seed), args.width, args.depth, 2 * args.width,
                        image=8, channels=1, patch=2, classes=digits.CLASSES),
        loss=loss,
        batch=lambda step: digits.train_batch(train, step, args.batch, args.noise, args.seed),
        held_out=held_out, accuracy=accuracy,
        notes=[description, f"ViT: patch 2 (16 patches), width {args.width}, depth "
                            f"{args.depth}, {args.heads} heads, MLP {2 * args.width}; "
                            f"held-out cross entropy and accuracy on every held-out image"])


# --------------------------------------------------------------------------- training

def with_residual(mode: str) -> bool:
    """Whether ``mode`` carries an error-feedback residual (``cgx ef``, ``cgx ef nearest``)."""
    return mode.startswith("cgx ef")


def _policies(modes, mesh, task) -> dict:
    """Each mode's gradient policy (None: exact)."""
    import cgx_jax as cgx
    from cgx_jax.bench.train import summed_gradient

    policies, table = {}, None
    for mode in modes:
        if mode == "exact":
            policies[mode] = None
        elif mode in ADAPTIVE:
            if table is None:  # one measurement serves both error measures
                table = cgx.layer_errors(summed_gradient(
                    mesh, AXIS, lambda p, batch: task.loss(p, *batch), task.params,
                    task.batch(0)))
            policies[mode] = cgx.fit_policy(table, budget_bits=4.0, base=cgx.LayerPolicy(),
                                            error=ADAPTIVE[mode])
        else:
            policies[mode] = VARIANTS[mode](cgx) if mode in VARIANTS else cgx.LayerPolicy()
    return policies


def _step_fn(mode, policy, mesh, loss_fn, tx, seed):
    """The jitted step ``(params, opt_state, residual, batch, i) -> (params, opt_state,
    residual, loss)`` of ``mode`` (``residual`` is None but under ``cgx ef*``)."""
    import jax
    import optax

    import cgx_jax as cgx

    if mode == "exact":
        grad_fn = jax.value_and_grad(loss_fn)
    else:
        grad_fn = cgx.value_and_grad(loss_fn, mesh=mesh, axis_name=AXIS, policy=policy,
                                     key=jax.random.key(seed),
                                     error_feedback=with_residual(mode))

    @jax.jit
    def step(params, opt_state, residual, batch, i):
        if mode == "exact":
            loss, grads = grad_fn(params, *batch)
        elif residual is not None:
            loss, grads, residual = grad_fn(params, *batch, step=i, residual=residual)
        else:
            loss, grads = grad_fn(params, *batch, step=i)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, residual, loss

    return step, grad_fn


def _train(mode, policy, args, mesh, task, tx) -> dict:
    """One mode's run: the held-out loss (and accuracy) at step 0 and every ``eval_every``
    steps, and the mean training loss of each evaluation interval."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    params = jax.device_put(task.params, replicated)
    opt_state = jax.device_put(tx.init(task.params), replicated)
    step, grad_fn = _step_fn(mode, policy, mesh, task.loss, tx, args.seed)
    residual = (cgx.init_residual(params, mesh=mesh, axis_name=AXIS, policy=grad_fn)
                if with_residual(mode) else None)
    held = jax.device_put(task.held_out, replicated)
    evaluate = jax.jit(lambda p: (task.loss(p, *held),
                                  task.accuracy(p, *held) if task.accuracy else jnp.nan))
    curve, accuracy, train_losses, interval = [], [], [], []

    def record(i):
        loss, acc = evaluate(params)
        curve.append((i, float(loss)))
        accuracy.append((i, float(acc)))

    record(0)
    start = time.perf_counter()
    for i in range(args.steps):
        batch = jax.device_put(task.batch(i), rows)
        params, opt_state, residual, loss = step(params, opt_state, residual, batch,
                                                 jnp.int32(i))
        interval.append(float(loss))  # waits: one program in flight (design.md section 9)
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            record(i + 1)
            train_losses.append(float(np.mean(interval)))
            interval = []
            print(f"  {mode:<9} step {i + 1:>5}  held-out {curve[-1][1]:.4f}  "
                  f"train {train_losses[-1]:.4f}", file=sys.stderr, flush=True)
    return dict(mode=mode, curve=curve, train=train_losses,
                accuracy=accuracy if task.accuracy else None,
                seconds=time.perf_counter() - start)


def _compute_seconds(args, task, tx) -> float:
    """One participant's step without an all-reduce: the gradient of its share of the batch
    and the optimizer, jitted on one device (median of 10 after 3)."""
    import jax
    import optax

    from cgx_jax.bench.common import median_seconds

    share = tuple(a[:len(a) // args.participants] for a in task.batch(0))

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(task.loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(task.params)
    return median_seconds(lambda: step(task.params, opt_state, share), repeats=10)


# --------------------------------------------------------------------------- summary

def allreduce_seconds(sizes: dict, profile) -> float:
    """The all-reduce of ``sizes`` on a ``LinkProfile``: exact, one ``psum`` per leaf;
    compressed, a packet per codec and one fused ``psum`` of the exact leaves."""
    if not sizes["values"]:
        return profile.exact_seconds(sizes["exact_bytes"], sizes["exact_leaves"])
    return profile.allreduce_seconds(sizes["wire"], sizes["values"], sizes["buffers"],
                                     sizes["exact_bytes"])


def first_reaching(curve, target: float) -> int | None:
    """The first evaluated step whose held-out loss is at most ``target``, or None.

    Example:
        >>> first_reaching([(0, 5.0), (10, 2.0), (20, 1.5)], 1.9)
        20
    """
    return next((step for step, loss in curve if loss <= target), None)


def summarise(result: dict, profile=None) -> list[dict]:
    """One row per mode of ``result``: the final held-out loss (and accuracy) and its gap to
    exact's, the bytes per step, the steps to reach exact's final held-out loss, and the
    steps exact takes to reach this mode's final loss; with a ``LinkProfile``, the step's
    seconds on it (the measured compute plus the predicted all-reduce) and those steps in
    seconds: speed at equal accuracy, both ways."""
    runs = result["runs"]
    exact = runs["exact"]["curve"] if "exact" in runs else None
    seconds = {mode: None if profile is None else
               result["compute_seconds"] + allreduce_seconds(result["sizes"][mode], profile)
               for mode in runs}

    def times(steps, mode):
        return None if steps is None or seconds[mode] is None else steps * seconds[mode]

    rows = []
    for mode, run in runs.items():
        final, sizes = run["curve"][-1][1], result["sizes"][mode]
        reach = first_reaching(run["curve"], exact[-1][1]) if exact else None
        exact_reach = first_reaching(exact, final) if exact else None
        rows.append(dict(
            mode=mode, final=final, gap=final / exact[-1][1] - 1 if exact else None,
            accuracy=run["accuracy"][-1][1] if run.get("accuracy") else None,
            wire=sizes["wire"] + sizes["exact_bytes"], step_seconds=seconds[mode],
            seconds=times(run["curve"][-1][0], mode),
            steps_to_exact=reach, seconds_to_exact=times(reach, mode),
            exact_steps_to_this=exact_reach,
            exact_seconds_to_this=times(exact_reach, "exact") if exact else None))
    return rows


def load_profile(path: str, participants: int):
    """The ``LinkProfile`` at ``path``; a ``ValueError`` unless it is one measured across
    ``participants`` processes."""
    from cgx_jax._src.link_model import LinkProfile

    try:
        profile = LinkProfile.load(path)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--profile {path!r} is not a profile bench link wrote: {e}") from None
    if profile.processes != participants:
        raise ValueError(f"--profile {path!r} was measured across {profile.processes} "
                         f"processes; the run has {participants} participants (they must "
                         f"match)")
    return profile


def with_profile(result: dict, path: str) -> dict:
    """``result`` with its rows timed on the link profile at ``path``."""
    profile = load_profile(path, result["participants"])
    note = (f"s/step at link: the compute above + the all-reduce that cgx.estimate's model "
            f"predicts on {path} ({profile.description or 'no description'})")
    return {**result, "rows": summarise(result, profile), "notes": result["notes"] + [note]}


# --------------------------------------------------------------------------- reports

def _gap(value) -> str:
    return "" if value is None else f"{100 * value:+.2f}%"


def _number(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _table_rows(result) -> list[list[str]]:
    checkpoints = result["checkpoints"]
    exact = dict(result["runs"]["exact"]["curve"]) if "exact" in result["runs"] else {}
    out = []
    for row in result["rows"]:
        curve = dict(result["runs"][row["mode"]]["curve"])
        at = [f"{curve[s]:.4f} ({_gap(curve[s] / exact[s] - 1) if s in exact else ''})"
              for s in checkpoints]
        accuracy = [] if row.get("accuracy") is None else [f"{100 * row['accuracy']:.2f}%"]
        out.append([row["mode"], f"{row['wire']:,}", *at, f"{row['final']:.4f}",
                    _gap(row["gap"]) or "-", *accuracy, _number(row["steps_to_exact"]),
                    _number(row["exact_steps_to_this"]), _number(row["step_seconds"], ".3f"),
                    _number(row["seconds"], ".1f"), _number(row["seconds_to_exact"], ".1f"),
                    _number(row["exact_seconds_to_this"], ".1f")])
    return out


def _headers(result) -> list[str]:
    accuracy = ["held-out accuracy"] if result["rows"][0].get("accuracy") is not None else []
    return (["mode", "bytes/step"] + [f"step {s} (vs exact)" for s in result["checkpoints"]]
            + ["final held-out", "vs exact", *accuracy, "steps to exact's final",
               "exact's steps to this final", "s/step at link", "s in all",
               "s to exact's final", "exact's s to this final"])


def format_table(result) -> str:
    rows = [_headers(result)] + _table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


def format_markdown(result, title: str) -> str:
    headers = _headers(result)
    lines = [f"### {title}", "", "| " + " | ".join(headers) + " |",
             "|:---|" + "---:|" * (len(headers) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in _table_rows(result)]
    return "\n".join(lines) + "\n"


def plot(results: list, path: str) -> None:
    """A column per result (task): its held-out loss per step, each mode's gap to exact in
    percent, and its held-out accuracy where the task has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 + any(r["rows"][0].get("accuracy") is not None for r in results)
    fig, axes = plt.subplots(panels, len(results), figsize=(6 * len(results), 3.2 * panels),
                             squeeze=False)
    for column, result in enumerate(results):
        runs = result["runs"]
        loss, gap = axes[0, column], axes[1, column]
        exact = dict(runs["exact"]["curve"]) if "exact" in runs else None
        for i, (mode, run) in enumerate(runs.items()):
            style = dict(label=mode, color=f"C{i}")  # a mode's colour in every panel
            steps, losses = zip(*run["curve"][1:])
            loss.plot(steps, losses, **style)
            if exact is not None and mode != "exact":
                gap.plot(steps, [100 * (v / exact[s] - 1) for s, v in run["curve"][1:]],
                         **style)
            if run.get("accuracy"):
                axes[2, column].plot(*zip(*((s, 100 * a) for s, a in run["accuracy"][1:])),
                                     **style)
        loss.set_title(result["title"], fontsize=9)
        loss.set_ylabel("held-out loss")
        loss.set_yscale("log")
        gap.axhline(0, color="black", linewidth=0.5)
        gap.set_ylabel("held-out loss vs exact (%)")
        low, high = gap.get_ylim()  # the early steps' gaps can dwarf the rest: at most 25%
        gap.set_ylim(max(low, -25), min(high, 25))
        for ax in axes[:2, column]:
            ax.legend(fontsize=8)
        if panels == 3 and runs[next(iter(runs))].get("accuracy"):
            axes[2, column].set_ylabel("held-out accuracy (%)")
            axes[2, column].legend(fontsize=8)
        elif panels == 3:
            axes[2, column].axis("off")
        gap.set_xlabel("step")
        axes[-1, column].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(results: list, args) -> None:
    """Prints each result's title, CPU, notes and table; writes ``--json`` (one measured
    result), ``--markdown`` (every table) and ``--plot`` (every result, side by side)."""
    for result in results:
        print(f"# {result['title']}")
        print(f"# CPU: {result['cpu']}")
        for note in result["notes"]:
            print(f"# {note}")
        print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0], f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(format_markdown(r, f"`{r['command']}`: {r['title']}")
                              for r in results))
    if args.plot:
        plot(results, args.plot)


# --------------------------------------------------------------------------- main

def run(args) -> dict:
    """Trains every mode and returns the result: the runs' curves, the summary rows and
    what the run was."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from cgx_jax._src.link_model import allreduce_sizes

    task = lm_task(args) if args.task == "lm" else digits_task(args)
    mesh = Mesh(np.array(jax.devices()[:args.participants]), (AXIS,))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps,
                                                  args.lr / 10)
    tx = optax.adamw(schedule, weight_decay=0.01)
    policies = _policies(args.modes, mesh, task)
    runs = {mode: _train(mode, policies[mode], args, mesh, task, tx) for mode in args.modes}
    compute = _compute_seconds(args, task, tx)
    evals = [s for s, _ in next(iter(runs.values()))["curve"]]
    checkpoints = sorted({evals[1], evals[len(evals) // 4], evals[len(evals) // 2]}) \
        if len(evals) > 3 else []
    parameters = sum(leaf.size for leaf in jax.tree.leaves(task.params))
    notes = task.notes + [
        f"{parameters:,} parameters; {args.participants} participants (simulated CPU "
        f"devices), global batch {args.batch}, AdamW {args.lr:g} (warmup {args.warmup}, "
        f"cosine to {args.lr / 10:g}, weight decay 0.01), {args.steps} steps, evaluated "
        f"every {args.eval_every}, seed {args.seed}",
        f"one participant's compute per step (no all-reduce), one device: "
        f"{compute * 1e3:.1f} ms"]
    command = "python -m cgx_jax.bench converge " + " ".join(args.argv)
    result = dict(command=command.strip(), title=f"held-out loss at equal steps, {args.task}",
                  cpu=cpu_description(), notes=notes, checkpoints=checkpoints, runs=runs,
                  sizes={mode: allreduce_sizes(task.params, policies[mode])
                         for mode in args.modes},
                  compute_seconds=compute, participants=args.participants,
                  parameters=parameters)
    result["rows"] = summarise(result)
    return with_profile(result, args.profile) if args.profile else result


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m cgx_jax.bench converge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="lm", choices=TASKS,
                   help="lm: a byte-level decoder on the standard library's sources; digits: "
                        "a ViT on noisy handwritten digits (needs scikit-learn)")
    variants = [*VARIANTS, *(m for m in ADAPTIVE if m not in MODES)]
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, *variants],
                   help=f"default: {' '.join(MODES)}; variants of the defaults: "
                        f"{', '.join(variants)}")
    p.add_argument("--participants", type=int, default=4,
                   help="simulated devices over the data axis (default 4)")
    defaults = ", ".join(f"{task}: {values}" for task, values in TASK_DEFAULTS.items())
    for name in ("steps", "batch", "width", "depth", "heads", "warmup", "eval-every"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"default per task ({name})")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate; defaults: "
                                                          f"{defaults}")
    p.add_argument("--length", type=int, default=128, help="lm: context, bytes")
    p.add_argument("--eval-windows", type=int, default=256, help="lm: held-out windows")
    p.add_argument("--noise", type=float, default=1.0,
                   help="digits: the pixels' noise, in standard deviations of the data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="a link profile from python -m cgx_jax.bench link for --participants "
                        "processes: adds each mode's step time at that link")
    p.add_argument("--json", default=None, help="also write the result as JSON to this path")
    p.add_argument("--markdown", default=None, help="also write the table(s) to this path")
    p.add_argument("--plot", default=None,
                   help="also write a PNG of the held-out curves (needs matplotlib)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="measure nothing: report earlier --json results (--plot draws them "
                        "side by side)")
    args = p.parse_args(argv)
    args.argv = argv
    for name, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.from_json:
        if args.json:
            p.error("--json writes a measured result; with --from-json there is none")
        results = []
        for path in args.from_json:
            with open(path) as f:
                results.append(json.load(f))
        if args.profile:
            try:
                results = [with_profile(r, args.profile) for r in results]
            except ValueError as e:
                p.error(str(e))
        write(results, args)
        return 0
    for name in ("steps", "participants", "batch", "length", "width", "depth", "heads",
                 "eval_every", "eval_windows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 0 and less than --steps {args.steps}, got "
                f"{args.warmup}")
    if args.batch % args.participants:
        p.error(f"--batch {args.batch} must divide by --participants {args.participants} "
                f"(each participant its share of the batch)")
    if args.width % args.heads:
        p.error(f"--width {args.width} must divide by --heads {args.heads}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if not (math.isfinite(args.noise) and args.noise >= 0):
        p.error(f"--noise must be a number >= 0, got {args.noise}")
    if args.profile:
        try:
            load_profile(args.profile, args.participants)
        except ValueError as e:
            p.error(str(e))
    # Read when the CPU backend starts, at the first jax.devices().
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.participants}")
    import jax

    if len(jax.devices()) < args.participants:
        p.error(f"--participants {args.participants}: this process has {len(jax.devices())} "
                f"devices (run it as its own process, before anything starts JAX's backend)")
    write([run(args)], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
