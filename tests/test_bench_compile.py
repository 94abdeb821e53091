"""``python -m cgx_jax.bench compile`` times both steps of a model and reports their ratio and
program counts (it sets its simulated devices itself, so it runs as its own process)."""

import os
import subprocess
import sys

import pytest


def test_bench_compile_reports_both_steps(tmp_path):
    # It compiles, whatever persistent compilation cache the environment names.
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    done = subprocess.run([sys.executable, "-m", "cgx_jax.bench", "compile", "--models", "mlp",
                           "--devices", "2", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())
    rows = {line.split()[2]: line.split() for line in done.stdout.splitlines()
            if line.startswith("mlp ")}
    assert set(rows) == {"exact", "cgx"}, done.stdout
    assert rows["exact"][1] == rows["cgx"][1] == "8"  # leaves
    assert float(rows["exact"][6]) == 1.0  # x exact of the baseline itself
    assert int(rows["exact"][7]) == 0 and int(rows["cgx"][7]) > 0  # custom calls: cgx's kernels
    total = {mode: float(row[5]) for mode, row in rows.items()}
    # The ratio of the unrounded totals; the printed totals have two decimals.
    assert float(rows["cgx"][6]) == pytest.approx(total["cgx"] / total["exact"], rel=0.03)
