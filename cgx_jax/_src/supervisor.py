"""The launcher's side of ``python -m cgx_jax.launch``: ``launch()`` starts the ranks,
forwards their output with a rank prefix, stops them all on the first failure, names the
rank that failed first with its last lines, restarts, times out. The user's guide is
``cgx_jax/launch.py``."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from cgx_jax._src import netem
from cgx_jax._src.ranks import DEFAULT_HEARTBEAT_TIMEOUT, PACKAGE, child_environment

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
CHILD = os.path.join(PACKAGE, "launch_child.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
