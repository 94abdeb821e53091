"""The codecs side by side: compressed all-reduce of a ViT-Tiny-shaped gradient pytree over 8
devices, with the building block ``cgx.compressed_pmean`` (examples/quickstart.py shows the
way in, ``cgx.value_and_grad``).

Runs on any machine: without accelerators it simulates 8 CPU devices. For each codec it
all-reduces per-device gradients with ``cgx.compressed_pmean`` inside ``jax.shard_map`` and
prints the error against the exact ``lax.pmean``, the bytes each participant puts on the
wire, and the compression ratio against f32 and bf16.

    python examples/codecs.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import cgx_jax as cgx  # noqa: E402


def vit_tiny_shapes(depth=12, dim=192, mlp=768, patch=16, classes=1000):
    """Parameter shapes of ViT-Ti/16 (5.7M parameters), as a Flax linen tree would hold them."""
    block = {
        "norm1": {"scale": (dim,), "bias": (dim,)},
        "attn": {"qkv": {"kernel": (dim, 3 * dim), "bias": (3 * dim,)},
                 "proj": {"kernel": (dim, dim), "bias": (dim,)}},
        "norm2": {"scale": (dim,), "bias": (dim,)},
        "mlp": {"fc1": {"kernel": (dim, mlp), "bias": (mlp,)},
                "fc2": {"kernel": (mlp, dim), "bias": (dim,)}},
    }
    return {
        "patch_embed": {"kernel": (patch * patch * 3, dim), "bias": (dim,)},
        "pos_embed": (1, 197, dim),
        "cls_token": (1, 1, dim),
        **{f"block{i}": block for i in range(depth)},
        "norm": {"scale": (dim,), "bias": (dim,)},
        "head": {"kernel": (dim, classes), "bias": (classes,)},
    }


def synthetic_gradients(shapes, num_devices, key):
    """Per-device gradients: heavy-tailed (Student-t, 3 dof) with a different scale per layer,
    a shared component plus per-device noise, the way data-parallel gradients look."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    grads = []
    for shape, k in zip(leaves, keys):
        k_scale, k_shared, k_local = jax.random.split(k, 3)
        scale = 10.0 ** jax.random.uniform(k_scale, (), minval=-4, maxval=-1)
        shared = jax.random.t(k_shared, 3.0, shape)
        local = jax.random.t(k_local, 3.0, (num_devices, *shape))
        grads.append(scale * (shared + 2.0 * local))
    return jax.tree.unflatten(treedef, grads)


def main():
    num_devices = min(8, len(jax.devices()))
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
    shapes = vit_tiny_shapes()
    grads = synthetic_gradients(shapes, num_devices, jax.random.key(0))
    one_device = jax.tree.map(lambda g: g[0], grads)
    num_values = sum(g.size for g in jax.tree.leaves(one_device))

    def sharded(fn):
        return jax.jit(jax.shard_map(
            lambda g, k: jax.tree.map(lambda v: v[None], fn(jax.tree.map(lambda v: v[0], g), k)),
            mesh=mesh, in_specs=(P("batch"), P()), out_specs=P("batch")))

    exact = sharded(lambda g, k: jax.lax.pmean(g, "batch"))(grads, jax.random.key(1))
    exact_flat = np.concatenate([np.asarray(x[0]).ravel() for x in jax.tree.leaves(exact)])
    print(f"ViT-Ti/16-shaped gradients: {num_values:,} values in "
          f"{len(jax.tree.leaves(one_device))} leaves, all-reduced over {num_devices} devices "
          f"({jax.devices()[0].platform})\n")
    print(f"{'codec':<34} {'algorithm':<10} {'rel. L2 error':>13} {'wire MB':>8} "
          f"{'vs f32':>7} {'vs bf16':>8} {'ms':>7}")
    configs = [
        ("exact f32 psum", None, None, "sra"),
        ("8 bit, bucket 1024, stochastic", cgx.Codec(8, 1024), None, "sra"),
        ("4 bit, bucket 1024, stochastic", cgx.Codec(4, 1024), None, "sra"),
        ("4 bit, bucket 1024, nearest", cgx.Codec(4, 1024, "nearest"), None, "sra"),
        ("4 bit, bucket 1024, all-gather", cgx.Codec(4, 1024), None, "allgather"),
        ("4 bit, bucket 128, stochastic", cgx.Codec(4, 128), None, "sra"),
        ("2 bit, bucket 128, stochastic", cgx.Codec(2, 128), None, "sra"),
        ("default LayerPolicy (4 bit)", None, cgx.LayerPolicy(), "sra"),
    ]
    for name, codec, policy, algorithm in configs:
        if codec is None and policy is None:
            fn = sharded(lambda g, k: jax.lax.pmean(g, "batch"))
            wire = 4 * num_values
        else:
            fn = sharded(lambda g, k, c=codec, p=policy, a=algorithm: cgx.compressed_pmean(
                g, "batch", codec=c, policy=p, key=k, algorithm=a))
            # A codec compresses every floating leaf: the policy with no exceptions.
            as_policy = policy or cgx.LayerPolicy(default=codec, min_size=0, min_ndim=0)
            wire = cgx.tree_wire_bytes(as_policy, one_device)
        jax.block_until_ready(fn(grads, jax.random.key(2)))  # compile
        start = time.perf_counter()
        out = jax.block_until_ready(fn(grads, jax.random.key(3)))
        millis = (time.perf_counter() - start) * 1e3
        flat = np.concatenate([np.asarray(x[0]).ravel() for x in jax.tree.leaves(out)])
        error = np.linalg.norm(flat - exact_flat) / np.linalg.norm(exact_flat)
        print(f"{name:<34} {algorithm:<10} {error:>13.2e} {wire / 1e6:>8.2f} "
              f"{4 * num_values / wire:>6.1f}x {2 * num_values / wire:>7.1f}x {millis:>7.1f}")
    print("\nwire MB: bytes of one participant's packets, each leaf padded to whole buckets "
          "(SRA moves 2(N-1)/N of them, as a ring psum moves 2(N-1)/N of the f32 buffer). "
          "ms: one all-reduce on this machine, which simulates the devices and has no real "
          "network.")


if __name__ == "__main__":
    main()
