"""Everything ``cgx_jax`` exports, imported in one go the first time a program uses one of
its names (``cgx_jax.__getattr__``): ``import cgx_jax`` alone, as ``python -m cgx_jax.launch``
does, imports no jax. The list of names is ``cgx_jax.__all__``."""
# ruff: noqa: F401 (imported to be exported)

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
