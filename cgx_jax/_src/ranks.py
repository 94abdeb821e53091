"""What ``python -m cgx_jax.launch`` hands each of its ranks: the ``CGX_JAX_*`` variables
(read by ``worker.initialize`` and ``restart_count``), the simulated devices and the start-up
hook on ``PYTHONPATH`` (``child_environment``). The user's guide is ``cgx_jax/launch.py``."""

from __future__ import annotations

import os

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cgx_jax/

ENV_COORDINATOR = "CGX_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "CGX_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "CGX_JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "CGX_JAX_LOCAL_DEVICES"
ENV_HEARTBEAT_TIMEOUT = "CGX_JAX_HEARTBEAT_TIMEOUT"
ENV_RESTART_COUNT = "CGX_JAX_RESTART_COUNT"  # 0 in the first attempt, k in the k-th restart
# Seconds without a heartbeat after which jax.distributed declares a process dead (JAX's own
# default is 100 s). Heartbeats come from a background thread, so compiling or a long step
# does not miss them; a process that died or lost its link is noticed within this time.
DEFAULT_HEARTBEAT_TIMEOUT = 10
# First on every rank's PYTHONPATH: lets jax.distributed.initialize() find the processes.
SITE = os.path.join(PACKAGE, "launch_site")


def restart_count() -> int:
    """How many times ``python -m cgx_jax.launch --max-restarts K`` has restarted this run's
    processes: 0 in the first attempt (and outside the launcher), then 1, 2, ...

    Example:
        >>> from cgx_jax.launch import restart_count
        >>> restart_count()
        0
    """
    return int(os.environ.get(ENV_RESTART_COUNT, "0"))


def child_environment(rank: int, num_processes: int, devices_per_process: int, port: int,
                      base=None, host: str = "127.0.0.1",
                      heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                      restart: int = 0) -> dict:
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env.update({
        ENV_COORDINATOR: f"{host}:{port}",
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(rank),
        ENV_LOCAL_DEVICES: str(devices_per_process),
        ENV_HEARTBEAT_TIMEOUT: f"{heartbeat_timeout:g}",
        ENV_RESTART_COUNT: str(restart),
        "JAX_COORDINATOR_ADDRESS": f"{host}:{port}",
        "PYTHONPATH": os.pathsep.join([SITE] + [p for p in env.get("PYTHONPATH", "").split(
            os.pathsep) if p and p != SITE]),
        "XLA_FLAGS": " ".join(flags),
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env
