"""All-reduce bandwidth benchmark across real processes on an emulated network:
``python -m cgx_jax.bench allreduce --processes 4 --link 1gbit [--sizes 1M 16M] ...``.

Topology (root only; ``cgx_jax._src.netem``, docs/design.md section 9): one network namespace per
process (``cgxbench0`` ... ``cgxbench{N-1}``, ``--netns-prefix``) joined through a bridge by
veth links shaped with ``tc tbf`` in both directions, private addresses (``10.213.0.0/24`` by
default) that exist only inside these namespaces, and hosts files so Gloo binds to the veth
address; the coordinator listens on rank 0's address. Everything is removed afterwards, also
on failure, Ctrl-C and SIGTERM. Without root (or when ``ip netns`` fails), or with
``--link none``, the processes run unshaped on loopback and the report says so.

Processes are started through :func:`cgx_jax.launch.launch` (rank-prefixed output, failure
propagation, timeout); each runs this module's worker (``--worker``), which calls
:func:`cgx_jax.launch.initialize`, builds a (processes, devices per process) mesh and
measures, per size, the median over ``--repeats`` blocking calls (after warm-up) of
``lax.psum`` f32, ``lax.psum`` after a bf16 cast, and ``compressed_psum`` for every bits x
algorithm, with the relative L2 error against the f32 psum. ``--algorithms sra-wire`` adds,
per bits, SRA's exchange (``collectives.transport.exchange_rows``) and ``all_gather`` on
packets of the same bytes with no encoding, decoding or reduction: the network's share of
``cgx sra``. Rank 0
writes the rows as JSON; the orchestrator prints the table and writes ``--json`` /
``--markdown`` / ``--plot``.

Effective algorithm bandwidth ("algbw") is ``2(N-1)/N * 4 * size`` bytes divided by the time:
what an f32 ring all-reduce would need to move per process, so it is comparable across methods
(compressed methods can exceed the link rate).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import socket
import sys
import textwrap
import time

from cgx_jax._src.netem import parse_rate, shaped_network
from cgx_jax.bench import common
from cgx_jax.bench.common import (
    add_report_arguments,
    add_worker_arguments,
    check_network_arguments,
    parse_size,
    ran_worker_or_report,
    run_links,
    size_label,
)

NS_PREFIX = "cgxbench"
PORT = 23456

# --------------------------------------------------------------------------- worker

MLP_KERNELS = (784 * 2048, 2048 * 2048, 2048 * 2048, 2048 * 10)


def vit_leaves() -> list[int]:
    """The sizes of the 80 parameter leaves of ``bench train``'s 19M-parameter ViT, in
    ``tree_leaves`` order (its kernels, embeddings, biases and norms)."""
    import jax

    from cgx_jax.bench.train import vit_init

    return [leaf.size for leaf in jax.tree.leaves(jax.eval_shape(vit_init, jax.random.key(0)))]


def leaf_sizes(layout: str, size: int) -> list[int]:
    """``size`` values split as a model's leaves are, in proportion: ``mlp`` as the four
    kernels of an MLP 784-2048-2048-2048-10, ``vit`` as the ViT's 80 leaves (each at least
    one value); ``flat``: one leaf.

    Example:
        >>> leaf_sizes("mlp", 10014720)
        [1605632, 4194304, 4194304, 20480]
    """
    if layout == "flat":
        return [size]
    weights = MLP_KERNELS if layout == "mlp" else vit_leaves()
    total = sum(weights)
    sizes = [max(1, size * w // total) for w in weights[:-1]]
    if size - sum(sizes) < 1:
        raise ValueError(f"--sizes {size} is too small for the {layout} layout's "
                         f"{len(weights)} leaves")
    return sizes + [size - sum(sizes)]


def worker(args) -> None:
    """One JAX process of the benchmark: every size, layout and method, timed; rank 0 writes
    the rows to ``args.out``."""
    from cgx_jax import launch as _launch

    if args.coordinator:
        os.environ[_launch.ENV_COORDINATOR] = args.coordinator
    rank, num_processes = _launch.initialize()

    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    per_process = len(jax.local_devices())
    # Process-major (num_processes, per_process) grid: "proc" crosses the network, "dev" is
    # the devices inside one process (hierarchical runs reduce over it exactly first).
    grid = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = Mesh(grid.reshape(num_processes, per_process), AXES)
    if rank == 0:
        print(f"{num_processes} processes x {per_process} devices, host "
              f"{socket.gethostname()} -> {socket.gethostbyname(socket.gethostname())}",
              flush=True)
    algorithms = [a for a in args.algorithms if a != "hierarchical" or per_process > 1]
    if rank == 0 and len(algorithms) < len(args.algorithms):
        print("  (hierarchical needs --devices-per-process 2 or more: skipped)", flush=True)
    rows = []
    for size, layout in [(s, layout) for s in args.sizes for layout in args.layouts]:
        x = _inputs(mesh, size, layout)
        reference = None
        for name, algorithm, bits, body in _methods(args, algorithms, mesh, size, layout):
            row, out = _measure(args, mesh, body, x, name == "psum bf16")
            if reference is None:
                reference, error = out, 0.0
            elif algorithm == "sra-wire":
                error = None  # its output is bytes, not a sum
            else:
                error = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
            rows.append(dict(elements=size, layout=layout, method=name, algorithm=algorithm,
                             bits=bits, rel_error=error, **row))
            if rank == 0:
                print(f"  {size_label(size):>5} {layout:<4} {name:<16} "
                      f"{row['seconds'] * 1e3:10.2f} ms  {row['page_faults']:7.0f} page faults"
                      f"  rel err {_error_text(error, '.3e')}", flush=True)
        del x, reference
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    # Keep every process alive until all are done with the last collective.
    multihost_utils.sync_global_devices("cgx_bench_allreduce_done")


AXES = ("proc", "dev")


def _inputs(mesh, size: int, layout: str):
    """Every participant's row of ``size`` values (a seed per participant), sharded one row
    per device: one array for ``flat``; for ``mlp``/``vit``, the same values cut into a
    model's leaves, scaled to the size, as an optimizer's gradient pytree arrives."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = list(mesh.devices.reshape(-1))
    local = [d for d in devices if d.process_index == jax.process_index()]
    bounds = np.cumsum([0] + leaf_sizes(layout, size))
    leaves = {}
    for leaf, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        pieces = [jax.device_put(np.random.default_rng(1000 + devices.index(device))
                                 .standard_normal(size, np.float32)[None, lo:hi], device)
                  for device in local]
        leaves[f"leaf{leaf}"] = jax.make_array_from_single_device_arrays(
            (len(devices), hi - lo), NamedSharding(mesh, P(AXES)), pieces)
    return leaves["leaf0"] if layout == "flat" else leaves


def _methods(args, algorithms, mesh, size: int, layout: str) -> list:
    """``(name, algorithm, bits, body)`` of every method timed at this size and layout: the
    two ``lax.psum`` baselines, then each algorithm at each bit width (``--fit-only``: the
    f32 baseline, and the compressed methods on the flat layout only)."""
    import jax
    import jax.numpy as jnp

    import cgx_jax as cgx

    methods = [("psum f32", "", 32, lambda v: jax.lax.psum(v, AXES))]
    if not args.fit_only:
        methods.append(("psum bf16", "", 16,
                        lambda t: jax.tree.map(lambda v: v.astype(jnp.float32), jax.lax.psum(
                            jax.tree.map(lambda v: v.astype(jnp.bfloat16), t), AXES))))
    if args.fit_only and layout != "flat":
        return methods
    for algorithm in algorithms:
        for bits in args.bits:
            codec = cgx.Codec(bits=bits, bucket_size=args.bucket_size, rounding=args.rounding)
            if algorithm == "sra-wire":
                if layout == "flat":  # the wire of the same values: the flat row has it
                    methods.append((f"wire sra {bits}b", algorithm, bits,
                                    _wire_only(codec, size, mesh.size)))
                continue
            label = "hier-sra" if algorithm == "hierarchical" else algorithm
            methods.append((f"cgx {label} {bits}b", algorithm, bits,
                            _compressed(codec, algorithm)))
    return methods


def _compressed(codec, algorithm: str):
    import jax

    import cgx_jax as cgx

    if algorithm == "hierarchical":
        return lambda v: cgx.compressed_psum(v, "proc", codec=codec, key=jax.random.key(0),
                                             algorithm="sra", inner_axis_name="dev")
    return lambda v: cgx.compressed_psum(v, AXES, codec=codec, key=jax.random.key(0),
                                         algorithm=algorithm)


def _wire_only(codec, size: int, n: int):
    """SRA's collectives on packets of its byte count, nothing encoded or decoded."""
    import jax
    import jax.numpy as jnp

    from cgx_jax._src.codec import packet_bytes
    from cgx_jax._src.collectives import padding_multiple
    from cgx_jax._src.collectives.transport import exchange_rows

    multiple = padding_multiple("sra", codec, n)
    chunk = packet_bytes(-(-size // multiple) * multiple // n, codec)

    def body(v):
        raw = jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1)
        raw = jnp.resize(raw, n * chunk).reshape(n, chunk)  # stands in for the packets
        pieces = exchange_rows(raw, AXES, jax.lax.axis_index(AXES), n)
        # XOR of the received pieces stands in for the reduction (uses every piece).
        own = functools.reduce(jnp.bitwise_xor, list(pieces))
        return jax.lax.all_gather(own, AXES, tiled=True)
    return body


def _measure(args, mesh, body, x, bf16_psum: bool) -> tuple[dict, object]:
    """Times ``body`` under ``shard_map`` on ``x`` (one program in flight at a time,
    docs/design.md section 9): ``(row fields, this process's first output row as f32)``;
    ``bf16_psum``: also say whether XLA moved the bf16 psum in f32."""
    import statistics

    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    fn = jax.jit(jax.shard_map(
        lambda t: jax.tree.map(lambda v: v[None], body(jax.tree.map(lambda v: v[0], t))),
        mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
    promoted = False
    if bf16_psum:  # XLA:CPU promotes a bf16 all-reduce to f32 (its wire bytes are f32's)
        hlo = fn.lower(x).compile().as_text()
        promoted = any(" all-reduce(" in line and "= f32[" in line for line in hlo.splitlines())
    for _ in range(args.warmup):
        jax.block_until_ready(fn(x))
    times, faults = [], []
    for _ in range(args.repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        out = jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    own = np.concatenate([np.asarray(leaf.addressable_shards[0].data[0], np.float32)
                          for leaf in jax.tree.leaves(out)])
    return dict(seconds=statistics.median(times), times=times,
                page_faults=statistics.median(faults), wire_promoted_to_f32=promoted), own


def _torch_worker(args) -> None:
    """PyTorch peers in the same network: a raw gloo ``all_reduce`` of the same f32 buffer, and
    one DDP backward (one parameter of ``size`` values, one bucket) plain, with
    ``fp16_compress_hook`` and with the PowerSGD hook (rank 4, error feedback). DDP times
    include its trivial forward/backward (a multiply and a sum); DDP averages, so its result
    is scaled by N before the error against the f32 sum."""
    import statistics
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_jax import launch as _launch

    rank = int(os.environ[_launch.ENV_PROCESS_ID])
    n = int(os.environ[_launch.ENV_NUM_PROCESSES])
    host, port = args.coordinator.rsplit(":", 1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=n, timeout=timedelta(seconds=600))
    warmup = max(args.warmup, 3)  # PowerSGD runs plain all-reduces for its first 2 steps

    def timed(step):
        for _ in range(warmup):
            step()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times), times

    class One(torch.nn.Module):
        def __init__(self, size):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(size // 1024, 1024))

        def forward(self, g):
            return (self.p * g).sum()

    rows = []
    for size in args.sizes:
        rng = np.random.default_rng(1000 + rank)
        g = torch.from_numpy(rng.standard_normal(size, dtype=np.float32)).view(-1, 1024)
        buf = g.clone()

        def raw():
            buf.copy_(g)
            dist.all_reduce(buf)

        seconds, times = timed(raw)
        reference = buf.clone().view(-1)
        rows.append(dict(elements=size, method="torch allreduce", algorithm="", bits=32,
                         seconds=seconds, times=times, rel_error=0.0))
        hooks = [("torch ddp f32", 32, None, None),
                 ("torch ddp fp16", 16, None, default_hooks.fp16_compress_hook),
                 ("torch ddp psgd r4", 0,
                  lambda: powerSGD_hook.PowerSGDState(
                      process_group=None, matrix_approximation_rank=4,
                      start_powerSGD_iter=2, use_error_feedback=True, warm_start=True),
                  powerSGD_hook.powerSGD_hook)]
        for name, bits, make_state, hook in hooks:
            model = DDP(One(size), bucket_cap_mb=max(25, size * 4 // (1 << 20) + 1))
            if hook is not None:
                model.register_comm_hook(make_state() if make_state else None, hook)

            def step(model=model):
                model.zero_grad(set_to_none=False)
                model(g).backward()

            seconds, times = timed(step)
            got = model.module.p.grad.detach().view(-1) * n
            error = float(torch.linalg.vector_norm(got - reference)
                          / torch.linalg.vector_norm(reference))
            rows.append(dict(elements=size, method=name, algorithm="", bits=bits,
                             seconds=seconds, times=times, rel_error=error))
            if rank == 0:
                print(f"  {size_label(size):>5} {name:<18} {seconds * 1e3:10.2f} ms  "
                      f"rel err {error:.3e}", flush=True)
            del model
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report

def add_ratios(rows: list[dict], num_participants: int) -> list[dict]:
    """Adds algbw and the speedups over ``psum f32`` / ``psum bf16`` of the same link and
    size; keeps the order links, sizes, JAX rows, torch rows."""
    groups = {}
    for r in rows:
        r.setdefault("layout", "flat")
        groups.setdefault((r.get("link", ""), r["elements"], r["layout"]), []).append(r)
    out = []
    for group in groups.values():
        base = {r["method"]: r["seconds"] for r in group if r["method"].startswith("psum ")}
        for r in group:
            size = r["elements"]
            r["algbw_gb_per_s"] = (2 * (num_participants - 1) / num_participants * 4 * size
                                   / r["seconds"] / 1e9)
            r["vs_f32"] = base["psum f32"] / r["seconds"]
            r["vs_bf16"] = base["psum bf16"] / r["seconds"]
            out.append(r)
    return out


def _error_text(error, spec: str) -> str:
    return "-" if error is None else format(error, spec)


def _faults_text(r) -> str:
    return "-" if r.get("page_faults") is None else f"{r['page_faults']:.0f}"


def format_table(rows: list[dict]) -> str:
    header = (f"{'link':<8} {'size':>6} {'layout':<6} {'method':<18} {'ms':>10} "
              f"{'algbw GB/s':>11} {'x f32':>7} {'x bf16':>7} {'rel err':>9} {'faults':>7}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.get('link', ''):<8} {size_label(r['elements']):>6} "
                     f"{r['layout']:<6} {r['method']:<18} "
                     f"{r['seconds'] * 1e3:>10.2f} {r['algbw_gb_per_s']:>11.3f} "
                     f"{r['vs_f32']:>7.2f} {r['vs_bf16']:>7.2f} "
                     f"{_error_text(r['rel_error'], '.2e'):>9} {_faults_text(r):>7}")
    return "\n".join(lines)


_PROMOTED_NOTE = ("XLA promoted the bf16 all-reduce to f32 (compiled HLO), so `psum bf16` "
                  "moves f32 bytes here; an ideal bf16 psum would take half the f32 time.")


def format_markdown(rows: list[dict], title: str) -> str:
    notes = f"\n\n{_PROMOTED_NOTE}" if any(r.get("wire_promoted_to_f32") for r in rows) else ""
    lines = [f"{title}{notes}", "",
             "| link | size | layout | method | ms | algbw GB/s | x f32 psum | x bf16 psum "
             "| rel. error | page faults/call |",
             "|:---|---:|:---|:---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.get('link', '')} | {size_label(r['elements'])} | {r['layout']} "
                     f"| {r['method']} | {r['seconds'] * 1e3:.2f} | {r['algbw_gb_per_s']:.3f} "
                     f"| {r['vs_f32']:.2f} | {r['vs_bf16']:.2f} "
                     f"| {_error_text(r['rel_error'], '.2e')} | {_faults_text(r)} |")
    return "\n".join(lines) + "\n"


def _link_order(link: str) -> float:
    rate = parse_rate(link)
    return float("inf") if rate is None else rate


def plot(rows: list[dict], path: str, title: str) -> None:
    """One panel per gradient size: speedup over ``psum f32`` (log scale) against the link
    rate, one line per method; the dotted line at 1 is where compression stops paying."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted(dict.fromkeys(r["link"] for r in rows), key=_link_order)
    sizes = list(dict.fromkeys(r["elements"] for r in rows))
    for r in rows:  # one line per method and layout
        layout = r.get("layout", "flat")
        r["series"] = r["method"] + ("" if layout == "flat" else f" ({layout})")
    methods = [m for m in dict.fromkeys(r["series"] for r in rows) if m != "psum f32"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes) + 1.8, 4.2),
                             sharey=True, squeeze=False)
    styles = {"cgx": "-", "psum": "--", "torch": ":", "wire": "-."}
    colors = plt.get_cmap("tab20")  # up to 20 methods, each its own color
    for ax, size in zip(axes[0], sizes):
        for method in methods:
            points = {r["link"]: r["vs_f32"] for r in rows
                      if r["elements"] == size and r["series"] == method}
            xs = [i for i, link in enumerate(links) if link in points]
            if not xs:
                continue
            ax.plot(xs, [points[links[i]] for i in xs], styles[method.split()[0]],
                    color=colors(methods.index(method) % 20), marker="o", markersize=3.5,
                    label=method)
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(links)), [
            "unshaped" if parse_rate(link) is None else link for link in links])
        ax.set_yscale("log")
        ax.set_title(f"{size_label(size)} f32 elements")
        ax.set_xlabel("link rate per process")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speedup over lax.psum f32")
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(result: dict, args) -> None:
    title = (f"all-reduce, {result['processes']} processes x {result['devices_per_process']} "
             f"devices, median of {result['repeats']}; algbw = 2(N-1)/N * 4 B * size / time")
    promoted = any(r.get("wire_promoted_to_f32") for r in result["rows"])
    common.write_reports(result, args, title, format_table, format_markdown, plot,
                         footnote=_PROMOTED_NOTE if promoted else "")


# --------------------------------------------------------------------------- orchestrator

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--devices-per-process", type=int, default=1,
                   help="simulated CPU devices per process (default 1); 2 or more enables "
                        "--algorithms hierarchical (exact inside a process, compressed across)")
    p.add_argument("--link", nargs="+", default=["1gbit"],
                   help="tc rate of every process's link (1gbit, 10gbit, 100mbit) or none "
                        "(unshaped loopback); several values run one after the other")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[1 << 20, 16 << 20],
                   help="gradient sizes in f32 elements: 1M 16M 64M (default 1M 16M)")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layouts", nargs="+", default=["flat"], choices=["flat", "mlp", "vit"],
                   help="flat: one array per size; mlp: the same values as four leaves split "
                        "as the kernels of an MLP 784-2048-2048-2048-10 (a gradient pytree); "
                        "vit: as the 80 leaves of bench train's 19M-parameter ViT")
    p.add_argument("--algorithms", nargs="+", default=["sra"],
                   choices=["sra", "ring", "allgather", "auto", "hierarchical", "sra-wire"],
                   help="compressed_psum algorithms to time; hierarchical: exact inside a "
                        "process, SRA across; sra-wire: SRA's collectives on the same bytes "
                        "without encoding (the network's share)")
    p.add_argument("--bucket-size", type=int, default=1024)
    p.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds before the worker processes of one link are stopped "
                        "(default 1800)")
    p.add_argument("--subnet", default="10.213.0",
                   help="first three octets of the private /24 used inside the namespaces")
    p.add_argument("--netns-prefix", default=NS_PREFIX,
                   help=f"names of the namespaces: PREFIX0.. and PREFIXhub (default {NS_PREFIX}; "
                        f"change it to run two benchmarks at once)")
    p.add_argument("--torch", default="auto", choices=["auto", "yes", "no"],
                   help="also measure PyTorch DDP (gloo) plain / fp16 hook / PowerSGD r4 in the "
                        "same network (auto: when torch is importable and there is one "
                        "device per process)")
    # bench link's measurements: psum f32 on every layout, compressed on the flat one only,
    # which is all its fit reads (the other rows cost the most to compile).
    p.add_argument("--fit-only", action="store_true", help=argparse.SUPPRESS)
    add_report_arguments(p, "speedup vs link rate, one panel per size")


def _worker_arguments(args, out: str, coordinator: str | None, kind: str = "--worker"
                      ) -> list[str]:
    cmd = [sys.executable, "-m", "cgx_jax.bench.allreduce", kind, "--out", out,
           "--sizes", *map(str, args.sizes), "--bits", *map(str, args.bits),
           "--layouts", *args.layouts,
           "--algorithms", *args.algorithms, "--bucket-size", str(args.bucket_size),
           "--rounding", args.rounding, "--repeats", str(args.repeats),
           "--warmup", str(args.warmup)]
    if args.fit_only:
        cmd.append("--fit-only")
    if coordinator:
        cmd += ["--coordinator", coordinator]
    return cmd


def run_link(args, link: str, use_torch: bool, tmp: str) -> tuple[int, list[dict], str]:
    """Builds the network for one link rate (or none), runs the JAX workers and the torch
    peers in it, and tears it down whatever happens; returns (exit code, rows, note)."""
    from cgx_jax.launch import free_port, launch

    warnings = []

    def warn(message: str) -> None:
        warnings.append(message)
        print(f"cgx_jax.bench allreduce: {message}", file=sys.stderr, flush=True)

    out = os.path.join(tmp, f"rows_{link}.json")
    torch_out = os.path.join(tmp, f"torch_rows_{link}.json")
    with shaped_network(args.processes, link, subnet=args.subnet, prefix=args.netns_prefix,
                        warn=warn) as network:
        if network:
            link_text = f"{link} tbf per link, netns/veth/bridge"
            coordinator = f"{network.address(0)}:{PORT}"
            torch_coordinator = f"{network.address(0)}:{PORT + 1}"
            wrap = network.wrap  # every rank's command runs in its own namespace
        else:
            link_text = "unshaped loopback" + (" (shaping unavailable)" if warnings else "")
            coordinator, torch_coordinator = None, f"127.0.0.1:{free_port()}"
            wrap = list
        print(f"# all-reduce across {args.processes} processes x {args.devices_per_process} "
              f"CPU devices, {link_text}; median of {args.repeats} after {args.warmup} "
              f"warm-up, bucket {args.bucket_size}, {args.rounding} rounding", flush=True)
        code = launch(wrap(_worker_arguments(args, out, coordinator)), args.processes,
                      args.devices_per_process, timeout=args.timeout)
        if code == 0 and use_torch:
            print("# PyTorch DDP (gloo) in the same network", flush=True)
            torch_code = launch(wrap(_worker_arguments(args, torch_out, torch_coordinator,
                                                       "--torch-worker")),
                                args.processes, 1, timeout=args.timeout)
            if torch_code != 0:
                print(f"cgx_jax.bench allreduce: the PyTorch run failed (exit code "
                      f"{torch_code}); reporting the JAX rows only", file=sys.stderr)
                if torch_code == 130:
                    code = 130
    rows = []
    if code == 0:
        for path in (out, torch_out):
            if os.path.exists(path):
                with open(path) as f:
                    rows += json.load(f)
    for r in rows:
        r.update(link=link if network else "none", link_requested=link)
    note = warnings[0] if warnings and not network else ""
    return code, rows, note


def run(args) -> int:
    use_torch = args.torch == "yes"
    if args.torch == "auto":
        import importlib.util
        use_torch = (importlib.util.find_spec("torch") is not None
                     and args.devices_per_process == 1)
    start = time.monotonic()
    code, rows, notes = run_links("allreduce", args.link,
                                  lambda link, tmp: run_link(args, link, use_torch, tmp))
    if code != 0 or not rows:
        print(f"cgx_jax.bench allreduce: workers failed (exit code {code})", file=sys.stderr)
        return code or 1
    rows = add_ratios(rows, args.processes * args.devices_per_process)
    result = dict(processes=args.processes, devices_per_process=args.devices_per_process,
                  links=args.link, notes=notes, repeats=args.repeats, warmup=args.warmup,
                  bucket_size=args.bucket_size, rounding=args.rounding,
                  wall_seconds=round(time.monotonic() - start, 1),
                  command="python -m cgx_jax.bench allreduce " + " ".join(args.argv),
                  rows=rows)
    write_reports(result, args)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cgx_jax.bench allreduce",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    add_worker_arguments(parser)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.torch_worker:
        _torch_worker(args)
        return 0
    if ran_worker_or_report(args, worker, write_reports):
        return 0
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}")
    check_network_arguments(parser, args)
    for layout in args.layouts:
        for size in args.sizes:
            try:
                leaf_sizes(layout, size)
            except ValueError as err:
                parser.error(str(err))
    if args.plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install -e '.[examples]')")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
