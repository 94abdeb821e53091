"""Training while the link changes (Kimad): ``python -m cgx_jax.bench adapt --processes 4
--rates 1gbit 200mbit 1gbit --phase-steps 40 --profile link.json``.

The processes run in ``bench train``'s network (a namespace per process behind ``tc tbf``
veth links, ``cgx_jax._src.netem``) and train its MLP (784-2048-2048-2048-10, Adam 1e-3,
``--batch`` synthetic examples per process from a fixed teacher, the same batches in every
mode). The link starts at the first of ``--rates``; every ``--phase-steps`` steps, between
two steps and with every process waiting, process 0 sets every link to the next rate (``tc
qdisc change``), as a shared cloud link slows and recovers. Three modes take turns step by
step, so each step of each mode meets the same rate:

- ``exact``: ``optax.chain(pmean, adam)``, the f32 all-reduce;
- ``cgx 4b``: ``cgx.compressed_allreduce`` with every compressed leaf at 4 bits (the
  library's defaults);
- ``adaptive``: the same transform with per-leaf bits fitted to a time budget
  (``cgx.refit_policy(table, cgx.AdaptiveConfig(time_budget=...), link=...)``, the error
  table measured once on the first batch's summed gradient) on the starting profile, and
  refitted whenever the link a ``cgx.LinkWatch`` re-estimates moved by more than
  ``--tolerance``. Every ``--window`` steps the watch probes the link between two steps
  (``LinkWatch.probe``: three exact psums of ``--probe-values`` f32, the fastest, the
  slowest process's, so every process refits to the same policy).

``--time-budget`` (seconds of the all-reduce) defaults to what uniform 4 bits takes on the
starting link as ``--profile`` (``python -m cgx_jax.bench link``) predicts it; the adaptive
mode's step budget is that plus its compute (the median of its settled first-phase steps
less their all-reduce as the profile predicts it). The widths it may choose are
``--choices`` (with 1 bit: on a link 5x slower, nothing wider fits a 4-bit budget).

Every step trains on a new batch; at the end of each phase every mode is evaluated on 8,192
held-out examples of the same teacher. The report, per phase and mode: the median seconds
per step once settled (the steps of the phase after its first ``--window``, before the
probe that notices a change), the mean bits per compressed value, the held-out loss and
accuracy; the adaptive mode's step budget and refits; over the whole run, each mode's
seconds (the adaptive mode's with its probes), mean bits, final loss and accuracy.
``--plot`` draws step time and mean bits against the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from cgx_jax._src.netem import parse_rate, shaped_network
from cgx_jax.bench import common, train
from cgx_jax.bench.common import (
    add_report_arguments,
    add_worker_arguments,
    ran_worker_or_report,
    run_links,
)

NS_PREFIX = "cgxadapt"
AXIS = train.AXIS
PORT = 23486
MODES = ("exact", "cgx 4b", "adaptive")
TEST_EXAMPLES = 8192  # held out, from the same teacher: each mode's test loss and accuracy


# --------------------------------------------------------------------------- worker

def _worker(args) -> None:
    """One process: the modes trained in turns through the phases; rank 0 writes the
    per-step record to ``args.out``."""
    from cgx_jax import launch as _launch

    if args.coordinator:
        os.environ[_launch.ENV_COORDINATOR] = args.coordinator
    rank, _ = _launch.initialize()

    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), (AXIS,))
    init, apply, example_shape = train.model_fns("mlp", args.mlp_hidden)
    params = init(jax.random.key(0))

    def loss_fn(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()

    teacher, steps = init(jax.random.key(1)), args.phase_steps * len(args.rates)
    batches = train.synthetic_batches(mesh, apply, teacher, example_shape, batch=args.batch,
                                      count=steps)  # a new batch every step
    test = train.synthetic_batches(mesh, apply, teacher, example_shape, count=1,
                                   batch=TEST_EXAMPLES // mesh.size, first=steps)[0]
    evaluate = _evaluation(mesh, apply)
    runs = {mode: _Run(mode, args, mesh, params, loss_fn, batches[0]) for mode in args.modes}
    for step in range(steps):
        if step and step % args.phase_steps == 0:
            _change_rate(args, rank, args.rates[step // args.phase_steps])
        for run in runs.values():
            run.step(batches[step])
        if (step + 1) % args.phase_steps == 0:
            for run in runs.values():
                run.tests.append(evaluate(run.params, test))
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"  step {step + 1}: " + ", ".join(
                f"{mode} {run.times[-1]:.3f} s loss {run.losses[-1]:.4f}"
                for mode, run in runs.items()), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({mode: run.record() for mode, run in runs.items()}, f)
    multihost_utils.sync_global_devices("cgx_bench_adapt_done")


def _evaluation(mesh, apply):
    """``evaluate(params, test) -> {"loss", "accuracy"}`` on the held-out batch, each
    participant its shard."""
    import functools

    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    def sums(params, test):
        x, y = test
        logits = apply(params, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
        return jax.lax.psum((loss, (logits.argmax(-1) == y).sum()), AXIS)

    def evaluate(params, test) -> dict:
        loss, correct = (float(v.addressable_shards[0].data) for v in sums(params, test))
        return dict(loss=loss / test[1].shape[0], accuracy=correct / test[1].shape[0])

    return evaluate


def _change_rate(args, rank: int, rate: str) -> None:
    """Every link to ``rate``, set by process 0 while every process waits (no step's traffic
    in flight)."""
    from jax.experimental import multihost_utils

    from cgx_jax._src.netem import set_rate

    multihost_utils.sync_global_devices(f"cgx_bench_adapt_before_{rate}")
    if rank == 0 and args.shaped:
        set_rate(args.netns_prefix, args.processes, rate)
        print(f"  links set to {rate}", flush=True)
    multihost_utils.sync_global_devices(f"cgx_bench_adapt_after_{rate}")


class _Run:
    """One mode's training: its compiled step per policy, parameters, state and record; the
    adaptive mode's watch and refits."""

    def __init__(self, mode, args, mesh, params, loss_fn, batch):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        import cgx_jax as cgx

        self.mode, self.mesh, self.loss_fn, self.tree = mode, mesh, loss_fn, params
        self.params = jax.device_put(params, NamedSharding(mesh, P()))
        self.policy = None if mode == "exact" else cgx.LayerPolicy()  # 4 bits
        self.watch = None
        if mode == "adaptive":
            link = cgx.LinkProfile.load(args.profile)
            self.budget = args.time_budget or cgx.estimate(
                params, link, policies={"4b": self.policy}).policies[0].seconds
            self.config = cgx.AdaptiveConfig(time_budget=self.budget,
                                             choices=tuple(args.choices))
            self.table = self._error_table(batch)
            self.watch = cgx.LinkWatch(link, params, tolerance=args.tolerance,
                                       window=args.window)
            self.probe_values = args.probe_values
            self.predicted, self.probes, self._predictions = [], [], {}
            self.policy = cgx.refit_policy(self.table, self.config, link=link)
        self.compiled, self.refits, self.done = {}, [], 0
        self.times, self.bits, self.losses, self.tests = [], [], [], []
        tx = self._transform(self.policy)
        self.state = cgx.shard_state(tx.init(params), mesh, AXIS) if self.policy else (
            jax.device_put(tx.init(params), NamedSharding(mesh, P())))

    def _transform(self, policy):
        import optax

        import cgx_jax as cgx

        allreduce = (train.pmean_transform(AXIS) if policy is None
                     else cgx.compressed_allreduce(AXIS, policy=policy))
        return optax.chain(allreduce, optax.adam(train.LEARNING_RATES["mlp"]))

    def _error_table(self, batch):
        """The error of each width per leaf on the first batch's summed gradient (the same
        on every process). Measured once: ``compressed_allreduce(adaptive=...)`` would
        measure it every step, which costs more than the all-reduce on these CPUs."""
        import cgx_jax as cgx

        summed = train.summed_gradient(self.mesh, AXIS, self.loss_fn, self.params, batch)
        return cgx.layer_errors(summed, self.config.choices, self.config.bucket_size)

    def _step_for(self, policy, batch):
        """The step compiled for ``policy`` (compiled once per distinct policy)."""
        import functools

        import jax
        import optax
        from jax.sharding import PartitionSpec as P

        import cgx_jax as cgx

        if policy not in self.compiled:
            tx = self._transform(policy)
            specs = cgx.state_specs(self.state, AXIS) if policy else P()

            @jax.jit
            @functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(P(), specs, P(AXIS)),
                               out_specs=(P(), specs, P()))
            def step(params, state, batch):
                loss, grads = cgx.local_value_and_grad(self.loss_fn, AXIS)(params, batch)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

            self.compiled[policy] = step.lower(self.params, self.state, batch).compile()
        return self.compiled[policy]

    def step(self, batch) -> None:
        """One timed step (compiling a new policy's step first, untimed)."""
        import jax

        compiled = self._step_for(self.policy, batch)
        start = time.perf_counter()
        self.params, self.state, loss = jax.block_until_ready(
            compiled(self.params, self.state, batch))
        seconds = time.perf_counter() - start
        self.done += 1
        self.times.append(seconds)
        self.losses.append(float(loss))
        self.bits.append(_mean_bits(self.policy, self.tree))
        if self.watch is not None:
            self.predicted.append(self._profile_seconds(self.policy))
            if self.done % self.watch.window == 0:
                self._probe()

    def _profile_seconds(self, policy) -> float:
        """``policy``'s all-reduce on the starting profile (for the compute of the steps)."""
        import cgx_jax as cgx

        if policy not in self._predictions:
            self._predictions[policy] = cgx.estimate(self.tree, self.watch.profile, policies={
                "p": policy}).policies[0].seconds
        return self._predictions[policy]

    def _probe(self) -> None:
        """Times the link between steps (every process at once); refits when it changed."""
        import jax

        import cgx_jax as cgx

        changed = self.watch.probe(self.mesh, AXIS, values=self.probe_values)
        self.probes.append(dict(step=self.done, seconds=self.watch.last_probe_seconds))
        if changed:
            self.policy = cgx.refit_policy(self.table, self.config, link=self.watch.link)
            self.refits.append(dict(step=self.done,
                                    seconds_per_wire_byte=self.watch.link.seconds_per_wire_byte,
                                    mean_bits=_mean_bits(self.policy, self.tree)))
            if jax.process_index() == 0:
                print(f"  step {self.done}: the link changed "
                      f"({self.watch.link.seconds_per_wire_byte * 1e9:.1f} ns per wire byte): "
                      f"refit to {self.refits[-1]['mean_bits']:.2f} bits", flush=True)

    def record(self) -> dict:
        out = dict(times=self.times, bits=self.bits, losses=self.losses, tests=self.tests,
                   refits=self.refits, compiled=len(self.compiled))
        if self.watch is not None:
            out.update(time_budget=self.budget, predicted=self.predicted, probes=self.probes)
        return out


def _mean_bits(policy, tree) -> float:
    """Bits per value of the leaves ``policy`` compresses (32: none compressed)."""
    import jax

    if policy is None:
        return 32.0
    codecs = jax.tree.leaves(policy.resolve(tree), is_leaf=lambda c: c is None)
    sizes = [(c.bits, leaf.size) for c, leaf in zip(codecs, jax.tree.leaves(tree)) if c]
    return sum(b * n for b, n in sizes) / sum(n for _, n in sizes) if sizes else 32.0


# --------------------------------------------------------------------------- report

def phase_rows(record: dict, rates: list[str], phase_steps: int, window: int) -> list[dict]:
    """Per phase and mode: the settled median s/step, the mean bits, and the held-out loss
    and accuracy at the phase's end (see the module docstring)."""
    rows = []
    for phase, rate in enumerate(rates):
        start, end = phase * phase_steps, (phase + 1) * phase_steps
        for mode, r in record.items():
            settled = slice(min(start + window, end - 1), end)
            row = dict(phase=phase + 1, rate=rate, mode=mode,
                       seconds=statistics.median(r["times"][settled]),
                       mean_bits=statistics.fmean(r["bits"][settled]),
                       test_loss=r["tests"][phase]["loss"],
                       test_accuracy=r["tests"][phase]["accuracy"])
            if "time_budget" in r:
                row["step_budget"] = step_budget(r, phase_steps, window)
                row["vs_budget"] = row["seconds"] / row["step_budget"]
            rows.append(row)
    return rows


def step_budget(record: dict, phase_steps: int, window: int) -> float:
    """The adaptive mode's step budget: its time budget plus its compute, the median of
    its settled first-phase steps less their all-reduce as the profile predicts it."""
    settled = slice(min(window, phase_steps - 1), phase_steps)
    return record["time_budget"] + statistics.median(
        t - p for t, p in zip(record["times"][settled], record["predicted"][settled]))


def whole_run(record: dict) -> dict:
    """Per mode: the seconds of all steps (and of the probes between them), the mean bits,
    and the final held-out loss and accuracy."""
    return {mode: dict(seconds=sum(r["times"]) + sum(p["seconds"] for p in r.get("probes", [])),
                       mean_bits=statistics.fmean(r["bits"]),
                       test_loss=r["tests"][-1]["loss"],
                       test_accuracy=r["tests"][-1]["accuracy"])
            for mode, r in record.items()}


def format_table(rows: list[dict]) -> str:
    header = (f"{'phase':>5} {'rate':<8} {'mode':<9} {'s/step':>7} {'budget':>7} "
              f"{'x budget':>8} {'bits':>5} {'test loss':>9} {'acc %':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['phase']:>5} {r['rate']:<8} {r['mode']:<9} {r['seconds']:>7.3f} "
                     f"{train.fmt(r.get('step_budget'), '7.3f'):>7} "
                     f"{train.fmt(r.get('vs_budget'), '8.2f'):>8} {r['mean_bits']:>5.2f} "
                     f"{r['test_loss']:>9.4f} {100 * r['test_accuracy']:>6.2f}")
    return "\n".join(lines)


def format_markdown(rows: list[dict], title: str) -> str:
    lines = [title, "", "| phase | rate | mode | s/step | step budget | x budget | mean bits | "
             "test loss | test accuracy % |", "|---:|:---|:---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['rate']} | {r['mode']} | {r['seconds']:.3f} "
                     f"| {train.fmt(r.get('step_budget'), '.3f')} "
                     f"| {train.fmt(r.get('vs_budget'), '.2f')} | {r['mean_bits']:.2f} "
                     f"| {r['test_loss']:.4f} | {100 * r['test_accuracy']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """Seconds per step and mean bits against the step, per mode, the phases shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record, steps = result["record"], result["phase_steps"]
    colors = dict(zip(MODES, ("tab:blue", "tab:orange", "tab:green")))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for mode, r in record.items():
        top.plot(r["times"], label=mode, linewidth=1, color=colors[mode])
        if mode != "exact":
            bottom.plot(r["bits"], label=mode, linewidth=1.5, color=colors[mode])
    adaptive = record.get("adaptive")
    if adaptive:
        top.axhline(step_budget(adaptive, steps, result["window"]), color="gray",
                    linestyle=":", label="adaptive: step budget")
    for ax in (top, bottom):
        for phase, rate in enumerate(result["rates"]):
            if parse_rate(rate) and phase % 2:
                ax.axvspan(phase * steps, (phase + 1) * steps, color="0.92")
            ax.text((phase + 0.5) * steps, 1.0, rate, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7)
    top.set_yscale("log")
    top.set_ylabel("seconds per step")
    bottom.set_ylabel("mean bits (compressed leaves)")
    bottom.set_xlabel("step")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    whole = ", ".join(f"{mode} {w['seconds']:.1f} s" for mode, w in result["whole_run"].items())
    fig.suptitle(f"{result['processes']} processes, MLP, batch {result['batch']} per process; "
                 f"whole run: {whole}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(result: dict, args) -> None:
    title = (f"training while the link changes, {result['processes']} processes, MLP, batch "
             f"{result['batch']} per process, rates {' -> '.join(result['rates'])} every "
             f"{result['phase_steps']} steps")
    whole = "; ".join(f"{mode} {w['seconds']:.1f} s, {w['mean_bits']:.2f} bits, test loss "
                      f"{w['test_loss']:.4f}, accuracy {100 * w['test_accuracy']:.2f}%"
                      for mode, w in result["whole_run"].items())
    adaptive = result["record"].get("adaptive", {"bits": [None], "refits": []})
    refits = [(0, adaptive["bits"][0])] + [(f["step"], f["mean_bits"])
                                            for f in adaptive["refits"]]
    refits = [(step, bits and round(bits, 2)) for step, bits in refits]
    common.write_reports(dict(result, rows=result["phases"]), args, title, format_table,
                         format_markdown, lambda rows, path, t: plot(result, path),
                         footnote=f"whole run: {whole}; adaptive bits from (step, bits): "
                                  f"{refits}")


# --------------------------------------------------------------------------- orchestrator

def _run(args, rates: tuple, tmp: str) -> tuple[int, list, str]:
    from cgx_jax.launch import launch

    warnings = []

    def warn(message: str) -> None:
        warnings.append(message)
        print(f"cgx_jax.bench adapt: {message}", file=sys.stderr, flush=True)

    out = os.path.join(tmp, "record.json")
    with shaped_network(args.processes, rates[0], subnet=args.subnet,
                        prefix=args.netns_prefix, warn=warn) as network:
        coordinator = f"{network.address(0)}:{PORT}" if network else None
        wrap = network.wrap if network else list
        print(f"# training across {args.processes} processes, links "
              f"{' -> '.join(rates) if network else 'unshaped loopback'}", flush=True)
        command = [sys.executable, "-m", "cgx_jax.bench.adapt", "--worker", "--out", out,
                   *_passed_on(args)] + (["--shaped"] if network else [])
        command += ["--coordinator", coordinator] if coordinator else []
        code = launch(wrap(command), args.processes, 1, timeout=args.timeout)
    record = None
    if code == 0 and os.path.exists(out):
        with open(out) as f:
            record = json.load(f)
    return code, [record] if record else [], (warnings[0] if warnings and not network else "")


def _passed_on(args) -> list[str]:
    """The options every worker gets as given."""
    out = ["--processes", str(args.processes), "--rates", *args.rates, "--modes", *args.modes,
           "--phase-steps", str(args.phase_steps), "--window", str(args.window),
           "--tolerance", str(args.tolerance), "--probe-values", str(args.probe_values),
           "--choices", *map(str, args.choices), "--batch", str(args.batch),
           "--mlp-hidden", str(args.mlp_hidden), "--netns-prefix", args.netns_prefix]
    out += ["--profile", args.profile] if args.profile else []
    return out + (["--time-budget", str(args.time_budget)] if args.time_budget else [])


def run(args) -> int:
    start = time.monotonic()
    code, records, notes = run_links("adapt", [tuple(args.rates)],
                                     lambda rates, tmp: _run(args, rates, tmp))
    if code != 0 or not records:
        print(f"cgx_jax.bench adapt: workers failed (exit code {code})", file=sys.stderr)
        return code or 1
    record = records[0]
    rates = args.rates if not notes else ["none"] * len(args.rates)
    result = dict(processes=args.processes, rates=rates, notes=notes, batch=args.batch,
                  phase_steps=args.phase_steps, window=args.window,
                  wall_seconds=round(time.monotonic() - start, 1),
                  command="python -m cgx_jax.bench adapt " + " ".join(args.argv),
                  phases=phase_rows(record, rates, args.phase_steps, args.window),
                  whole_run=whole_run(record), record=record)
    write_reports(result, args)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m cgx_jax.bench adapt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit", "1gbit"],
                   help="the links' tc rate in each phase (default: 1gbit 200mbit 1gbit)")
    p.add_argument("--phase-steps", type=int, default=40, help="steps per phase (default 40)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--profile", default=None,
                   help="the LinkProfile JSON of the first rate (python -m cgx_jax.bench "
                        "link); needed by the adaptive mode")
    p.add_argument("--time-budget", type=float, default=None,
                   help="adaptive: seconds of the all-reduce (default: uniform 4 bits' on "
                        "the profile)")
    p.add_argument("--choices", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8],
                   help="adaptive: the widths it may choose")
    p.add_argument("--window", type=int, default=10,
                   help="adaptive: steps between probes of the link (default 10)")
    p.add_argument("--tolerance", type=float, default=0.5,
                   help="adaptive: relative change of the rate that refits (default 0.5: "
                        "the per-byte time is a quarter of the step at 1 Gbit/s, and the "
                        "steps of 4 processes on 2 cores vary by more than 10%%)")
    p.add_argument("--probe-values", type=int, default=1 << 18,
                   help="adaptive: f32 values per participant of each probe psum (default "
                        "262144: 1 MB)")
    p.add_argument("--batch", type=int, default=32, help="examples per process and step")
    p.add_argument("--mlp-hidden", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--subnet", default="10.215.0")
    p.add_argument("--netns-prefix", default=NS_PREFIX)
    p.add_argument("--shaped", action="store_true", help=argparse.SUPPRESS)
    add_report_arguments(p, "seconds per step and mean bits against the step")
    add_worker_arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    if ran_worker_or_report(args, _worker, write_reports):
        return 0
    _check_arguments(p, args)
    return run(args)


def _check_arguments(p: argparse.ArgumentParser, args) -> None:
    from cgx_jax._src.netem import argument_problem

    if args.processes < 2:
        p.error(f"--processes must be at least 2, got {args.processes}")
    problem = argument_problem(args.rates, args.netns_prefix, args.subnet)
    if problem:
        p.error(problem.replace("--link", "--rates"))
    if any(parse_rate(rate) is None for rate in args.rates):
        p.error(f"--rates must be rates such as 1gbit or 200mbit, got {args.rates}")
    if args.window < 3:
        p.error(f"--window must be at least 3, got {args.window}")
    if args.phase_steps <= args.window:
        p.error(f"--phase-steps must be more than --window ({args.window}), got "
                f"{args.phase_steps}")
    for name in ("batch", "mlp_hidden", "probe_values"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if "adaptive" in args.modes and not args.profile:
        p.error("the adaptive mode needs --profile: the LinkProfile JSON that python -m "
                "cgx_jax.bench link --processes N --link RATE wrote for the first rate")
    if args.time_budget is not None and not args.time_budget > 0:
        p.error(f"--time-budget must be seconds > 0, got {args.time_budget}")
    if not 0 < args.tolerance < 1:
        p.error(f"--tolerance must be in (0, 1), got {args.tolerance}")


if __name__ == "__main__":
    sys.exit(main())
