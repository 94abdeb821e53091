"""Argument checks shared by the public entry points: each raises a ``ValueError`` or
``TypeError`` that names the argument, the value given and what is allowed
(docs/design.md section 8)."""

from __future__ import annotations

from cgx_jax._src.codec import Codec


def check_choice(name: str, value, allowed) -> None:
    """``ValueError`` unless ``value`` is one of ``allowed``.

    Example:
        >>> check_choice("backend", "ffi", ("ffi", "jax"))
    """
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def check_codec(codec, name: str = "codec") -> None:
    """``TypeError`` unless ``codec`` is a ``cgx_jax.Codec``."""
    if not isinstance(codec, Codec):
        raise TypeError(f"{name} must be a cgx_jax.Codec, got {codec!r} of type "
                        f"{type(codec).__name__}")
