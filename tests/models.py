"""The small models and data of the policy, Optax and adaptive tests: a ViT-like Flax Linen
block, and a regression problem (a random two-layer teacher) that the Optax and adaptive tests
train on the 8 simulated CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

NUM_DEVICES = 8


class LinenBlock(nn.Module):
    """A small ViT-like block: norm, attention projections, MLP, head."""

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(name="norm1")(x)
        y = nn.Dense(3 * 64, name="qkv")(y)
        y = nn.Dense(64, name="proj")(y[..., :64])
        x = x + y
        y = nn.LayerNorm(name="norm2")(x)
        y = nn.Dense(256, name="fc1")(y)
        x = x + nn.Dense(64, name="fc2")(nn.gelu(y))
        return nn.Dense(10, name="head")(x)


def teacher_data():
    """Per-device regression data from a random two-layer teacher."""
    kx, ka, kb = jax.random.split(jax.random.key(42), 3)
    x = jax.random.normal(kx, (NUM_DEVICES, 64, 32))
    a = jax.random.normal(ka, (32, 64)) / np.sqrt(32)
    b = jax.random.normal(kb, (64, 16)) / np.sqrt(64)
    return x, jnp.tanh(x @ a) @ b


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"dense1": {"kernel": jax.random.normal(k1, (32, 64)) * 0.1, "bias": jnp.zeros(64)},
            "dense2": {"kernel": jax.random.normal(k2, (64, 16)) * 0.1, "bias": jnp.zeros(16)}}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return jnp.mean((h @ params["dense2"]["kernel"] + params["dense2"]["bias"] - y) ** 2)


def replicate(tree):
    return jax.tree.map(lambda v: jnp.broadcast_to(v, (NUM_DEVICES, *jnp.shape(v))), tree)


def tail_loss(losses):
    return float(np.mean(losses[-20:]))
