"""Orbax checkpoints of a training run, which a restarted run resumes from bit for bit.

A checkpoint is Orbax's folder ``step_00000040/`` with two items: ``state``, the sharded
arrays (parameters, optimizer state, each device's error-feedback residual: every process
writes the shards it holds, each distinct shard once), and ``host``, the host-side state (the
data RNG, the loss history) as JSON. Orbax writes into a temporary folder and renames it once
every process has finished, so a run killed mid-write leaves the previous checkpoint as the
newest. A restart restores every array onto the shardings of the freshly initialized state.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp


def manager(directory: str) -> ocp.CheckpointManager:
    """The run's checkpoints in ``directory`` (every process opens the same folder)."""
    options = ocp.CheckpointManagerOptions(
        step_prefix="step", step_format_fixed_length=8,
        # Synchronous: the next step donates the arrays a background save would still read.
        enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save(checkpoints: ocp.CheckpointManager, step: int, state, host_state: dict) -> None:
    """Writes ``state`` (a pytree of ``jax.Array``) and ``host_state`` (JSON-able) as the
    checkpoint of ``step``; every process calls it."""
    checkpoints.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   host=ocp.args.JsonSave(host_state)))
    checkpoints.wait_until_finished()


def restore(checkpoints: ocp.CheckpointManager, step: int, like):
    """The state and host state saved at ``step``: arrays with the structure, shapes, dtypes
    and shardings of ``like`` (the freshly initialized state)."""
    restored = checkpoints.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(like), host=ocp.args.JsonRestore()))
    return restored["state"], restored["host"]
