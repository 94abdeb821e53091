"""The rank's side of ``python -m cgx_jax.launch``: ``initialize()`` joins this process to
``jax.distributed`` with the launcher's settings (or through JAX's cluster detection
elsewhere). The user's guide is ``cgx_jax/launch.py``."""

from __future__ import annotations

import math
import os
import sys

from cgx_jax._src.ranks import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)


def _exit_on_uncaught_exception() -> None:
    """An uncaught exception prints its traceback and ends the process at once with exit
    code 1. Otherwise the interpreter's exit runs ``jax.distributed.shutdown``, whose barrier
    waits for the peers, which may themselves wait in a collective for this process: the
    failure would surface only after JAX's timeouts (30 s and more) instead of now."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        try:
            previous(kind, value, traceback)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
            os._exit(1)

    sys.excepthook = hook


def initialize(exit_on_exception: bool | None = None,
               heartbeat_timeout: float | None = None) -> tuple[int, int]:
    """Joins this process to the distributed JAX runtime; returns ``(process_id,
    num_processes)``.

    Under ``python -m cgx_jax.launch`` it reads the launcher's ``CGX_JAX_*`` variables;
    elsewhere it calls ``jax.distributed.initialize()`` with no arguments (JAX's cluster
    detection: SLURM, Open MPI, TPU, GKE). CPU collectives across processes use Gloo, so
    it must run before the first JAX computation.

    ``exit_on_exception`` (default: on under the launcher, off elsewhere): an uncaught
    exception ends the process immediately with exit code 1, so the launcher sees the
    failure and stops the other ranks, instead of this process waiting in JAX's shutdown
    barrier for peers that wait for it. (``sys.exit(code)`` is not an exception that
    reaches this hook: to fail fast with a code of your own, use ``os._exit(code)``.)

    ``heartbeat_timeout``: seconds without a heartbeat after which ``jax.distributed``
    declares a process dead and fails the others (default: the launcher's
    ``--heartbeat-timeout``, else ``DEFAULT_HEARTBEAT_TIMEOUT``, 10 s; JAX's own is 100 s).
    """
    import jax

    from cgx_jax._src.memory import keep_freed_memory_before_jax_starts, keep_freed_memory_on_cpu

    keep_freed_memory_before_jax_starts()  # the one moment that reaches XLA's threads
    # Without this, CPU computations that span processes fail ("no cross-process
    # collectives implementation"); the GPU and TPU backends ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    launched = ENV_PROCESS_ID in os.environ
    if exit_on_exception if exit_on_exception is not None else launched:
        _exit_on_uncaught_exception()
    if heartbeat_timeout is None:
        heartbeat_timeout = float(os.environ.get(ENV_HEARTBEAT_TIMEOUT,
                                                 DEFAULT_HEARTBEAT_TIMEOUT))
    if not heartbeat_timeout > 0:
        raise ValueError(f"heartbeat_timeout must be a positive number of seconds, got "
                         f"{heartbeat_timeout!r}")
    heartbeat = {"heartbeat_timeout_seconds": max(1, math.ceil(heartbeat_timeout))}
    if launched:
        jax.distributed.initialize(
            coordinator_address=os.environ[ENV_COORDINATOR],
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]), **heartbeat)
    else:
        jax.distributed.initialize(**heartbeat)
    # Where the backend turned out to be the CPU but was not known before (a plugin installed).
    keep_freed_memory_on_cpu()
    return jax.process_index(), jax.process_count()
