"""launch.py, ``python -m cgx_jax.launch`` (docs/design.md section 9, "Launcher" and
"Emulated network"): a failing process stops the launch at once; each process gets its rank's
environment, its output is prefixed with the rank, and a timeout kills what still runs. With
--link each process runs in its own network namespace behind a shaped link, with bitwise the
same result, sees its own address, and the namespaces are removed, also on SIGTERM; without
namespaces the launch runs unshaped and says so; bad --link arguments exit with a message.
The namespace tests need root and skip elsewhere."""

import io
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from processes import (
    assert_bitwise_equal,
    gather_results,
    launch_worker,
    needs_netns,
    single_process,
)

from cgx_jax import launch
from cgx_jax._src import netem, supervisor

pytestmark = pytest.mark.starts_processes  # run first (tests/conftest.py)


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


# A script as JAX's own multi-process examples write it: no cgx_jax, jax.distributed.initialize()
# with no arguments, a JAX setting from the environment set before jax is imported.
PLAIN_SCRIPT = """
import os, sys
assert "jax" not in sys.modules, "jax was imported before the script"
os.environ["JAX_ENABLE_X64"] = "1"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.distributed.initialize()
assert jax.config.jax_enable_x64
mesh = jax.make_mesh((jax.device_count(),), ("p",))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("p")), np.full(jax.local_device_count(), jax.process_index() + 1.0))
total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(x)
print(f"process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices: "
      f"total {float(total):g} {total.dtype} user-site={os.environ.get('USER_SITE_RAN')}")
"""


def test_an_unmodified_jax_distributed_script_runs_under_the_launcher(tmp_path):
    """JAX reads the process count and id only from a cluster it detects: the launcher's
    launch_site/sitecustomize.py adds its processes, ahead of a SLURM allocation the launch
    runs in, without importing jax early, and still runs a sitecustomize it shadows."""
    (tmp_path / "plain.py").write_text(PLAIN_SCRIPT)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), SLURM_JOB_ID="7",
               SLURM_NTASKS="5", SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NODELIST="node1",
               SLURM_STEP_NODELIST="node1")
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "3", "--devices-per-process", "2",
               "--timeout", "90", "--", sys.executable, str(tmp_path / "plain.py")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(3):
        assert (f"[rank {rank}] process {rank} of 3, 6 devices: total 12 float64 "
                f"user-site=yes") in done.stdout, done.stdout


def test_a_failure_shared_by_ranks_is_reported_once(tmp_path):
    """Every rank fails at once; ranks 0 and 1 with the same traceback, rank 2 with another.
    The report shows the first failed rank's lines once for every rank that ended the same
    way, then the last line of each other ending."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "rank, here = os.environ['CGX_JAX_PROCESS_ID'], pathlib.Path(sys.argv[1])\n"
        "(here / f'ready{rank}').touch()\n"
        "while len(list(here.glob('ready*'))) < 3: time.sleep(0.01)\n"
        "if rank == '2':\n"
        "    raise KeyError('rank 2 differs')\n"
        "raise ValueError('coordinator_address should be defined.')\n")
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "3", "--timeout", "60", "--",
               sys.executable, str(script), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert done.returncode == 1, done.stderr[-3000:]
    report = done.stderr.split("failed with exit code 1; stopping")[1]
    assert report.count("ValueError: coordinator_address should be defined.") == 1, report
    assert report.count("KeyError: 'rank 2 differs'") == 1, report
    if "the last lines of ranks 0-1:" in report:  # rank 0 or 1 was seen failing first
        assert "[ranks 0-1] ValueError: coordinator_address should be defined." in report
        assert "rank 2 ended differently: KeyError: 'rank 2 differs'" in report, report
    else:
        assert "[rank 2] KeyError: 'rank 2 differs'" in report, report
        assert ("ranks 0-1 ended differently: ValueError: coordinator_address should be "
                "defined.") in report, report


def _launch_bash(script, *options, timeout=60):
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--grace", "1", *options,
               "--", "bash", "-c", script]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_max_restarts_starts_every_rank_again_with_its_restart_count():
    """Rank 1 fails in the first two attempts: both ranks are started three times, each
    attempt told its number, on a fresh coordinator port; the third attempt succeeds."""
    done = _launch_bash(
        'echo "rank $CGX_JAX_PROCESS_ID restart $CGX_JAX_RESTART_COUNT at '
        '$JAX_COORDINATOR_ADDRESS"; if [ "$CGX_JAX_PROCESS_ID" = 1 ] && '
        '[ "$CGX_JAX_RESTART_COUNT" -lt 2 ]; then exit 3; fi; sleep 0.3', "--max-restarts", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = re.findall(r"\[rank (\d)\] rank \1 restart (\d) at 127\.0\.0\.1:(\d+)", done.stdout)
    assert sorted((r, a) for r, a, _ in seen) == [(r, a) for r in "01" for a in "012"], seen
    ports = {a: {p for _, b, p in seen if b == a} for a in "012"}
    assert all(len(p) == 1 for p in ports.values()) and len(set.union(*ports.values())) == 3
    assert "restarting all 2 processes (restart 1 of 3)" in done.stderr
    assert "restarting all 2 processes (restart 2 of 3)" in done.stderr
    assert "restart 3 of 3" not in done.stderr


def test_restarts_that_run_out_end_with_the_last_failure():
    done = _launch_bash('echo "restart $CGX_JAX_RESTART_COUNT"; '
                        '[ "$CGX_JAX_PROCESS_ID" = 1 ] && exit 3; sleep 5', "--max-restarts", "1")
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stdout.count("[rank 1] restart 0") == done.stdout.count("[rank 1] restart 1") == 1
    assert "restart 2" not in done.stdout
    assert done.stderr.count("rank 1 failed with exit code 3") == 2
    assert "no restarts left (--max-restarts 1)" in done.stderr


def test_a_timeout_is_not_restarted():
    done = _launch_bash('echo "restart $CGX_JAX_RESTART_COUNT"; sleep 30', "--max-restarts", "2",
                        "--timeout", "1")
    assert done.returncode == 124, done.stderr[-3000:]
    assert "restart 1" not in done.stdout and "restarting" not in done.stderr


def test_the_timeout_bounds_all_attempts_together():
    """Rank 1 fails after 0.5 s in every attempt, with 10 restarts allowed: --timeout 2 ends
    the run (exit 124) within the first few attempts. A deadline started again with each
    attempt would let all 11 run (each under 2 s) and end with rank 1's exit code."""
    done = _launch_bash('echo "restart $CGX_JAX_RESTART_COUNT"; '
                        'if [ "$CGX_JAX_PROCESS_ID" = 1 ]; then sleep 0.5; exit 3; fi; sleep 30',
                        "--max-restarts", "10", "--timeout", "2")
    assert done.returncode == 124, done.stderr[-3000:]
    assert "timed out after 2 s" in done.stderr
    assert "no restarts left" not in done.stderr and "restart 10" not in done.stdout


@pytest.mark.parametrize("lines, lost", [
    (["E coordination_service.cc:1763] ... UNAVAILABLE: The following tasks are unhealthy "
      "(stopped sending heartbeats):", "1, 3", "The tasks have crashed."], {1, 3}),  # jax 0.10
    (["E coordination_service.cc:1763] ... UNAVAILABLE: The following tasks are unhealthy "
      "(stopped sending heartbeats):", "/job:jax_worker/replica:0/task:2",
      "/job:jax_worker/replica:0/task:3", "The tasks have crashed."], {2, 3}),  # jax 0.9
    (["[Gloo] Rank 0 is connected to 1 peer ranks", "1", "/job:jax_worker/replica:0/task:1"],
     set()),
])
def test_the_ranks_the_coordination_service_lost_are_read_from_its_message(lines, lost):
    seen, sink = set(), io.StringIO()
    pipe = io.BytesIO("".join(f"{line}\n" for line in lines).encode())
    supervisor._Forwarder(pipe, sink, "[rank 0] ", threading.Lock(), [], seen).run()
    assert seen == lost
    assert sink.getvalue().splitlines() == [f"[rank 0] {line}" for line in lines]


@pytest.mark.parametrize("ranks, text", [([3], "rank 3"), ([0, 1, 2, 3], "ranks 0-3"),
                                         ([0, 1, 2, 5], "ranks 0-2, 5"), ([0, 2], "ranks 0, 2")])
def test_ranks_are_named_in_runs(ranks, text):
    assert supervisor._ranks(ranks) == text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_processes_die_with_a_launcher_killed_by_sigkill():
    # The ranks ignore SIGTERM, as JAX does (a preemption notice): only SIGKILL stops them.
    command = [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--",
               "bash", "-c", 'trap "" TERM; echo "pid=$$"; exec sleep 60']
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        # A thread reads the lines: select() on the pipe misses a line that an earlier
        # readline() already took into the file's buffer (both ranks' lines in one read).
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout],
                         daemon=True).start()
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
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

# Each --link test has namespaces and a subnet of its own (none the launcher's default), so
# they can run beside each other (xdist) and beside a launch running meanwhile.
def link_args(prefix, subnet):
    return ("--link", "1gbit", "--netns-prefix", prefix, "--subnet", subnet)


@needs_netns
def test_link_runs_each_process_in_its_namespace_bitwise(tmp_path):
    assert not netem.namespaces("cgxtl"), f"stale namespaces: {netem.namespaces('cgxtl')}"
    done, _ = launch_worker(2, 1, tmp_path, "flat", extra=link_args("cgxtl", "10.213.78"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "network namespaces cgxtl0.., 1gbit links; coordinator 10.213.78.1:" in done.stderr
    assert_bitwise_equal(gather_results(tmp_path, 2), single_process(2))
    assert not netem.namespaces("cgxtl")


@needs_netns
def test_a_rank_that_loses_its_link_is_named_within_the_heartbeat_timeout(tmp_path):
    """Rank 1 takes its link down: nothing exits until jax.distributed's coordination service
    (on rank 0) misses its heartbeats and stops everyone, rank 0 first. The launcher names
    rank 1, and the run ends about a heartbeat timeout after the cut."""
    prefix = "cgxtc"
    assert not netem.namespaces(prefix), f"stale namespaces: {netem.namespaces(prefix)}"
    done, seconds = launch_worker(2, 1, tmp_path, "cut", timeout=90, extra=(
        *link_args(prefix, "10.213.79"), "--heartbeat-timeout", "5"))
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
        [sys.executable, "-m", "cgx_jax.launch", "-n", "2", *link_args("cgxta", "10.213.80"),
         "--", "sh", "-c", "getent hosts $(hostname)"], capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 0, done.stderr
    for rank in range(2):  # Gloo binds to what the host name resolves to
        assert f"[rank {rank}] 10.213.80.{rank + 1} " in done.stdout
    assert not netem.namespaces("cgxta")


@needs_netns
def test_link_sigterm_stops_processes_and_removes_network():
    process = subprocess.Popen(
        [sys.executable, "-m", "cgx_jax.launch", "-n", "2", "--grace", "1",
         *link_args("cgxts", "10.213.81"), "--", "sleep", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(netem.namespaces("cgxts")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(netem.namespaces("cgxts")) == 3  # two ranks and the hub
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "interrupted; stopping all processes" in stderr
    assert not netem.namespaces("cgxts")


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


def test_initialize_takes_the_launchers_heartbeat_timeout():
    """initialize() passes jax.distributed the launcher's CGX_JAX_HEARTBEAT_TIMEOUT
    (rounded up to whole seconds: 3.2 is 4), its own default without it, and an argument
    over both (in a fresh interpreter, with jax.distributed.initialize recorded instead of
    run)."""
    script = (
        "import os, jax\n"
        "from cgx_jax import launch\n"
        "seen = []\n"
        "jax.distributed.initialize = lambda **kw: seen.append(kw['heartbeat_timeout_seconds'])\n"
        "os.environ.update({launch.ENV_PROCESS_ID: '0', launch.ENV_NUM_PROCESSES: '1',\n"
        "                   launch.ENV_COORDINATOR: '127.0.0.1:1'})\n"
        "launch.initialize(exit_on_exception=False)\n"
        "os.environ[launch.ENV_HEARTBEAT_TIMEOUT] = '3.2'\n"
        "launch.initialize(exit_on_exception=False)\n"
        "launch.initialize(exit_on_exception=False, heartbeat_timeout=30)\n"
        "print(seen)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_JAX_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [f"[{launch.DEFAULT_HEARTBEAT_TIMEOUT},", "4,", "30]"]


def test_each_rank_s_environment_keeps_the_users_platform_and_flags():
    """A rank's environment: its id and count, the coordinator, its device count replacing
    the user's own in XLA_FLAGS (other flags kept), and the user's JAX_PLATFORMS kept (CPU
    only where none is set)."""
    from cgx_jax._src.ranks import SITE, child_environment

    base = {"JAX_PLATFORMS": "cuda", "PYTHONPATH": "/mine",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"}
    env = child_environment(1, 3, 4, 1234, base=base, heartbeat_timeout=2.5, restart=2)
    assert env["JAX_PLATFORMS"] == "cuda"
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d",
                                        "--xla_force_host_platform_device_count=4"]
    assert env["PYTHONPATH"].split(os.pathsep) == [SITE, "/mine"]
    assert (env[launch.ENV_PROCESS_ID], env[launch.ENV_NUM_PROCESSES]) == ("1", "3")
    assert env[launch.ENV_COORDINATOR] == env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert env[launch.ENV_HEARTBEAT_TIMEOUT] == "2.5" and env[launch.ENV_RESTART_COUNT] == "2"
    assert base["JAX_PLATFORMS"] == "cuda" and "PYTHONUNBUFFERED" not in base  # a copy
    assert child_environment(0, 2, 1, 1234, base={})["JAX_PLATFORMS"] == "cpu"
