"""Runs one script as N local JAX processes wired with ``jax.distributed`` (CPU collectives
through Gloo), for tests, examples and benchmarks of multi-process data parallelism.

Usage::

    python -m cgx_jax.launch -n 4 [--devices-per-process 2] [--timeout 600] [--link 1gbit] \\
        [--heartbeat-timeout 10] [--max-restarts 2] -- python train.py --steps 100

Every process gets ``CGX_JAX_COORDINATOR`` (``127.0.0.1:PORT``, a free port),
``CGX_JAX_NUM_PROCESSES``, ``CGX_JAX_PROCESS_ID``, ``CGX_JAX_LOCAL_DEVICES`` and
``CGX_JAX_HEARTBEAT_TIMEOUT``, plus
``XLA_FLAGS=--xla_force_host_platform_device_count=K`` (K simulated CPU devices each),
``JAX_PLATFORMS=cpu`` unless set already, ``PYTHONUNBUFFERED=1``, ``JAX_COORDINATOR_ADDRESS``
and ``cgx_jax/launch_site`` first on ``PYTHONPATH``. The script joins the processes before it
uses JAX, in one of two ways; afterwards ``jax.devices()`` lists the devices of all
processes and a ``Mesh`` over them spans processes::

    from cgx_jax.launch import initialize
    process_id, num_processes = initialize()   # the library's settings too (below)

    jax.distributed.initialize()                # an unmodified script: works as well

The second works through ``launch_site/sitecustomize.py``, which adds the launcher's
processes to JAX's cluster detection (JAX reads the process count and id from nothing else).
``initialize()`` also applies the library's process settings: the heartbeat timeout, the
exit on an uncaught exception and the allocator settings; a plain
``jax.distributed.initialize()`` gets JAX's defaults (a 100 s heartbeat timeout).

Each line a process prints comes out prefixed with ``[rank i] `` (stdout to stdout, stderr to
stderr). When a process exits non-zero, the launcher stops the others (SIGTERM to their
process groups, SIGKILL after ``--grace`` seconds), says which rank failed with which exit
code, shows its last lines and exits non-zero itself (the failed rank's code, 128+signal
for a signal; a rank whose link went down is named as such, see docs/design.md section 9);
with
``--max-restarts K`` it then starts all processes again, up to K times, each attempt with
``CGX_JAX_RESTART_COUNT`` (``restart_count()``) one higher, and the script resumes from its
own checkpoints (``examples/vit/train.py --checkpoint-dir``). After ``--timeout`` seconds
(all attempts together) it stops everything and exits 124. It never waits on a hung peer.
SIGTERM, SIGHUP and Ctrl-C stop every process too (exit code 130). Each process is started
through ``cgx_jax.launch_child``, which has Linux SIGKILL it when the launcher exits, so a
launcher killed with SIGKILL takes its processes with it.

``--link RATE`` (``1gbit``, ``100mbit``, ...; root only) runs each process in its own network
namespace joined to the others by a link of that rate (``cgx_jax._src.netem``; the coordinator
listens on rank 0's address there) and removes the namespaces afterwards, also on failure
and interruption. Without root, or where namespaces cannot be made, it says so and runs
unshaped on loopback.

Real clusters: do not use this launcher. Start one process per host (or per accelerator)
with the cluster's own tool (``srun`` on SLURM, ``mpirun``/``mpiexec`` with Open MPI, one
pod per host on Kubernetes/GKE, Cloud TPU VMs) and call ``initialize()`` there too: without
the ``CGX_JAX_*`` variables it calls ``jax.distributed.initialize()`` with no arguments,
which finds the coordinator, process count and process id through JAX's cluster detection
(SLURM, Open MPI, TPU, GKE environments). On GPUs the collectives go through NCCL and the
Gloo setting does not matter; on CPU hosts Gloo binds to the address the host name resolves
to, so make that resolve to the interface the hosts share.

Keep few collective programs in flight on small CPU machines (wait on a result every step);
see docs/design.md section 9.
"""

from __future__ import annotations

import argparse
import signal
import sys

from cgx_jax._src import netem
from cgx_jax._src.ranks import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    restart_count,
)
from cgx_jax._src.supervisor import free_port, launch
from cgx_jax._src.worker import initialize

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "ENV_COORDINATOR", "ENV_HEARTBEAT_TIMEOUT",
           "ENV_LOCAL_DEVICES", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_RESTART_COUNT",
           "free_port", "initialize", "launch", "main", "restart_count"]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cgx_jax.launch",
        description="Run a command as N local JAX processes (jax.distributed on 127.0.0.1, "
                    "CPU collectives through Gloo). The launcher does not join them itself: "
                    "the command calls cgx_jax.launch.initialize() (which also applies "
                    "--heartbeat-timeout and the library's process settings) or "
                    "jax.distributed.initialize() with no arguments (which finds the "
                    "launcher's processes and gets JAX's defaults). A rank that fails stops "
                    "all; its last lines are shown once per distinct ending.")
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices per process (default 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before every process is stopped (default: none)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping (default 5)")
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port (default: a free one)")
    parser.add_argument("--link", default=None,
                        help="emulate links of this tc rate between the processes (1gbit, "
                             "100mbit, ...; root only, else unshaped with a warning)")
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT,
                        help="seconds without a heartbeat after which jax.distributed "
                             "declares a process dead and stops the others (default "
                             f"{DEFAULT_HEARTBEAT_TIMEOUT}; JAX's own is 100)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="after a rank fails, restart all processes up to this many times "
                             "(default 0); they read the attempt from CGX_JAX_RESTART_COUNT "
                             "and resume from their own checkpoints")
    parser.add_argument("--netns-prefix", default="cgxlaunch",
                        help="names of --link's network namespaces: PREFIX0.. and PREFIXhub")
    parser.add_argument("--subnet", default="10.213.1",
                        help="first three octets of the private /24 used by --link")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python -m cgx_jax.launch -n N -- python script.py")
    if args.num_processes < 1:
        parser.error(f"-n must be at least 1, got {args.num_processes}")
    if not args.heartbeat_timeout > 0:
        parser.error(f"--heartbeat-timeout must be positive, got {args.heartbeat_timeout}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {args.devices_per_process}")
    if args.link is not None:
        problem = netem.argument_problem([args.link], args.netns_prefix, args.subnet)
        if problem:
            parser.error(problem)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)  # stop the processes and remove the network
    return launch(command, args.num_processes, args.devices_per_process,
                  timeout=args.timeout, grace=args.grace, port=args.port, link=args.link,
                  heartbeat_timeout=args.heartbeat_timeout, max_restarts=args.max_restarts,
                  netns_prefix=args.netns_prefix, subnet=args.subnet)


if __name__ == "__main__":
    sys.exit(main())
