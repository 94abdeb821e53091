"""The one place that knows about Flax, which cgx_jax does not require: a value can only be
a Flax NNX object if the user's program imported Flax already, so nothing here imports it
first (importing cgx_jax never pays for Flax, and works without it).
"""

from __future__ import annotations

import functools
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


def decoded_at_use(value: tuple, decode):
    """An ``nnx.Param`` that holds ``value`` (a tuple of arrays) and reads as
    ``decode(*value)`` wherever the model reads it (``variable[...]``, ``.value``, ``.shape``,
    ``jnp`` of it): a weight decoded where it is used, so that a layer under ``nnx.remat``
    decodes it again in the backward pass instead of keeping it. A ``Variable`` subclass
    overriding ``get_value``, as Flax asks instead of its deprecated hooks."""
    return _decoded_param_type()(value, decode=decode)


@functools.cache
def _decoded_param_type():
    from flax.typing import MISSING  # what Variable.get_value's index defaults to

    class DecodedAtUse(nnx().Param):
        """A parameter decoded from what it holds each time it is read."""

        def get_value(self, *, index=MISSING):
            value = self.get_metadata()["decode"](*self.get_raw_value())
            return value if index is MISSING or index is ... else value[index]

        def __getattr__(self, name: str):  # .dtype, .ndim, .T: the decoded array's
            metadata = object.__getattribute__(self, "_var_metadata")
            return metadata[name] if name in metadata else getattr(self.get_value(), name)

    return DecodedAtUse
