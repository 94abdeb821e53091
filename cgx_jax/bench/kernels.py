"""Kernel throughput: ``python -m cgx_jax.bench kernels [--sizes ...] [--bits ...] [--isa all]
[--json PATH]``.

Every figure is reported next to a baseline measured in the same run: a memcpy of the same
f32 buffer on CPU (numpy, one thread), a device-to-device copy on GPU. Throughput is GB/s of
f32 input (4 bytes per value the kernel encodes, decodes or reduces), so a ratio of 1.0 means
"as fast as copying the uncompressed gradient once". On CPU, ``--isa all`` times every
instruction-set variant of the loops this CPU runs, each in its own process (the variant is
chosen once per process, CGX_JAX_CPU_ISA), one table after another.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from cgx_jax._src.backends import ffi
from cgx_jax._src.codec import Codec, packet_bytes
from cgx_jax._src.memory import keep_freed_memory_on_cpu
from cgx_jax.bench.common import cpu_description, median_seconds, parse_size


def _copy_seconds(x, repeats: int, calls: int) -> float:
    if x.devices().pop().platform == "cpu":
        host = np.asarray(x)
        # The destination at the source's offset within a 4 KiB page: two heap blocks a few
        # bytes apart modulo 4 KiB make the CPU stall loads behind unrelated stores (4K
        # aliasing, docs/design.md section 5), which would flatter the ratios.
        room = np.empty(host.nbytes + 4096, np.uint8)
        start = (host.ctypes.data - room.ctypes.data) % 4096
        dst = room[start:start + host.nbytes].view(host.dtype).reshape(host.shape)
        return median_seconds(lambda: np.copyto(dst, host), repeats)
    # Negation reads and writes every byte once, like a copy XLA cannot elide.
    copy = jax.jit(jnp.negative)
    return median_seconds(lambda: copy(x), repeats, calls)


def kernel_rows(sizes, bits_list, peers: int, repeats: int, device,
                roundings=("stochastic",), bucket_sizes=(1024,)) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    seed = jax.device_put(jnp.array([1234, 5678], jnp.uint32), device)
    calls = 1 if device.platform == "cpu" else 10
    for size in sizes:
        x = jax.device_put(jax.random.normal(key, (1, size), jnp.float32), device)
        copy_s = _copy_seconds(x, repeats, calls)
        gbytes = size * 4 / 1e9
        rows.append(dict(kernel="copy (baseline)", elements=size, bits=32, rounding="-",
                         bucket=None, seconds=copy_s, gb_per_s=gbytes / copy_s, vs_copy=1.0))
        for bits, rounding, bucket in [(b, r, k) for b in bits_list for r in roundings
                                       for k in bucket_sizes]:
            codec = Codec(bits=bits, bucket_size=bucket, rounding=rounding)
            quantize = jax.jit(lambda v: ffi.quantize_rows(v, seed, codec))
            packets = quantize(x).block_until_ready()
            dequantize = jax.jit(lambda p: ffi.dequantize_rows(p, codec, size, jnp.float32))
            chunk = size // peers
            peer_packets = jax.device_put(jnp.tile(packets[:, : packet_bytes(chunk, codec)],
                                                   (peers, 1)), device)
            own = x[0, :chunk]
            reduce = jax.jit(lambda p, o: ffi.reduce_requantize(p, o, 0, seed, codec, chunk))
            for name, fn in (
                ("quantize", lambda: quantize(x)),
                ("dequantize", lambda: dequantize(packets)),
                (f"reduce_requantize N={peers}", lambda: reduce(peer_packets, own)),
            ):
                seconds = median_seconds(fn, repeats, calls)
                rows.append(dict(kernel=name, elements=size, bits=bits, rounding=rounding,
                                 bucket=bucket, seconds=seconds, gb_per_s=gbytes / seconds,
                                 vs_copy=copy_s / seconds))
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'kernel':<24} {'elements':>10} {'bits':>4} {'rounding':<10} {'bucket':>6} "
              f"{'ms':>9} {'GB/s':>8} {'x copy':>7}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['kernel']:<24} {r['elements']:>10} {r['bits']:>4} {r['rounding']:<10} "
                     f"{r['bucket'] or '-':>6} {r['seconds'] * 1e3:>9.2f} {r['gb_per_s']:>8.2f} "
                     f"{r['vs_copy']:>7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgx_jax.bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[1 << 22, 1 << 26],
                        help="elements per buffer: 4M 64M (default), 1048576, 64K")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounding", nargs="+", default=["stochastic"],
                        choices=("stochastic", "nearest"))
    parser.add_argument("--bucket-sizes", type=int, nargs="+", default=[1024],
                        help="values per bucket (default 1024)")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--platform", default=None, help="cpu or gpu (default: JAX's default)")
    parser.add_argument("--isa", default="auto",
                        help="CPU loops: auto (the library's choice), generic, avx2, avx512, "
                             "or all (every variant this CPU runs, one process each)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if args.peers < 1:
        parser.error(f"--peers must be at least 1, got {args.peers}")
    for size in args.bucket_sizes:
        try:
            Codec(bucket_size=size)
        except ValueError as error:
            parser.error(f"--bucket-sizes: {error}")
    bucket = max(args.bucket_sizes)
    too_small = [s for s in args.sizes if s < bucket * args.peers]
    if too_small:
        parser.error(f"--sizes must be at least one {bucket}-value bucket per peer "
                     f"({bucket * args.peers} with --peers {args.peers}), got {too_small}")
    bad_bits = [b for b in args.bits if not 1 <= b <= 8]
    if bad_bits:
        parser.error(f"--bits must be 1..8, got {bad_bits}")

    from cgx_jax import _cgx_cpu

    variants = [v.removeprefix("isa_") for v in _cgx_cpu.cpu_variants()]
    if args.isa == "all":
        return _run_each_variant(argv if argv is not None else sys.argv[1:], variants)
    if args.isa != "auto":
        if args.isa not in variants:
            parser.error(f"--isa {args.isa} does not run on this CPU; it runs {variants} or all")
        if os.environ.get("CGX_JAX_CPU_ISA") != args.isa:  # chosen at the first kernel call
            return _run_each_variant(argv if argv is not None else sys.argv[1:], [args.isa])

    keep_freed_memory_on_cpu()  # as launch.initialize applies it in a launched process
    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    sizes = [s - s % (bucket * args.peers) for s in args.sizes]
    rows = kernel_rows(sizes, args.bits, args.peers, args.repeats, device, args.rounding,
                       args.bucket_sizes)
    threads = os.environ.get("CGX_JAX_CPU_THREADS", "all")
    print(f"# cgx_jax kernels on {device.device_kind} ({device.platform}), "
          f"{platform.machine()} CPU loops {_cgx_cpu.cpu_isa()}, CGX_JAX_CPU_THREADS={threads}, "
          "GB/s of f32 input "
          f"(reduce_requantize: N={args.peers} chunks of size/N)")
    print(f"# CPU: {cpu_description()}")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), cpu=cpu_description(), threads=threads,
                           rows=rows), f, indent=2)
    return 0


def _run_each_variant(argv: list[str], variants: list[str]) -> int:
    """Runs this benchmark once per variant, each in a process of its own."""
    status = 0
    for isa in variants:
        args = list(argv)
        if "--isa" in args:
            i = args.index("--isa")
            args[i + 1] = isa
        else:
            args += ["--isa", isa]
        if "--json" in args:  # one file per variant: PATH -> PATH.isa
            i = args.index("--json")
            args[i + 1] = f"{args[i + 1]}.{isa}"
        env = dict(os.environ, CGX_JAX_CPU_ISA=isa)
        status |= subprocess.run([sys.executable, "-m", "cgx_jax.bench", "kernels", *args],
                                 env=env).returncode
    return status
