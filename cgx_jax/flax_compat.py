"""The one place that knows about Flax, which cgx_jax does not require: a value can only be
a Flax NNX object if the user's program imported Flax already, so nothing here imports it
first (importing cgx_jax never pays for Flax, and works without it).
"""

from __future__ import annotations

import sys


def nnx():
    """``flax.nnx`` if the program has imported Flax, else ``None``."""
    if "flax" not in sys.modules:
        return None
    from flax import nnx as module
    return module


def _isinstance(value, *names: str) -> bool:
    module = nnx()
    return module is not None and isinstance(value, tuple(getattr(module, n) for n in names))


def is_module(value) -> bool:
    """An ``nnx.Module``."""
    return _isinstance(value, "Module")


def is_state(value) -> bool:
    """An ``nnx.State`` (a module's variables, or their gradients)."""
    return _isinstance(value, "State")


def is_variable(value) -> bool:
    """An ``nnx.Variable`` (a parameter, an RNG key, a batch statistic, ...)."""
    return _isinstance(value, "Variable")


def is_optimizer_or_state(value) -> bool:
    """An ``nnx.Optimizer`` or an ``nnx.State``: optimizer state whose every leaf is wrapped
    in a Variable."""
    return _isinstance(value, "Optimizer", "State")
