"""launch.py, ``python -m cgx_jax.launch`` (docs/design.md section 9, "Launcher" and
"Emulated network"): a failing process stops the launch at once; each process gets its rank's
environment, its output is prefixed with the rank, and a timeout kills what still runs. With
--link each process runs in its own network namespace behind a shaped link, with bitwise the
same result, sees its own address, and the namespaces are removed, also on SIGTERM; without
namespaces the launch runs unshaped and says so; bad --link arguments exit with a message.
The namespace tests need root and skip elsewhere."""

import io
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from cgx_jax import launch, netem
from processes import (assert_bitwise_equal, gather_results, launch_worker, needs_netns,
                     single_process)


def test_failing_process_stops_the_launch(tmp_path):
    done, seconds = launch_worker(2, 1, tmp_path, "fail", timeout=60)
    assert done.returncode != 0
    assert "rank 1 failed with exit code 1" in done.stderr, done.stderr[-3000:]
    assert "[rank 1] RuntimeError: rank 1 fails on purpose" in done.stderr
    # Stopped at once: without the launcher's exit-on-exception hook rank 1 waits in JAX's
    # shutdown barrier and the launch ends only after a 30 s coordination timeout.
    assert seconds < 25, seconds


def test_launcher_environment_prefix_and_timeout():
    script = ('echo "id=$CGX_JAX_PROCESS_ID n=$CGX_JAX_NUM_PROCESSES at=$CGX_JAX_COORDINATOR '
              'hb=$CGX_JAX_HEARTBEAT_TIMEOUT flags=$XLA_FLAGS"; echo oops >&2; '
              'if [ "$CGX_JAX_PROCESS_ID" = 1 ]; then trap "" TERM; sleep 30; fi')
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "3", "--devices-per-process", "2",
               "--timeout", "2", "--grace", "0.5", "--heartbeat-timeout", "7", "--",
               "bash", "-c", script]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert done.returncode == 124
    assert time.monotonic() - start < 15  # SIGKILL after the grace period, not sleep 30
    for rank in range(3):
        assert (f"[rank {rank}] id={rank} n=3 at=127.0.0.1:" in done.stdout
                and " hb=7 " in done.stdout
                and "--xla_force_host_platform_device_count=2" in done.stdout)
        assert f"[rank {rank}] oops" in done.stderr
    assert "timed out after 2 s; ranks still running: [1]" in done.stderr


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_killed_rank_is_named_with_its_last_lines(tmp_path):
    """Rank 1 dies by SIGKILL; rank 0, waiting in a collective, fails right after. The
    launcher names rank 1 (it exited first), not the lowest failed rank."""
    done, seconds = launch_worker(2, 1, tmp_path, "die", timeout=60)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    assert "rank 1 failed with signal SIGKILL" in done.stderr, done.stderr[-3000:]
    report = done.stderr.split("the last lines of rank 1:")[1]
    assert "[rank 1] process 1: losing it at step 5 (die)" in report
    assert seconds < 30, seconds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_processes_die_with_a_launcher_killed_by_sigkill():
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--",
               "bash", "-c", 'echo "pid=$$"; exec sleep 60']
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([launcher.stdout], [], [], 1.0)
            if ready:
                line = launcher.stdout.readline()
                if "pid=" in line:
                    pids.append(int(line.split("pid=")[1]))
        assert len(pids) == 2, pids
        launcher.kill()  # SIGKILL: the launcher cannot stop anything itself
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), [p for p in pids if alive(p)]
    finally:
        launcher.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------
# --link
# ---------------------------------------------------------------------------

LINK_PREFIX = "cgxtl"  # not the launcher's default, so a launch running meanwhile is safe
LINK_ARGS = ("--link", "1gbit", "--netns-prefix", LINK_PREFIX, "--subnet", "10.213.78")


def link_namespaces():
    return netem.namespaces(LINK_PREFIX)


@needs_netns
def test_link_runs_each_process_in_its_namespace_bitwise(tmp_path):
    assert not link_namespaces(), f"stale namespaces: {link_namespaces()}"
    done, _ = launch_worker(2, 1, tmp_path, "flat", extra=LINK_ARGS)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"network namespaces {LINK_PREFIX}0.., 1gbit links; coordinator 10.213.78.1:" in (
        done.stderr)
    assert_bitwise_equal(gather_results(tmp_path, 2), single_process(2))
    assert not link_namespaces()


@needs_netns
def test_a_rank_that_loses_its_link_is_named_within_the_heartbeat_timeout(tmp_path):
    """Rank 1 takes its link down: nothing exits until jax.distributed's coordination service
    (on rank 0) misses its heartbeats and stops everyone, rank 0 first. The launcher names
    rank 1, and the run ends about a heartbeat timeout after the cut."""
    # Namespaces of its own, so it can run beside the other --link tests (xdist).
    prefix = "cgxtc"
    assert not netem.namespaces(prefix), f"stale namespaces: {netem.namespaces(prefix)}"
    done, seconds = launch_worker(2, 1, tmp_path, "cut", timeout=90, extra=(
        "--link", "1gbit", "--netns-prefix", prefix, "--subnet", "10.213.79",
        "--heartbeat-timeout", "5"))
    assert done.returncode != 0
    # Named as lost; or, where rank 1's own agent gave up and it exited before rank 0 said
    # so, named as the first to exit.
    assert re.search(r"rank 1 failed (first: it lost contact with the others|with)",
                     done.stderr), done.stderr[-3000:]
    assert "rank 0 failed first" not in done.stderr
    assert "[rank 1] process 1: losing it at step 5 (cut)" in (
        done.stderr.split("the last lines of rank 1:")[1])
    assert seconds < 45, seconds  # JAX's default heartbeat timeout alone is 100 s
    assert not netem.namespaces(prefix)


@needs_netns
def test_link_process_sees_its_own_address():
    done = subprocess.run(
        [sys.executable, "-m", "cgx_jax.launch", "-n", "2", *LINK_ARGS, "--",
         "sh", "-c", "getent hosts $(hostname)"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for rank in range(2):  # Gloo binds to what the host name resolves to
        assert f"[rank {rank}] 10.213.78.{rank + 1} " in done.stdout
    assert not link_namespaces()


@needs_netns
def test_link_sigterm_stops_processes_and_removes_network():
    process = subprocess.Popen(
        [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--grace", "1", *LINK_ARGS, "--",
         "sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(link_namespaces()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(link_namespaces()) == 3  # two ranks and the hub
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "interrupted; stopping all processes" in stderr
    assert not link_namespaces()


def test_link_without_namespaces_runs_unshaped_and_says_so(monkeypatch):
    monkeypatch.setattr(netem, "can_shape", lambda: (False, "not root"))
    out, err = io.StringIO(), io.StringIO()
    code = launch.launch([sys.executable, "-c", "print('hi')"], 2, link="1gbit",
                         stdout=out, stderr=err)
    assert code == 0
    assert "cannot emulate a 1gbit link (not root); running UNSHAPED on loopback" in (
        err.getvalue())
    assert "[rank 0] hi" in out.getvalue() and "[rank 1] hi" in out.getvalue()


@pytest.mark.parametrize("args, message", [
    (["--link", "fast"], "link rate must look like 1gbit"),
    (["--link", "1gbit", "--netns-prefix", "a b"], "--netns-prefix must be a letter"),
    (["--link", "1gbit", "--subnet", "10.1"], "--subnet must be three octets"),
])
def test_link_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        launch.main(["-n", "2", *args, "--", "true"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
