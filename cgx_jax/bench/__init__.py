"""Benchmarks, each against a baseline measured in the same run (docs/design.md section 9):

- ``python -m cgx_jax.bench kernels``: quantize / dequantize / reduce_requantize throughput
  against a copy of the same buffer (``cgx_jax.bench.kernels``).
- ``python -m cgx_jax.bench allreduce``: ``compressed_psum`` against ``lax.psum`` across real
  processes on an emulated network (``cgx_jax.bench.allreduce``).

torch and matplotlib are imported only by the code paths that need them.
"""
