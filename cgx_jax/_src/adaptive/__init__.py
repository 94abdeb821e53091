"""Layer-wise adaptive compression: per-leaf bit widths under a size budget (L-GreCo-style) or
a time budget on a measured link (Kimad-style; docs/design.md section 7).

- ``measure``: ``layer_errors`` -> ``ErrorTable`` (squared error and bytes per candidate leaf
  and bit width, with the real codec).
- ``fit``: ``fit_policy``, an exact dynamic program (multiple-choice knapsack) that picks one
  width per leaf and returns a ``LayerPolicy``.
- ``schedule``: ``AdaptiveConfig`` (when to refit), the statistics kept by
  ``compressed_allreduce(..., adaptive=...)``, and ``refit_policy``.
- ``link_watch``: ``LinkWatch``, the link's rate re-estimated from measured step times.
"""

from cgx_jax._src.adaptive.fit import fit_policy
from cgx_jax._src.adaptive.link_watch import LinkWatch
from cgx_jax._src.adaptive.measure import ErrorTable, layer_errors
from cgx_jax._src.adaptive.schedule import AdaptiveConfig, AdaptiveState, refit_policy

__all__ = ["AdaptiveConfig", "AdaptiveState", "ErrorTable", "LinkWatch", "fit_policy",
           "layer_errors", "refit_policy"]
