"""Worker for tests/test_multiprocess.py and tests/test_launch.py (through helpers.py's
launch_worker), run under ``python -m cgx_jax.launch``:

    python tests/multiprocess_worker.py OUT_DIR MODE

MODE ``flat``: every algorithm over a 1-D mesh of all devices of all processes; ``hier``:
also the hierarchical reduction over a (processes, local devices) mesh, and first
``compute_large`` (a hierarchical reduction of multi-MiB pieces, several calls), for which
each rank writes ``OUT_DIR/rank{i}.json`` with the SHA-256 of each of its result rows;
``fail``: rank 1 raises after joining, the others wait in a collective; ``die`` and ``cut``:
see ``lose_rank_1``. Each rank writes ``OUT_DIR/rank{i}.npz`` with, per result, the rows of
its own devices (NaN elsewhere) and which rows those are. The test process runs ``compute``
on a sub-mesh of simulated devices and compares bitwise. MODE ``disagree:SETTING``: see
``disagree``.
"""

import os
import sys

import numpy as np

LENGTH = 3 * 1024 + 77
CODEC_ARGS = dict(bits=4, bucket_size=128, rounding="stochastic")
ALGORITHMS = ("sra", "allgather", "ring")


def inputs(num_devices: int):
    """The same per-device inputs in every process: floats of mixed scales, a bf16 leaf,
    an integer leaf (reduced exactly) and a matrix large enough to be a segment of its own
    (cgx_jax/_src/fusion.py)."""
    rng = np.random.default_rng(1234 + num_devices)
    x = rng.normal(size=(num_devices, LENGTH)).astype(np.float32)
    x[:, 200:500] *= 30.0
    half = rng.normal(size=(num_devices, 700)).astype(np.float32)
    count = rng.integers(-1000, 1000, size=(num_devices, 5)).astype(np.int32)
    big = rng.normal(size=(num_devices, 512, 512)).astype(np.float32)
    return x, half, count, big


def flat_mesh(devices):
    from jax.sharding import Mesh
    return Mesh(np.array(devices), ("batch",))


def hier_mesh(devices, num_outer: int):
    from jax.sharding import Mesh
    return Mesh(np.array(devices).reshape(num_outer, -1), ("outer", "inner"))


def compute(mesh, hierarchical: bool):
    """All cases in one program; returns {name: global [devices, ...] jax.Array}."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    codec = cgx.Codec(**CODEC_ARGS)
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    num_devices = mesh.devices.size
    x, half, count, big = inputs(num_devices)
    half = half.astype(jnp.bfloat16)

    def reduce_all(x, half, count, big):
        x, half, count, big = x[0], half[0], count[0], big[0]
        key = jax.random.key(7)
        out = {}
        for algorithm in ALGORITHMS:
            if hierarchical:
                out[f"hier_{algorithm}"] = cgx.compressed_psum(
                    x, "outer", inner_axis_name="inner", codec=codec, key=key,
                    algorithm=algorithm)
            else:
                out[algorithm] = cgx.compressed_psum(x, axes[0], codec=codec, key=key,
                                                     algorithm=algorithm)
        if not hierarchical:
            tree = cgx.compressed_psum(
                {"half": half, "count": count}, axes[0], key=jax.random.key(8),
                codec=cgx.Codec(bits=3, bucket_size=64, rounding="nearest"))
            out["tree_half"], out["tree_count"] = tree["half"], tree["count"]
            # Two segments of their own (big, 2 * big) and a packed one (x), stochastic.
            segments = cgx.compressed_psum({"big": big, "big2": 2 * big, "x": x}, axes[0],
                                           codec=codec, key=key, algorithm="sra")
            for name, value in segments.items():
                out[f"segments_{name}"] = value
        return jax.tree.map(lambda v: v[None], out)

    fn = jax.jit(jax.shard_map(reduce_all, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec))
    sharding = NamedSharding(mesh, spec)
    args = [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
            for a in (x, half, count, big)]
    results = jax.block_until_ready(fn(*args))  # one program in flight at a time
    if hierarchical:
        results.update(gspmd_gradients(mesh))
    return results


def gspmd_gradients(mesh):
    """``cgx.value_and_grad`` inside ``jax.jit`` on the automatic mesh (data axis 'outer',
    weights placed over 'inner', no ``param_specs``): the gradients are reduced where XLA's
    partitioner knows their layout (a custom_partitioning op). Returns each device's copy of
    each whole gradient (its blocks gathered exactly), one row per device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    rng = np.random.default_rng(99)
    specs = {"w1": P(None, "inner"), "w2": P("inner", None)}
    values = {"w1": rng.normal(size=(64, 256)) / 8, "w2": rng.normal(size=(256, 32)) / 16}
    place = lambda a, spec: jax.make_array_from_callback(  # noqa: E731
        a.shape, NamedSharding(mesh, spec), lambda index: a[index])
    params = {k: place(v.astype(np.float32), specs[k]) for k, v in values.items()}
    x = place(rng.normal(size=(8 * mesh.shape["outer"], 64)).astype(np.float32), P("outer"))
    loss = lambda p, x: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)  # noqa: E731
    grad_fn = cgx.value_and_grad(loss, mesh=mesh, axis_name="outer", policy=cgx.LayerPolicy(
        default=cgx.Codec(**CODEC_ARGS), min_size=1))
    grads = jax.jit(lambda p, x: grad_fn(p, x, step=jnp.int32(3))[1])(params, x)
    blocks = jax.shard_map(lambda g: jax.tree.map(lambda v: v[None], g), mesh=mesh,
                           in_specs=(P(),), out_specs=P(("outer", "inner")),
                           check_vma=False)(grads)
    return jax.block_until_ready({f"gspmd_{k}": v for k, v in blocks.items()})


LARGE_LENGTH = 1 << 24  # 32 MiB inner pieces: where XLA:CPU's Gloo reduce-scatter fails
# Two calls with new keys: that XLA's reduce-scatter, which fails intermittently there
# (jax-ml/jax#40830), is not in the program is test_collectives_transport.py's HLO check.
LARGE_CALLS = 2


def compute_large(mesh):
    """Hierarchical 4-bit SRA over a (outer, inner) mesh of large inputs, LARGE_CALLS calls
    of one program with a new key each; returns {f"call{i}": {device row: SHA-256 hex}} for
    the rows this process holds."""
    import hashlib

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx

    spec = P(tuple(mesh.axis_names))
    codec = cgx.Codec(bits=4, bucket_size=512)

    def reduce(x, seed):
        return cgx.compressed_psum(x[0], "outer", inner_axis_name="inner", codec=codec,
                                   key=jax.random.key(seed))[None]

    fn = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=(spec, P()), out_specs=spec))
    x = np.random.default_rng(99).normal(size=(mesh.devices.size, LARGE_LENGTH))
    x = x.astype(np.float32)
    arg = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
    digests = {}
    for call in range(LARGE_CALLS):
        out = jax.block_until_ready(fn(arg, np.uint32(call)))
        digests[f"call{call}"] = {
            str(shard.index[0].start): hashlib.sha256(np.asarray(shard.data).tobytes()).hexdigest()
            for shard in out.addressable_shards}
    return digests


def local_rows(array):
    """(rows as f32 with NaN where this process has no shard, bool mask of its rows)."""
    rows = np.full(array.shape, np.nan, np.float32)
    mine = np.zeros(array.shape[0], bool)
    for shard in array.addressable_shards:
        rows[shard.index] = np.asarray(shard.data, np.float32)
        mine[shard.index[0]] = True
    return rows, mine


def disagreeing_call(rank: int, setting: str):
    """A compressed_psum whose ``setting`` differs on rank 1 (the issue's report: 4 bits on
    one rank, 2 on the other), as keyword arguments."""
    import cgx_jax as cgx
    odd = rank == 1
    codec = dict(bits=4, bucket_size=1024)
    if setting == "bits":
        codec["bits"] = 2 if odd else 4
    if setting == "bucket_size":
        codec["bucket_size"] = 512 if odd else 1024
    if setting == "policy":
        return dict(policy=cgx.LayerPolicy(min_size=10**9 if odd else 1024), algorithm="sra")
    algorithm = ("allgather" if odd else "sra") if setting == "algorithm" else "sra"
    return dict(codec=cgx.Codec(**codec), algorithm=algorithm)


def disagreeing_step(mesh, rank: int, setting: str):
    """A jitted step over ``mesh`` whose ``setting`` differs on rank 1: a compressed_psum
    (``disagreeing_call``), or for ``gather_bits``/``scatter_bits`` the sharded ops with
    8-bit codecs on rank 0 and 4-bit ones on rank 1 (nearest rounding, so no key is needed:
    only the bits differ). Its argument: ``[devices, 65536]`` rows, sharded."""
    import jax
    from jax.sharding import PartitionSpec as P

    import cgx_jax as cgx

    codec = cgx.Codec(bits=4 if rank == 1 else 8, bucket_size=1024, rounding="nearest")
    if setting == "gather_bits":
        def body(x, key):
            return cgx.compressed_all_gather(x.reshape(256, 256), "batch", tiled=True,
                                             codec=codec)[:1].reshape(1, -1)
    elif setting == "scatter_bits":
        def body(x, key):
            return cgx.compressed_psum_scatter(x.reshape(-1, 256), "batch", tiled=True,
                                               codec=codec).reshape(1, -1)
    else:
        kwargs = disagreeing_call(rank, setting)

        def body(x, key):
            return cgx.compressed_psum(x[0].reshape(256, 256), "batch", key=key,
                                       **kwargs).reshape(1, -1)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("batch"), P()),
                                 out_specs=P("batch")))


class SlowReader:
    """A key-value client whose reads each wait ``seconds`` first: the process that owns it
    reads the others' settings last."""

    def __init__(self, client, seconds: float):
        self.client, self.seconds = client, seconds

    def key_value_set(self, *args):
        return self.client.key_value_set(*args)

    def blocking_key_value_get(self, *args):
        import time
        time.sleep(self.seconds)
        return self.client.blocking_key_value_get(*args)


def disagree(out_dir: str, rank: int, devices, mode: str) -> None:
    """MODE ``disagree:SETTING[,SETTING...]``: for each SETTING in turn rank 1 runs the step
    (``disagreeing_step``) with another value of it; each rank writes what it got to
    ``OUT_DIR/rank{i}_{SETTING}.txt``. ``disagree_uncaught:SETTING``: the error is left to
    end the process, as in a user's script. ``disagree_exit:SETTING``: each rank writes what
    it got and ends at once (``os._exit``), rank 1 reading the others' settings slowly: rank
    0, which holds the key-value store, must not leave before rank 1 has read them."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cgx_jax as cgx
    from cgx_jax._src import consistency

    mesh = flat_mesh(devices)
    x = jax.make_array_from_callback(
        (len(devices), 65536), NamedSharding(mesh, P("batch")),
        lambda index: np.ones((len(devices), 65536), np.float32)[index])
    if mode.startswith("disagree_exit") and rank == 1:
        client = consistency.distributed_client()
        consistency.distributed_client = lambda: SlowReader(client, 1.0)
    for setting in mode.split(":")[1].split(","):
        step = disagreeing_step(mesh, rank, setting)
        if mode.startswith("disagree_uncaught"):
            jax.block_until_ready(step(x, jax.random.key(0)))
            print(f"process {rank}: returned a result", flush=True)
            return
        try:
            jax.block_until_ready(step(x, jax.random.key(0)))
            outcome = "returned a result"
        except cgx.ProcessesDisagreeError as error:
            outcome = f"ProcessesDisagreeError: {error}"
        with open(os.path.join(out_dir, f"rank{rank}_{setting}.txt"), "w") as f:
            f.write(outcome)
    if mode.startswith("disagree_exit"):
        os._exit(1)


def psum_steps(devices, steps: int):
    """Runs ``steps`` small exact all-reduces over all devices, yielding after each; a dead
    peer makes one of them block or fail."""
    import jax
    from jax.sharding import PartitionSpec as P

    mesh = flat_mesh(devices)
    fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "batch"), mesh=mesh,
                               in_specs=P("batch"), out_specs=P("batch")))
    arg = jax.make_array_from_callback(
        (len(devices), 4), jax.sharding.NamedSharding(mesh, P("batch")),
        lambda index: np.ones((len(devices), 4), np.float32)[index])
    for step in range(steps):
        jax.block_until_ready(fn(arg))
        yield step


def lose_rank_1(rank: int, devices, mode: str) -> None:
    """MODE ``die``: rank 1 kills itself with SIGKILL after 5 all-reduces; ``cut``: rank 1
    takes its network link down (under ``--link``). The others go on until they fail."""
    import signal
    import subprocess

    for step in psum_steps(devices, 100000):
        if step == 5 and rank == 1:
            print(f"process 1: losing it at step {step} ({mode})", flush=True)
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            subprocess.run(["ip", "link", "set", f"cgxv{rank}", "down"], check=True)
    sys.exit(0)


def main(out_dir: str, mode: str) -> None:
    from cgx_jax.launch import initialize

    rank, num_processes = initialize()
    import jax

    devices = jax.devices()
    print(f"process {rank}/{num_processes}: {len(jax.local_devices())} local devices, "
          f"{len(devices)} in all", flush=True)
    if mode == "fail":
        if rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        for _ in psum_steps(devices, 1000):  # blocks on the dead peer until it is stopped
            pass
        sys.exit(0)
    if mode in ("die", "cut"):
        lose_rank_1(rank, devices, mode)
        return
    if mode.startswith("disagree"):
        disagree(out_dir, rank, devices, mode)
        return
    if mode == "hier":  # the multi-MiB pieces first: the regression they guard
        import json
        digests = compute_large(hier_mesh(devices, num_processes))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(digests, f)
    from cgx_jax._src import fusion
    # Across CPU processes small exact leaves share one all-reduce operand (one latency).
    assert fusion.exact_fusion_pays(), "exact leaves are not fused across CPU processes"
    results = dict(compute(flat_mesh(devices), False))
    if mode == "hier":
        results.update(compute(hier_mesh(devices, num_processes), True))
    saved = {}
    for name, array in results.items():
        saved[name], saved[f"{name}_mask"] = local_rows(array)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **saved)
    print(f"process {rank}: wrote {len(results)} results", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
