"""``python -m cgx_jax.bench COMMAND [options]``: runs one benchmark."""

from __future__ import annotations

import sys

USAGE = """usage: python -m cgx_jax.bench COMMAND [options]

COMMAND is one of:

  kernels     quantize / dequantize / reduce_requantize throughput against a copy
  allreduce   psum vs bf16 psum vs compressed_psum across N processes on an emulated
              (netns + tc) link
  compile     trace + compile time of one training step, exact vs cgx (simulated devices)
  link        what decides whether compression pays here (exact and compressed all-reduce
              of a few sizes across N processes), fitted and written for cgx.estimate
  train       data-parallel training steps (exact pmean vs cgx) across N processes on an
              emulated link: s/step, the no-all-reduce floor, wire bytes, loss
  adapt       training while the link's rate changes (1gbit, 200mbit, 1gbit): exact, 4 bits
              and bits refitted to a step-time budget on the link as measured (Kimad)
  converge    held-out loss at equal steps on real text (the standard library's sources):
              exact vs defaults vs error feedback vs adaptive bits, and the time each
              takes to reach the exact run's final loss at a measured link

python -m cgx_jax.bench COMMAND -h shows the options of one."""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "kernels":
        from cgx_jax.bench import kernels
        return kernels.main(rest)
    if command == "allreduce":
        from cgx_jax.bench import allreduce
        return allreduce.main(rest)
    if command == "compile":
        from cgx_jax.bench import compile as compile_bench
        return compile_bench.main(rest)
    if command == "link":
        from cgx_jax.bench import link
        return link.main(rest)
    if command == "train":
        from cgx_jax.bench import train
        return train.main(rest)
    if command == "adapt":
        from cgx_jax.bench import adapt
        return adapt.main(rest)
    if command == "converge":
        from cgx_jax.bench import converge
        return converge.main(rest)
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    print(USAGE, file=sys.stderr)
    problem = "a command is required" if command is None else f"unknown command {command!r}"
    print(f"python -m cgx_jax.bench: error: {problem}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
