"""Measures what decides whether compression pays on this system and writes it as a link
profile for ``cgx.estimate``: ``python -m cgx_jax.bench link --processes 4 --link 1gbit``.

It times, across the real processes, ``lax.psum`` of f32 gradients (at a few sizes, as one
array and as the 80 leaves of a ViT) and ``compressed_psum`` of one array (default
algorithm, 2, 4 and 8 bits, the default codec's bucket) at the same sizes (the allreduce
benchmark's worker, ``--repeats`` timed calls after warm-up, medians), and fits the two
lines of ``cgx_jax._src.link_model``: the exact all-reduce's latency, seconds per byte and
per extra leaf, the compressed one's latency, seconds per wire byte (the network) and
seconds per value (the kernels on these CPUs, every process running them at once). The
fit and its error per measurement are printed; the profile is written as JSON (``--out``,
``{link}`` replaced by the link rate), with the measurements in it.

Two ways to run it:

- here, on an emulated network: ``--processes N --link RATE [RATE ...]`` (network
  namespaces behind ``tc tbf`` links when root, as ``bench allreduce``; ``--link none``:
  loopback, unshaped);
- on your cluster, as one of your processes: ``--launched`` under ``python -m
  cgx_jax.launch`` or any launcher ``jax.distributed.initialize()`` detects (SLURM, Open
  MPI...); process 0 writes the profile.
"""

from __future__ import annotations

import argparse
import os
import sys

from cgx_jax._src.codec import Codec, wire_bytes
from cgx_jax._src.link_model import fit_profile
from cgx_jax.bench import allreduce
from cgx_jax.bench.common import (
    add_worker_arguments,
    check_network_arguments,
    cpu_description,
    parse_size,
    run_links,
    size_label,
)

SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24)  # 256K to 16M values: latency to bandwidth
BITS = (2, 4, 8)
BUCKET = Codec().bucket_size  # the default codec's
NS_PREFIX = "cgxlink"


def _allreduce_args(args, out: str | None = None) -> argparse.Namespace:
    """The allreduce benchmark's settings for these measurements."""
    p = argparse.ArgumentParser()
    allreduce.add_arguments(p)
    add_worker_arguments(p)
    argv = ["--processes", str(args.processes), "--sizes", *map(str, args.sizes),
            "--bits", *map(str, BITS), "--algorithms", "auto", "--torch", "no",
            "--layouts", "flat", "vit", "--fit-only",
            "--bucket-size", str(BUCKET), "--repeats", str(args.repeats), "--warmup", "2",
            "--timeout", str(args.timeout), "--netns-prefix", args.netns_prefix,
            "--subnet", args.subnet]
    return p.parse_args(argv + (["--out", out] if out else []))


def _report(rows: list[dict], processes: int, link: str, path: str) -> None:
    """Fits, prints and writes one link's profile."""
    for r in rows:
        r["leaves"] = len(allreduce.leaf_sizes(r["layout"], r["elements"]))
    description = f"{processes} processes, link {link}; CPU: {cpu_description()}"
    profile = fit_profile(rows, processes, BUCKET, description)
    print(f"# link profile: {description}")
    print(f"  exact f32 psum:     {profile.exact_latency * 1e3:8.3f} ms + "
          f"{profile.seconds_per_byte * 1e9:8.4f} ns/byte + "
          f"{profile.seconds_per_leaf * 1e3:6.3f} ms/extra leaf")
    print(f"  compressed (auto):  {profile.compressed_latency * 1e3:8.3f} ms + "
          f"{profile.seconds_per_wire_byte * 1e9:8.4f} ns/wire byte + "
          f"{profile.seconds_per_value * 1e9:8.4f} ns/value (kernels)")
    print(f"  {'size':>6} {'leaves':>6} {'method':<14} {'measured ms':>12} {'fitted ms':>10}")
    for r in rows:
        if r["method"] == "psum f32":
            fitted = profile.exact_seconds(4 * r["elements"], r["leaves"])
        elif r["method"].startswith("cgx ") and r["leaves"] == 1:
            codec = Codec(bits=r["bits"], bucket_size=BUCKET)
            fitted = profile.compressed_seconds(wire_bytes(r["elements"], codec), r["elements"])
        else:
            continue
        print(f"  {size_label(r['elements']):>6} {r['leaves']:>6} {r['method']:<14} "
              f"{r['seconds'] * 1e3:>12.2f} "
              f"{fitted * 1e3:>10.2f}")
    profile.save(path, link=link, measurements=rows)
    print(f"# written to {path}: cgx.estimate(grads, {path!r})", flush=True)


def _run_here(args) -> int:
    def run_link(link, tmp):
        code, rows, note = allreduce.run_link(_allreduce_args(args), link, False, tmp)
        if code == 0:
            _report(rows, args.processes, rows[0]["link"], args.out.format(link=link))
        return code, rows, note

    code, _, _ = run_links("link", args.link, run_link)
    if code != 0:
        print(f"cgx_jax.bench link: workers failed (exit code {code})", file=sys.stderr)
    return code


def _run_launched(args) -> int:
    """This process is one of a launched set: measure with the others; process 0 fits."""
    import tempfile

    import jax

    out = os.path.join(tempfile.mkdtemp(prefix="cgx_link_"), "rows.json")
    allreduce.worker(_allreduce_args(args, out))
    if jax.process_index() == 0:
        import json
        with open(out) as f:
            rows = json.load(f)
        _report(rows, jax.device_count(), "launched", args.out.format(link="launched"))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m cgx_jax.bench link", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--link", nargs="+", default=["1gbit"],
                   help="tc rate of every process's link (1gbit, 10gbit, 100mbit) or none "
                        "(unshaped loopback); several values run one after the other")
    p.add_argument("--launched", action="store_true",
                   help="run as one process of an already launched set (your cluster)")
    p.add_argument("--out", default="cgx_link_{link}.json",
                   help="the profile's path; {link} is replaced by the link rate")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=list(SIZES),
                   help="gradient sizes in f32 values (default 256K 1M 4M 16M)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--subnet", default="10.214.0")
    p.add_argument("--netns-prefix", default=NS_PREFIX)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if len(set(args.sizes)) < 2:
        p.error(f"--sizes needs two different sizes or more to fit a line, got {args.sizes}")
    if args.launched:
        return _run_launched(args)
    check_network_arguments(p, args)
    return _run_here(args)


if __name__ == "__main__":
    sys.exit(main())
