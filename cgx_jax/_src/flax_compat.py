"""The one place that knows about Flax, which cgx_jax does not require: a value can only be
a Flax NNX object if the user's program imported Flax already, so nothing here imports it
first (importing cgx_jax never pays for Flax, and works without it).
"""

from __future__ import annotations

import functools
import sys

import jax


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
    ``decode(*value)`` wherever the model reads it (``variable[...]``, ``.value``, ``jnp`` of
    it; ``.shape``, ``.dtype``, ``.ndim`` and ``.size`` come from the decoded array's
    abstract value, decoding nothing): a weight decoded where it is used, so that a layer
    under ``nnx.remat`` decodes it again in the backward pass instead of keeping it. A
    ``Variable`` subclass overriding ``get_value``, as Flax asks instead of its deprecated
    hooks. ``decode_count(variable)`` says how often it was decoded."""
    return _decoded_param_type()(value, decode=decode, decodes=[0])


def decode_count(variable) -> int | None:
    """How many times a ``decoded_at_use`` parameter was decoded (None for another one)."""
    decodes = variable.get_metadata().get("decodes") if is_variable(variable) else None
    return None if decodes is None else decodes[0]


@functools.cache
def _decoded_param_type():
    from flax.typing import MISSING  # what Variable.get_value's index defaults to

    class DecodedAtUse(nnx().Param):
        """A parameter decoded from what it holds each time it is read."""

        def get_value(self, *, index=MISSING):
            metadata = self.get_metadata()
            metadata["decodes"][0] += 1
            value = metadata["decode"](*self.get_raw_value())
            return value if index is MISSING or index is ... else value[index]

        def __getattr__(self, name: str):  # .dtype, .ndim, .T: the decoded array's
            metadata = object.__getattribute__(self, "_var_metadata")
            if name in metadata:
                return metadata[name]
            if name in ("shape", "dtype", "ndim", "size"):  # no decode for what is static
                return getattr(jax.eval_shape(metadata["decode"], *self.get_raw_value()),
                               name)
            return getattr(self.get_value(), name)

    return DecodedAtUse
