"""``python -m cgx_jax.bench adapt`` (bench/adapt.py): argument checks, the per-phase report
arithmetic, and a run across two real processes whose links slow between two phases: the
exact step slows with them, and the adaptive mode notices, refits to fewer bits, and every
process keeps the same policy (the processes-agree check would stop a run that does not)."""

import json
import subprocess
import sys

import pytest
from helpers import usage_error
from processes import launcher_env, needs_netns

import cgx_jax as cgx
from cgx_jax.bench import adapt

NETNS_PREFIX, NETNS_SUBNET = "cgxtad", "10.213.83"  # this file's own (tests/processes.py)


@pytest.mark.parametrize("args, message", [
    (["--processes", "1"], "--processes must be at least 2, got 1"),
    (["--rates", "1gbit", "none"], "--rates must be rates such as 1gbit or 200mbit"),
    (["--rates", "3gb"], "link rate must look like"),
    (["--window", "2"], "--window must be at least 3, got 2"),
    (["--phase-steps", "10"], "--phase-steps must be more than --window (10), got 10"),
    (["--probe-values", "0"], "--probe-values must be at least 1, got 0"),
    (["--modes", "exact", "cgx 4b"], None),  # no --profile needed without adaptive
    ([], "the adaptive mode needs --profile"),
    (["--profile", "p.json", "--time-budget", "0"], "--time-budget must be seconds > 0, got 0"),
    (["--profile", "p.json", "--tolerance", "1.5"], "--tolerance must be in (0, 1), got 1.5"),
])
def test_bad_arguments_exit_with_a_message(args, message, capsys, monkeypatch):
    monkeypatch.setattr(adapt, "run", lambda args: 0)  # arguments accepted: nothing runs
    if message is None:
        assert adapt.main(args) == 0
        return
    assert message in usage_error(adapt.main, args, capsys)


def test_phase_rows_take_the_settled_steps_of_each_phase():
    # Two phases of 6 steps, a window of 2: each phase's row reads its steps 2-5. The
    # adaptive compute: steps 2-5 of phase 1 less their predicted all-reduce (0.5 s).
    times = [9, 9, 1, 2, 3, 4] + [9, 9, 5, 6, 7, 8]
    tests = [dict(loss=0.5, accuracy=0.8), dict(loss=0.4, accuracy=0.85)]
    record = {"adaptive": dict(times=times, bits=[4.0] * 6 + [2.0] * 2 + [1.0] * 4,
                               tests=tests, time_budget=3.0, predicted=[0.5] * 12,
                               probes=[dict(step=6, seconds=0.25)] * 2),
              "exact": dict(times=[1.0] * 12, bits=[32.0] * 12, tests=tests[::-1])}
    rows = adapt.phase_rows(record, ["1gbit", "200mbit"], phase_steps=6, window=2)
    assert [(r["phase"], r["rate"], r["mode"]) for r in rows] == [
        (1, "1gbit", "adaptive"), (1, "1gbit", "exact"),
        (2, "200mbit", "adaptive"), (2, "200mbit", "exact")]
    first, second = rows[0], rows[2]
    assert first["seconds"] == 2.5 and second["seconds"] == 6.5  # medians of steps 2-5
    assert first["mean_bits"] == 4.0 and second["mean_bits"] == 1.0
    assert first["step_budget"] == 5.0 and second["vs_budget"] == pytest.approx(6.5 / 5.0)
    assert (first["test_loss"], second["test_accuracy"]) == (0.5, 0.85)
    assert "step_budget" not in rows[1] and rows[1]["test_loss"] == 0.4
    whole = adapt.whole_run(record)
    assert whole["adaptive"] == dict(seconds=sum(times) + 0.5, mean_bits=pytest.approx(32 / 12),
                                     test_loss=0.4, test_accuracy=0.85)
    assert "| 2 | 200mbit | adaptive | 6.500 | 5.000 | 1.30 | 1.00 | 0.4000 | 85.00 |" in (
        adapt.format_markdown(rows, "t"))


def test_mean_bits_weighs_the_compressed_leaves_by_size():
    import jax.numpy as jnp

    tree = {"a": jnp.zeros((64, 64)), "b": jnp.zeros((32, 64)), "bias": jnp.zeros(64)}
    policy = cgx.LayerPolicy(min_size=0, overrides={"^a$": cgx.Codec(bits=2)})
    assert adapt._mean_bits(policy, tree) == pytest.approx((2 * 4096 + 4 * 2048) / 6144)
    assert adapt._mean_bits(None, tree) == 32.0


def run_cli(*args, timeout=400):
    env = launcher_env()
    return subprocess.run([sys.executable, "-m", "cgx_jax.bench", "adapt", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@needs_netns
@pytest.mark.starts_processes
def test_the_adaptive_mode_follows_a_link_that_slows(tmp_path):
    """50 Mbit/s, then 5 Mbit/s: 2 processes, a 134k-parameter MLP, 6 steps a phase, a
    probe of the link every 3. The starting profile is a guess at 50 Mbit/s: what counts
    is that the probes see the rate fall, and only once it fell."""
    profile = tmp_path / "link.json"
    cgx.LinkProfile(processes=2, exact_latency=1e-3, seconds_per_byte=1.6e-7,
                    compressed_latency=2e-3, seconds_per_wire_byte=1.6e-7,
                    seconds_per_value=1e-9).save(str(profile))
    out = tmp_path / "adapt.json"
    done = run_cli("--processes", "2", "--rates", "50mbit", "5mbit", "--phase-steps", "6",
                   "--window", "3", "--probe-values", "16384", "--modes", "exact", "adaptive",
                   "--mlp-hidden", "128", "--batch", "8", "--profile", str(profile),
                   "--netns-prefix", NETNS_PREFIX, "--subnet", NETNS_SUBNET,
                   "--json", str(out), "--plot", str(tmp_path / "adapt.png"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "links set to 5mbit" in done.stdout
    result = json.loads(out.read_text())
    rows = {(r["phase"], r["mode"]): r for r in result["phases"]}
    assert set(rows) == {(p, m) for p in (1, 2) for m in ("exact", "adaptive")}
    record = result["record"]
    assert all(len(r["times"]) == len(r["losses"]) == 12 and len(r["tests"]) == 2
               for r in record.values())
    # Held out: the exact run learned something from the teacher in 12 steps.
    assert rows[2, "exact"]["test_loss"] < rows[1, "exact"]["test_loss"] < 2.31, rows
    assert all(0.1 < r["test_accuracy"] <= 1 for r in rows.values())
    # The rate change took effect: the exact step, 0.5 MB of f32, is far slower.
    assert rows[2, "exact"]["seconds"] > 5 * rows[1, "exact"]["seconds"], rows
    # The adaptive mode starts fitted to the budget (4 bits' time on the profile) and
    # refits at the first probe of the slow phase (step 9), not before, to fewer bits.
    refits, bits = record["adaptive"]["refits"], record["adaptive"]["bits"]
    assert [p["step"] for p in record["adaptive"]["probes"]] == [3, 6, 9, 12]
    assert len(refits) == 1 and refits[0]["step"] == 9, refits
    assert refits[0]["mean_bits"] < bits[0] and 3 <= bits[0] <= 5, (refits, bits[0])
    assert bits[refits[0]["step"]] == refits[0]["mean_bits"]  # the next step takes it
    assert rows[2, "adaptive"]["mean_bits"] < rows[1, "adaptive"]["mean_bits"]
    assert record["adaptive"]["compiled"] == 2
    assert (tmp_path / "adapt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
