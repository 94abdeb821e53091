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
import collections
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from cgx_jax._src import netem

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
LAST_LINES = 15  # of a failed rank's output, shown by the launcher
# jax.distributed's coordination service names the processes it lost contact with on the
# line after this one; a C++ stack frame line says nothing to a user.
UNHEALTHY = re.compile(r"tasks are unhealthy \(stopped sending heartbeats\)")
STACK_FRAME = re.compile(r"^\s+@\s+0x")
# What a rank prints when it fails because a peer went away first.
PEER_LOST = re.compile(r"(closed|reset) by peer|Broken pipe|Connection refused|"
                       r"detected fatal errors|another task died")
SETTLE_SECONDS = 0.3  # after a first failure, for the exits it causes to be seen
# Started by path, not with -m, so it does not import the cgx_jax package (and jax).
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_child.py")
# First on every rank's PYTHONPATH: lets jax.distributed.initialize() find the processes.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_site")


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
    keep_freed_memory_on_cpu()  # as a compressed collective would (cgx_jax/_src/memory.py)
    return jax.process_index(), jax.process_count()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


class _Forwarder(threading.Thread):
    """Copies one pipe to ``sink`` line by line with a rank prefix."""

    def __init__(self, pipe, sink, prefix: str, lock: threading.Lock, last_lines, lost):
        super().__init__(daemon=True)
        self.pipe, self.sink, self.prefix, self.lock = pipe, sink, prefix, lock
        self.last_lines = last_lines  # the rank's latest lines (both streams), no stack frames
        self.lost = lost  # the ranks the coordination service lost contact with

    def run(self):
        unhealthy_next = False
        for raw in iter(self.pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self.lock:
                self.sink.write(f"{self.prefix}{line}\n")
                self.sink.flush()
                if not STACK_FRAME.match(line):
                    self.last_lines.append(line)
                tasks = _lost_tasks(line) if unhealthy_next else []
                self.lost.update(tasks)
                unhealthy_next = bool(tasks or UNHEALTHY.search(line))
        self.pipe.close()


def _lost_tasks(line: str) -> list[int]:
    """The task numbers (process ids) on a line after the coordination service's "tasks are
    unhealthy": ``1`` or ``1, 3`` (jax 0.10), ``/job:jax_worker/replica:0/task:1`` (jax 0.9);
    none for any other line."""
    if re.fullmatch(r"[\d,\s]+", line):
        return [int(task) for task in re.findall(r"\d+", line)]
    return [int(task) for task in re.findall(r"^\s*/job:[\w-]+/replica:\d+/task:(\d+)", line)]


def _signal_group(process: subprocess.Popen, sig) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(processes, grace: float) -> None:
    """SIGTERM to every running process group, SIGKILL to what is left after ``grace``."""
    running = [p for p in processes if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in running:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else min(returncode, 255)


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def launch(command, num_processes: int, devices_per_process: int = 1, *,
           timeout: float | None = None, grace: float = 5.0, port: int | None = None,
           stdout=None, stderr=None, link: str | None = None, netns_prefix: str = "cgxlaunch",
           subnet: str = "10.213.1",
           heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, max_restarts: int = 0) -> int:
    """Runs ``command`` (a list) as ``num_processes`` processes; returns the exit code the
    launcher exits with (0 when every process exited 0). ``link``: a tc rate such as
    ``"1gbit"`` to run them on an emulated network (``cgx_jax._src.netem``), ``None`` or
    ``"none"`` for loopback. ``heartbeat_timeout``: passed to every process's
    ``initialize()``. ``max_restarts``: after a rank fails, stop all and start all again,
    up to this many times (``restart_count()`` tells the processes which attempt they are;
    resuming is the script's part, from its checkpoints). ``timeout`` bounds all attempts.

    Example:
        >>> import sys
        >>> from cgx_jax.launch import launch
        >>> launch([sys.executable, "-c", "print('hello')"], 2)  # doctest: +SKIP
        0
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            stderr.write(f"cgx_jax.launch: {message}\n")
            stderr.flush()

    try:
        with netem.shaped_network(num_processes, link, subnet=subnet, prefix=netns_prefix,
                                  warn=say) as network:
            host = "127.0.0.1"
            if network is not None:
                host, command = network.address(0), network.wrap(command)
            deadline = None if timeout is None else time.monotonic() + timeout
            for restart in range(max_restarts + 1):
                # A new port each attempt: the last coordinator's may still be in TIME_WAIT.
                coordinator_port = free_port() if port is None else port
                if network is not None:
                    say(f"{num_processes} processes in network namespaces {netns_prefix}0.., "
                        f"{link} links; coordinator {host}:{coordinator_port}")
                environments = [
                    child_environment(rank, num_processes, devices_per_process,
                                      coordinator_port, host=host, restart=restart,
                                      heartbeat_timeout=heartbeat_timeout)
                    for rank in range(num_processes)]
                code, failed = _run(command, environments, timeout, deadline, grace, stdout,
                                    stderr, lock, say)
                if not failed:
                    return code
                if restart < max_restarts:
                    say(f"restarting all {num_processes} processes (restart {restart + 1} of "
                        f"{max_restarts})")
                elif max_restarts:
                    say(f"no restarts left (--max-restarts {max_restarts})")
            return code
    except KeyboardInterrupt:  # while the network was being built
        say("interrupted; stopping all processes")
        return 130


def _run(command, environments, timeout, deadline, grace, stdout, stderr, lock, say):
    """Starts one process per environment, forwards their output, waits; stops them all on
    the first failure, at the ``deadline`` (``time.monotonic()``; ``timeout`` is the seconds
    it stands for) or an interrupt, and shows the failed rank's last lines.
    Returns the launcher's exit code and whether a rank failed (which a restart may mend;
    a timeout or an interrupt it may not)."""
    processes, forwarders, failure, failed, lost = [], [], None, [], set()
    last_lines = [collections.deque(maxlen=LAST_LINES) for _ in environments]
    exits = []  # (rank, return code) in the order the processes exited

    def wait_for(rank, process):
        code = process.wait()  # a thread each, so the order of exits is exact
        with lock:
            exits.append((rank, code))
    try:
        for rank, env in enumerate(environments):
            process = subprocess.Popen(
                [sys.executable, CHILD, str(os.getpid()), *command], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True)
            processes.append(process)
            threading.Thread(target=wait_for, args=(rank, process), daemon=True).start()
            for pipe, sink in ((process.stdout, stdout), (process.stderr, stderr)):
                forwarder = _Forwarder(pipe, sink, f"[rank {rank}] ", lock, last_lines[rank],
                                       lost)
                forwarder.start()
                forwarders.append(forwarder)
        code = 0
        while True:
            if any(c != 0 for _, c in exits):
                time.sleep(SETTLE_SECONDS)  # the ranks a failure takes down exit within ms
                with lock:
                    failure = _first_failure(exits, last_lines)
                    failed = [(rank, c) for rank, c in exits if c != 0]
            codes = [p.poll() for p in processes]
            if failure is not None:
                others = sum(c is None for c in codes)
                say(f"rank {failure[0]} failed with {_describe(failure[1])}; stopping the "
                    f"{others} process(es) still running")
                code = _exit_code(failure[1]) or 1
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                running = [rank for rank, c in enumerate(codes) if c is None]
                say(f"timed out after {timeout:g} s; ranks still running: {running}; "
                    f"stopping them")
                code = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        say("interrupted; stopping all processes")
        code = 130
    finally:
        _stop(processes, grace)
        for forwarder in forwarders:
            forwarder.join(timeout=2.0)
    if failure is not None:
        _report(failure, failed, lost, last_lines, say)
    return code, failure is not None and code != 130


def _first_failure(exits, last_lines):
    """Of the ranks that failed (``exits`` in exit order), the first whose output does not say
    a peer went away first: a rank killed in a collective takes the others down within
    milliseconds, and on a busy machine they can be seen to exit before it."""
    failed = [(rank, c) for rank, c in exits if c != 0]
    for rank, returncode in failed:
        if not any(PEER_LOST.search(line) for line in last_lines[rank]):
            return rank, returncode
    return failed[0]


def _report(failure, failed, lost, last_lines, say) -> None:
    """Names the rank that failed first, for the right reason, with its last lines: the
    first to exit, unless jax.distributed's coordination service had lost contact with
    another one (a link that went down: that rank stopped sending heartbeats, and the
    service then stopped the healthy ones, which exit first). The lines are shown once for
    every failed rank (``failed``: rank, return code) that ended the same way; of the
    others, each distinct ending's last line."""
    rank, returncode = failure
    if lost:
        rank = rank if rank in lost else min(lost)
        then = (f"; rank {failure[0]} then failed with {_describe(returncode)}"
                if rank != failure[0] else "")
        say(f"rank {rank} failed first: it lost contact with the others (it stopped sending "
            f"heartbeats, said jax.distributed's coordination service){then}")
    endings = collections.defaultdict(list)  # a rank's last lines -> the ranks that end so
    for other in sorted({rank, *(r for r, _ in failed)}):
        endings[tuple(last_lines[other])].append(other)
    named = endings.pop(tuple(last_lines[rank]))
    say(f"the last lines of {_ranks(named)}:\n" +
        "\n".join(f"  [{_ranks(named)}] {line}" for line in last_lines[rank]))
    for lines, ranks in endings.items():
        say(f"{_ranks(ranks)} ended differently: {lines[-1] if lines else '(no output)'}")


def _ranks(ranks) -> str:
    """``rank 3``, ``ranks 0-3`` or ``ranks 0-2, 5`` (``ranks`` sorted)."""
    runs = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


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
