"""cgx_jax: communication-efficient data-parallel training for JAX.

CGX-style compressed all-reduce (Markov et al., arXiv 2111.08617): gradients travel as
1-8-bit bucket-quantized packets, encoded and reduced by XLA FFI kernels (C++ on CPU, CUDA
on GPU), moved only by XLA's own collectives. The design, module by module, is
docs/design.md.
"""

from cgx_jax._src.adaptive import (
    AdaptiveConfig,
    ErrorTable,
    LinkWatch,
    fit_policy,
    layer_errors,
    refit_policy,
)
from cgx_jax._src.api import compressed_pmean, compressed_psum, dequantize, quantize
from cgx_jax._src.backends.ffi import has_cuda_support
from cgx_jax._src.codec import Codec, packet_bytes, wire_bytes
from cgx_jax._src.consistency import ProcessesDisagreeError
from cgx_jax._src.data_parallel import init_residual, value_and_grad
from cgx_jax._src.link_model import LinkProfile, estimate
from cgx_jax._src.memory import keep_freed_memory
from cgx_jax._src.optax_transform import (
    CompressedAllReduceState,
    compressed_allreduce,
    shard_state,
    state_specs,
)
from cgx_jax._src.policy import LayerPolicy, leaf_paths, summary, tree_wire_bytes
from cgx_jax._src.sharded import compressed_all_gather, compressed_psum_scatter
from cgx_jax._src.vma import local_value_and_grad

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
