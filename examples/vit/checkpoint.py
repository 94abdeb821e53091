"""Checkpoints of a training run that a restarted run resumes from bit for bit.

A checkpoint is a folder ``step_00000040/`` holding one ``process{i}.npz`` per process: every
shard of every array of the state that the process holds (each distinct shard once, so a
replicated parameter is stored once per process, and each device's error-feedback residual
is stored by the process that has it), and the host-side state (the data RNG, the loss
history) as JSON. Each process reads back only its own file, so a restart needs the same
processes and devices per process, and nothing else (no shared file system between hosts,
no orbax). Writing goes to ``step_N.tmp/``, which process 0 renames once every process has
written: a run killed mid-write leaves the previous checkpoint as the newest.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
from jax.experimental import multihost_utils

_NAME = re.compile(r"step_(\d{8})$")


def _shard_key(leaf: int, index) -> str:
    bounds = "_".join(f"{s.start or 0}-{s.stop if s.stop is not None else 'end'}"
                      for s in index)
    return f"leaf{leaf}:{bounds}"


def save(directory: str, step: int, state, host_state: dict) -> str:
    """Writes ``state`` (a pytree of ``jax.Array``) and ``host_state`` (JSON-able) as the
    checkpoint of ``step``; every process calls it. Returns the checkpoint's folder."""
    final = os.path.join(directory, f"step_{step:08d}")
    partial = final + ".tmp"
    process = jax.process_index()
    if process == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    multihost_utils.sync_global_devices(f"checkpoint {step}: folder made")
    shards = {}
    for leaf, array in enumerate(jax.tree.leaves(state)):
        for shard in array.addressable_shards:
            shards.setdefault(_shard_key(leaf, shard.index), np.asarray(shard.data))
    shards["host_state"] = np.frombuffer(json.dumps(host_state).encode(), np.uint8)
    with open(os.path.join(partial, f"process{process}.npz"), "wb") as f:
        np.savez(f, **shards)
    multihost_utils.sync_global_devices(f"checkpoint {step}: written")
    if process == 0:
        os.replace(partial, final)
    multihost_utils.sync_global_devices(f"checkpoint {step}: done")
    return final


def newest(directory: str | None) -> int | None:
    """The step of the newest complete checkpoint in ``directory``, ``None`` if none."""
    if not directory or not os.path.isdir(directory):
        return None
    steps = [int(m.group(1)) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return max(steps, default=None)


def restore(directory: str, step: int, like):
    """The state and host state saved at ``step``: arrays with the shapes, dtypes and
    shardings of ``like`` (the freshly initialized state), from this process's file."""
    path = os.path.join(directory, f"step_{step:08d}", f"process{jax.process_index()}.npz")
    with np.load(path) as saved:
        leaves, treedef = jax.tree.flatten(like)
        restored = []
        for leaf, array in enumerate(leaves):
            pieces = [jax.device_put(saved[_shard_key(leaf, index)], device)
                      for device, index in array.sharding.addressable_devices_indices_map(
                          array.shape).items()]
            restored.append(jax.make_array_from_single_device_arrays(
                array.shape, array.sharding, pieces))
        host_state = json.loads(saved["host_state"].tobytes())
    return jax.tree.unflatten(treedef, restored), host_state
