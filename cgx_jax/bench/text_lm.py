"""The convergence benchmark's language model: a byte-level decoder in the style of JAX's
Training Cookbook (plain dict parameters, pre-norm attention and MLP blocks), trained on
text every Python installation has offline, the standard library's own sources.

The corpus is the ``*.py`` files at the top of ``sysconfig.get_path("stdlib")``, sorted by
name; every tenth file (the 1st, 11th, ...) is held out, so the held-out loss is measured on
modules the model never saw. The text differs between Python versions (3.11's is about
4.7 MB), so ``corpus()`` describes what it read and the benchmark reports it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import sysconfig

import numpy as np

VOCAB = 256  # bytes
HELD_OUT_EVERY = 10  # every tenth file of the sorted list is held out


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8, the training files joined by newlines
    held_out: np.ndarray  # uint8, the held-out files joined the same way
    description: str


def corpus(max_train_bytes: int | None = None) -> Corpus:
    """The standard library's top-level sources, split by file into train and held out.

    Example:
        >>> c = corpus()
        >>> c.train.dtype, len(c.train) > 10 * len(c.held_out) // 2
        (dtype('uint8'), True)
    """
    folder = sysconfig.get_path("stdlib")
    files = sorted(glob.glob(os.path.join(folder, "*.py")))
    if len(files) < 2 * HELD_OUT_EVERY:
        raise RuntimeError(f"the standard library's sources were not found in {folder!r} "
                           f"({len(files)} .py files): the benchmark's text needs them")

    def joined(paths):
        parts = []
        for path in paths:
            with open(path, "rb") as f:
                parts.append(f.read())
        return np.frombuffer(b"\n".join(parts), dtype=np.uint8)

    held_out = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = joined([f for i, f in enumerate(files) if i % HELD_OUT_EVERY])
    if max_train_bytes is not None:
        train = train[:max_train_bytes]
    held = joined(held_out)
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(train, held, f"Python {version} standard library: {len(files)} top-level "
                               f"modules, {len(train):,} training bytes, {len(held):,} held-out "
                               f"bytes ({len(held_out)} modules)")


def train_batch(text: np.ndarray, step: int, batch: int, length: int, seed: int) -> np.ndarray:
    """``batch`` windows of ``length + 1`` bytes at offsets drawn from ``(seed, step)``: the
    same for every mode of a run, a new draw every step."""
    starts = np.random.default_rng([seed, step]).integers(0, len(text) - length - 1, batch)
    return text[starts[:, None] + np.arange(length + 1)].astype(np.int32)


def held_out_batches(text: np.ndarray, count: int, length: int) -> np.ndarray:
    """``count`` windows of ``length + 1`` bytes spread evenly over the held-out text."""
    starts = np.linspace(0, len(text) - length - 1, count).astype(np.int64)
    return text[starts[:, None] + np.arange(length + 1)].astype(np.int32)


@dataclasses.dataclass(frozen=True)
class LMConfig:
    width: int = 128
    depth: int = 2
    heads: int = 4
    length: int = 128  # context, bytes

    @property
    def mlp(self) -> int:
        return 4 * self.width


def init(key, config: LMConfig) -> dict:
    """Parameters: ``embed`` (256 x width), ``position``, ``block{i}`` (``norm1``, ``qkv``,
    ``proj``, ``norm2``, ``up``, ``down``), ``norm`` and ``out`` (width x 256, untied)."""
    import jax
    import jax.numpy as jnp

    keys = iter(jax.random.split(key, 3 + 4 * config.depth))
    w = config.width

    def dense(fan_in, fan_out, scale=1.0):
        return scale * jax.random.normal(next(keys), (fan_in, fan_out)) / jnp.sqrt(fan_in)

    params = {"embed": jax.random.normal(next(keys), (VOCAB, w)),
              "position": 0.02 * jax.random.normal(next(keys), (config.length, w)),
              "norm": jnp.ones((w,)), "out": dense(w, VOCAB)}
    for i in range(config.depth):
        # The residual branches' output layers start small (GPT-2's 1/sqrt(2 * depth)).
        small = 1 / (2 * config.depth) ** 0.5
        params[f"block{i}"] = {"norm1": jnp.ones((w,)), "qkv": dense(w, 3 * w),
                               "proj": dense(w, w, small), "norm2": jnp.ones((w,)),
                               "up": dense(w, config.mlp), "down": dense(config.mlp, w, small)}
    return params


def apply(params: dict, tokens, config: LMConfig):
    """Next-byte logits, ``(batch, length, 256)``, of ``tokens`` ``(batch, length)``."""
    import jax
    import jax.numpy as jnp

    def rms_norm(x, scale):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale

    b, t = tokens.shape
    x = params["embed"][tokens] + params["position"][:t]
    for i in range(config.depth):
        p = params[f"block{i}"]
        q, k, v = jnp.split(rms_norm(x, p["norm1"]) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, config.heads, -1) for a in (q, k, v))
        attention = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + attention.reshape(b, t, -1) @ p["proj"]
        x = x + jax.nn.gelu(rms_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
    return rms_norm(x, params["norm"]) @ params["out"]


def loss(params: dict, windows, config: LMConfig):
    """Mean next-byte cross entropy (nats) over ``windows`` ``(batch, length + 1)``."""
    import optax

    logits = apply(params, windows[:, :-1], config)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()
