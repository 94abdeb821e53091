"""A small Vision Transformer in Flax NNX: patch embedding, class token, learned positions,
pre-norm blocks (multi-head self-attention + MLP) and an MLP head.

Parameter paths read like ``blocks/0/attn/qkv/kernel``, which is what ``cgx.LayerPolicy``
regexes and ``cgx.summary`` see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Attention(nnx.Module):
    """Multi-head self-attention with one fused ``qkv`` projection and an output ``proj``."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (batch, tokens, heads, head_dim)
        y = jax.nn.dot_product_attention(q, k, v)
        return self.proj(y.reshape(batch, tokens, dim))


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, out: int, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, out, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = Attention(dim, heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nnx.Module):
    """Vision Transformer for ``(batch, height, width, channels)`` images.

    The image is cut into ``patch x patch`` patches, each embedded linearly; a learned class
    token is prepended, learned position embeddings added, ``depth`` pre-norm blocks applied,
    and the class token's final (normed) state goes through an MLP head to the logits.
    """

    def __init__(self, *, image_size: int, channels: int, num_classes: int, patch: int = 2,
                 dim: int = 64, depth: int = 3, heads: int = 4, mlp_ratio: float = 2.0,
                 rngs: nnx.Rngs):
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not divisible by patch size {patch}")
        self.patch = patch
        tokens = (image_size // patch) ** 2 + 1
        self.patch_embed = nnx.Linear(patch * patch * channels, dim, rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
        self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, tokens, dim)))
        self.blocks = nnx.List([Block(dim, heads, mlp_ratio, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = MLP(dim, dim, num_classes, rngs=rngs)

    def __call__(self, images):
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = self.patch_embed(x.reshape(b, (h // p) * (w // p), p * p * c))
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))
