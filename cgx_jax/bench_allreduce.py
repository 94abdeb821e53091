"""All-reduce bandwidth benchmark across real processes on an emulated network:
``python -m cgx_jax.bench allreduce --processes 4 --link 1gbit [--sizes 1M 16M] ...``.

Topology (root only; DESIGN.md section 6): one network namespace per process
(``cgxbench0`` ... ``cgxbench{N-1}``) plus a hub namespace ``cgxbenchhub`` holding a bridge;
each process namespace is joined to the bridge by a veth pair whose two ends are shaped with
``tc ... tbf rate RATE`` (the process's egress, and the switch port's egress towards it, like a
full-duplex link of that rate). Addresses are private (``10.213.0.0/24`` by default, rank i at
``.(i+1)``) and exist only inside these namespaces. Gloo binds to the address the host name
resolves to, so each namespace gets ``/etc/netns/cgxbenchI/hosts`` mapping the host name to its
veth address; the coordinator listens on rank 0's veth address. Everything is removed afterwards,
also on failure, Ctrl-C and SIGTERM. Without root (or when ``ip netns`` fails), or with
``--link none``, the processes run unshaped on loopback and the report says so.

Processes are started through :func:`cgx_jax.launch.launch` (rank-prefixed output, failure
propagation, timeout); each runs this module's worker (``--worker``), which calls
:func:`cgx_jax.launch.initialize`, builds a 1-D mesh over one CPU device per process and
measures, per size, the median over ``--repeats`` blocking calls (after warm-up) of
``lax.psum`` f32, ``lax.psum`` after a bf16 cast, and ``compressed_psum`` for every bits x
algorithm, with the relative L2 error against the f32 psum. Rank 0 writes the rows as JSON;
the orchestrator prints the table and writes ``--json`` / ``--markdown``.

Effective algorithm bandwidth ("algbw") is ``2(N-1)/N * 4 * size`` bytes divided by the time:
what an f32 ring all-reduce would need to move per process, so it is comparable across methods
(compressed methods can exceed the link rate).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

NS_PREFIX = "cgxbench"
HUB = NS_PREFIX + "hub"
BRIDGE = "cgxbr0"
PORT = 23456

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# --------------------------------------------------------------------------- parsing

def parse_size(text: str) -> int:
    """``1M`` -> 1048576 elements, ``16M``, ``64M``, ``4096``."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"size must look like 4096, 64K, 1M or 16M: {text!r}")
    return int(m.group(1)) * _SUFFIXES[m.group(2).upper()]


def size_label(size: int) -> str:
    for suffix in ("G", "M", "K"):
        if size % _SUFFIXES[suffix] == 0:
            return f"{size // _SUFFIXES[suffix]}{suffix}"
    return str(size)


def parse_rate(text: str) -> float | None:
    """tc rate (``1gbit``, ``100mbit``, ``500kbit``) -> bits per second; ``none`` -> None."""
    if text.lower() in ("none", "unshaped", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(
            f"link rate must look like 1gbit, 10gbit, 100mbit, or none: {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


# --------------------------------------------------------------------------- topology

def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return result


class Network:
    """The namespaces, bridge, veth pairs, tc qdiscs and hosts files of one run; ``remove()``
    deletes exactly what ``create()`` made (idempotent)."""

    def __init__(self, num_processes: int, rate_bps: float, rate_text: str,
                 subnet: str = "10.213.0"):
        self.n = num_processes
        self.rate_bps, self.rate_text = rate_bps, rate_text
        self.subnet = subnet
        self.namespaces: list[str] = []
        self.etc_dirs: list[str] = []
        self.made_etc_netns = False

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def namespace(self, rank: int) -> str:
        return f"{NS_PREFIX}{rank}"

    def _tbf(self, dev: str, ns: str) -> None:
        # Burst: at least one timer tick of traffic at 250 Hz, and no less than 32 KiB.
        burst = max(int(self.rate_bps / 8 / 250), 32 * 1024)
        _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate_text,
            "burst", str(burst), "latency", "100ms", ns=ns)

    def create(self) -> None:
        existing = set(line.split()[0] for line in
                       _ip("ip", "netns", "list").stdout.splitlines() if line.strip())
        wanted = [HUB] + [self.namespace(r) for r in range(self.n)]
        clash = [ns for ns in wanted if ns in existing]
        if clash:
            raise RuntimeError(
                f"network namespaces {clash} exist already (another benchmark running, or a "
                f"killed one): remove them with `ip netns del NAME` and "
                f"`rm -r /etc/netns/NAME` if they are stale")
        hostname = socket.gethostname()
        self.made_etc_netns = not os.path.isdir("/etc/netns")
        _ip("ip", "netns", "add", HUB)
        self.namespaces.append(HUB)
        _ip("ip", "link", "set", "lo", "up", ns=HUB)
        _ip("ip", "link", "add", BRIDGE, "type", "bridge", ns=HUB)
        _ip("ip", "link", "set", BRIDGE, "up", ns=HUB)
        for rank in range(self.n):
            ns = self.namespace(rank)
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            self.etc_dirs.append(etc)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(rank)} {hostname}\n")
            _ip("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            inner, outer = f"cgxv{rank}", f"cgxp{rank}"
            # Both ends are created directly inside their namespaces: nothing appears in
            # the host's own namespace.
            _ip("ip", "link", "add", inner, "netns", ns, "type", "veth",
                "peer", "name", outer, "netns", HUB, ns=HUB)
            _ip("ip", "link", "set", outer, "master", BRIDGE, ns=HUB)
            _ip("ip", "link", "set", outer, "up", ns=HUB)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _ip("ip", "addr", "add", f"{self.address(rank)}/24", "dev", inner, ns=ns)
            _ip("ip", "link", "set", inner, "up", ns=ns)
            self._tbf(inner, ns)
            self._tbf(outer, HUB)

    def remove(self) -> list[str]:
        """Deletes the namespaces (which deletes their veths, bridge and qdiscs) and the
        hosts files; returns the problems met (empty when all went)."""
        problems = []
        for ns in reversed(self.namespaces):
            r = _ip("ip", "netns", "del", ns, check=False)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        self.namespaces = []
        for etc in self.etc_dirs:
            shutil.rmtree(etc, ignore_errors=True)
            if os.path.exists(etc):
                problems.append(f"could not remove {etc}")
        self.etc_dirs = []
        if self.made_etc_netns:
            try:
                os.rmdir("/etc/netns")  # only when this run created it and it is empty
            except OSError:
                pass
            self.made_etc_netns = False
        return problems


def can_shape() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "`ip` or `tc` not found"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"`ip netns` failed: {r.stderr.strip()}"
    return True, ""


# --------------------------------------------------------------------------- worker

def _worker(args) -> None:
    from cgx_jax import launch as _launch

    if args.coordinator:
        os.environ[_launch.ENV_COORDINATOR] = args.coordinator
    rank, num_processes = _launch.initialize()

    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import cgx_jax as cgx
    from cgx_jax.bench import _keep_freed_memory_mapped

    _keep_freed_memory_mapped()
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("p",))
    spec = P("p")
    sharding = NamedSharding(mesh, spec)
    n = len(devices)
    local = jax.local_devices()[0]
    if rank == 0:
        print(f"{num_processes} processes, {n} devices, host {socket.gethostname()} -> "
              f"{socket.gethostbyname(socket.gethostname())}", flush=True)

    def program(body):
        return jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=spec,
                                     out_specs=spec))

    def time_it(fn, x):
        for _ in range(args.warmup):
            jax.block_until_ready(fn(x))  # one program in flight at a time (DESIGN.md 6)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - start)
        return statistics.median(times), times, out

    def own_row(array):
        return np.asarray(array.addressable_shards[0].data[0], np.float32)

    rows = []
    for size in args.sizes:
        rng = np.random.default_rng(1000 + rank)
        mine = rng.standard_normal(size, dtype=np.float32)
        x = jax.make_array_from_single_device_arrays(
            (n, size), sharding, [jax.device_put(mine[None], local)])
        del mine
        methods = [("psum f32", "", 32, lambda v: jax.lax.psum(v, "p")),
                   ("psum bf16", "", 16,
                    lambda v: jax.lax.psum(v.astype(jnp.bfloat16), "p").astype(jnp.float32))]
        for algorithm in args.algorithms:
            for bits in args.bits:
                codec = cgx.Codec(bits=bits, bucket_size=args.bucket_size,
                                  rounding=args.rounding)
                methods.append((
                    f"cgx {algorithm} {bits}b", algorithm, bits,
                    lambda v, codec=codec, algorithm=algorithm: cgx.compressed_psum(
                        v, "p", codec=codec, key=jax.random.key(0), algorithm=algorithm)))
        reference = None
        for name, algorithm, bits, body in methods:
            fn = program(body)
            promoted = False
            if name == "psum bf16":
                # XLA:CPU promotes a bf16 all-reduce to f32 (its wire bytes are f32's).
                hlo = fn.lower(x).compile().as_text()
                promoted = any(" all-reduce(" in line and "= f32[" in line
                               for line in hlo.splitlines())
            seconds, times, out = time_it(fn, x)
            row_out = own_row(out)
            del out
            if reference is None:
                reference = row_out
                error = 0.0
            else:
                error = float(np.linalg.norm(row_out - reference) / np.linalg.norm(reference))
            rows.append(dict(elements=size, method=name, algorithm=algorithm, bits=bits,
                             seconds=seconds, times=times, rel_error=error,
                             wire_promoted_to_f32=promoted))
            if rank == 0:
                print(f"  {size_label(size):>5} {name:<16} {seconds * 1e3:10.2f} ms  "
                      f"rel err {error:.3e}", flush=True)
        del x, reference
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    # Keep every process alive until all are done with the last collective.
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("cgx_bench_allreduce_done")


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

            def step():
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

def add_ratios(rows: list[dict], num_processes: int) -> list[dict]:
    order = {size: i for i, size in enumerate(dict.fromkeys(r["elements"] for r in rows))}
    rows = sorted(rows, key=lambda r: order[r["elements"]])  # stable: JAX rows, then torch
    base = {}
    for r in rows:
        if r["method"] in ("psum f32", "psum bf16"):
            base[(r["elements"], r["method"])] = r["seconds"]
    for r in rows:
        size = r["elements"]
        r["algbw_gb_per_s"] = 2 * (num_processes - 1) / num_processes * 4 * size / r["seconds"] / 1e9
        r["vs_f32"] = base[(size, "psum f32")] / r["seconds"]
        r["vs_bf16"] = base[(size, "psum bf16")] / r["seconds"]
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'size':>6} {'method':<18} {'ms':>10} {'algbw GB/s':>11} {'x f32':>7} "
              f"{'x bf16':>7} {'rel err':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{size_label(r['elements']):>6} {r['method']:<18} "
                     f"{r['seconds'] * 1e3:>10.2f} {r['algbw_gb_per_s']:>11.3f} "
                     f"{r['vs_f32']:>7.2f} {r['vs_bf16']:>7.2f} {r['rel_error']:>9.2e}")
    return "\n".join(lines)


def format_markdown(rows: list[dict], title: str) -> str:
    notes = ""
    if any(r.get("wire_promoted_to_f32") for r in rows):
        notes = ("\n\nXLA promoted the bf16 all-reduce to f32 (compiled HLO), so `psum bf16` "
                 "moves f32 bytes here; an ideal bf16 psum would take half the f32 time.")
    lines = [f"{title}{notes}", "",
             "| size | method | ms | algbw GB/s | x f32 psum | x bf16 psum | rel. error |",
             "|---:|:---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {size_label(r['elements'])} | {r['method']} | {r['seconds'] * 1e3:.2f} "
                     f"| {r['algbw_gb_per_s']:.3f} | {r['vs_f32']:.2f} | {r['vs_bf16']:.2f} "
                     f"| {r['rel_error']:.2e} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- orchestrator

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--link", default="1gbit",
                   help="tc rate of every process's link (1gbit, 10gbit, 100mbit) or none "
                        "(unshaped loopback)")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[1 << 20, 16 << 20],
                   help="gradient sizes in f32 elements: 1M 16M 64M (default 1M 16M)")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--algorithms", nargs="+", default=["sra"],
                   choices=["sra", "ring", "allgather", "auto"])
    p.add_argument("--bucket-size", type=int, default=1024)
    p.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds before the worker processes are stopped (default 1800)")
    p.add_argument("--subnet", default="10.213.0",
                   help="first three octets of the private /24 used inside the namespaces")
    p.add_argument("--torch", default="auto", choices=["auto", "yes", "no"],
                   help="also measure PyTorch DDP (gloo) plain / fp16 hook / PowerSGD r4 in the "
                        "same network (auto: when torch is importable)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    p.add_argument("--markdown", default=None, help="also write a markdown table to this path")


def _worker_arguments(args, out: str, coordinator: str | None, kind: str = "--worker"
                      ) -> list[str]:
    cmd = [sys.executable, "-m", "cgx_jax.bench_allreduce", kind, "--out", out,
           "--sizes", *map(str, args.sizes), "--bits", *map(str, args.bits),
           "--algorithms", *args.algorithms, "--bucket-size", str(args.bucket_size),
           "--rounding", args.rounding, "--repeats", str(args.repeats),
           "--warmup", str(args.warmup)]
    if coordinator:
        cmd += ["--coordinator", coordinator]
    return cmd


class _Terminated(Exception):
    pass


def run(args) -> int:
    from cgx_jax.launch import launch

    rate = parse_rate(args.link)
    network = None
    note = ""
    if rate is not None:
        ok, why = can_shape()
        if ok:
            network = Network(args.processes, rate, args.link, args.subnet)
        else:
            note = (f"WARNING: cannot emulate a {args.link} link ({why}); running UNSHAPED on "
                    f"loopback instead")
            print(note, file=sys.stderr, flush=True)
    link_text = f"{args.link} tbf per link, netns/veth/bridge" if network else (
        "unshaped loopback" + (" (shaping unavailable)" if rate is not None else ""))

    def on_term(signum, frame):
        raise _Terminated(f"signal {signum}")

    previous = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
    use_torch = args.torch == "yes"
    if args.torch == "auto":
        import importlib.util
        use_torch = importlib.util.find_spec("torch") is not None
    tmp = tempfile.mkdtemp(prefix="cgx_bench_allreduce_")
    out = os.path.join(tmp, "rows.json")
    torch_out = os.path.join(tmp, "torch_rows.json")
    code = 1
    try:
        if network:
            network.create()
            coordinator = f"{network.address(0)}:{PORT}"
            torch_coordinator = f"{network.address(0)}:{PORT + 1}"
            # Every rank's command runs in its own namespace; launch() sets the rank.
            wrapper = ["sh", "-c",
                       f'exec ip netns exec {NS_PREFIX}"$CGX_JAX_PROCESS_ID" "$@"', "sh"]
        else:
            from cgx_jax.launch import free_port
            coordinator, torch_coordinator = None, f"127.0.0.1:{free_port()}"
            wrapper = []
        command = wrapper + _worker_arguments(args, out, coordinator)
        print(f"# all-reduce across {args.processes} processes x 1 CPU device, {link_text}; "
              f"median of {args.repeats} after {args.warmup} warm-up, "
              f"bucket {args.bucket_size}, {args.rounding} rounding", flush=True)
        start = time.monotonic()
        code = launch(command, args.processes, 1, timeout=args.timeout)
        if code == 0 and use_torch:
            print("# PyTorch DDP (gloo) in the same network", flush=True)
            torch_code = launch(wrapper + _worker_arguments(args, torch_out, torch_coordinator,
                                                            "--torch-worker"),
                                args.processes, 1, timeout=args.timeout)
            if torch_code != 0:
                print(f"cgx_jax.bench allreduce: the PyTorch run failed (exit code "
                      f"{torch_code}); reporting the JAX rows only", file=sys.stderr)
                if torch_code == 130:
                    code = 130
        elapsed = time.monotonic() - start
    except (KeyboardInterrupt, _Terminated) as e:
        print(f"cgx_jax.bench allreduce: interrupted ({e or 'Ctrl-C'}); cleaning up",
              file=sys.stderr)
        code = 130
    finally:
        problems = network.remove() if network else []
        for s, handler in previous.items():
            signal.signal(s, handler)
        if problems:
            print("cgx_jax.bench allreduce: cleanup problems:\n  " + "\n  ".join(problems),
                  file=sys.stderr)
        rows = None
        if code == 0 and os.path.exists(out):
            with open(out) as f:
                rows = json.load(f)
            if os.path.exists(torch_out):
                with open(torch_out) as f:
                    rows += json.load(f)
        shutil.rmtree(tmp, ignore_errors=True)
    if code != 0 or rows is None:
        print(f"cgx_jax.bench allreduce: workers failed (exit code {code})", file=sys.stderr)
        return code or 1
    rows = add_ratios(rows, args.processes)
    title = (f"all-reduce, {args.processes} processes, {link_text}, median of {args.repeats}; "
             f"algbw = 2(N-1)/N * 4 B * size / time")
    print(f"# {title} (wall {elapsed:.0f} s)")
    if note:
        print(f"# {note}")
    print(format_table(rows))
    if any(r.get("wire_promoted_to_f32") for r in rows):
        print("# note: XLA promoted the bf16 all-reduce to f32 (compiled HLO), so 'psum bf16' "
              "moves f32 bytes here; the ideal bf16 psum would take half the f32 time")
    meta = dict(processes=args.processes, link=args.link, shaped=network is not None,
                note=note, repeats=args.repeats, warmup=args.warmup,
                bucket_size=args.bucket_size, rounding=args.rounding,
                command="python -m cgx_jax.bench allreduce " + " ".join(args.argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(rows, f"`{meta['command']}`: {title}"))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cgx_jax.bench allreduce",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.worker:
        _worker(args)
        return 0
    if args.torch_worker:
        _torch_worker(args)
        return 0
    if args.processes < 2:
        parser.error("--processes must be at least 2")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
