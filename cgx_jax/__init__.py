"""cgx_jax: communication-efficient data-parallel training for JAX.

CGX-style compressed all-reduce (Markov et al., arXiv 2111.08617): gradients travel as
1-8-bit bucket-quantized packets, encoded and reduced by XLA FFI kernels (C++ on CPU, CUDA
on GPU), moved only by XLA's own collectives. The design, module by module, is
docs/design.md.
"""

# ruff: noqa: F405 (the names of __all__ come from the star import below, or __getattr__)
import typing as _typing

__version__ = "0.1.0"

__all__ = [
    "AdaptiveConfig",
    "Codec",
    "CompressedAllReduceState",
    "ErrorTable",
    "LayerPolicy",
    "LinkProfile",
    "LinkWatch",
    "ProcessesDisagreeError",
    "compressed_all_gather",
    "compressed_allreduce",
    "compressed_pmean",
    "compressed_psum",
    "compressed_psum_scatter",
    "dequantize",
    "estimate",
    "fit_policy",
    "has_cuda_support",
    "init_residual",
    "keep_freed_memory",
    "layer_errors",
    "leaf_paths",
    "local_value_and_grad",
    "packet_bytes",
    "quantize",
    "refit_policy",
    "shard_state",
    "state_specs",
    "summary",
    "tree_wire_bytes",
    "value_and_grad",
    "wire_bytes",
]


if _typing.TYPE_CHECKING:  # type checkers and IDEs see the names where they are defined
    from cgx_jax._src.public import *  # noqa: F403
else:

    def __getattr__(name: str):
        """Imports the API at its first use, so that ``python -m cgx_jax.launch``, which
        needs none of it, starts without importing jax."""
        if name not in __all__:
            raise AttributeError(f"module 'cgx_jax' has no attribute {name!r}")
        from cgx_jax._src import public

        globals().update((n, getattr(public, n)) for n in __all__)
        return globals()[name]

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))
