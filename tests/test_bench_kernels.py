"""``python -m cgx_jax.bench kernels`` (bench/kernels.py; docs/design.md section 9): sizes with
suffixes, checked arguments, and a small run whose JSON rows cover every kernel and bit width
against the copy baseline."""

import json
import subprocess
import sys

import pytest


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cgx_jax.bench", "kernels", *args],
                          capture_output=True, text=True, timeout=240)


def test_small_run_writes_every_kernel(tmp_path):
    out = tmp_path / "kernels.json"
    done = run_cli("--platform", "cpu", "--sizes", "64K", "--bits", "2", "8", "--peers", "4",
                   "--rounding", "stochastic", "nearest", "--bucket-sizes", "128", "1024",
                   "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["elements"] for r in rows} == {65536}
    kinds = [(r["kernel"], r["bits"], r["rounding"], r["bucket"]) for r in rows]
    kernels = ("quantize", "dequantize", "reduce_requantize N=4")
    assert kinds == [("copy (baseline)", 32, "-", None)] + [
        (kernel, bits, rounding, bucket) for bits in (2, 8)
        for rounding in ("stochastic", "nearest") for bucket in (128, 1024)
        for kernel in kernels]
    assert all(r["seconds"] > 0 and r["gb_per_s"] > 0 for r in rows)
    assert "quantize" in done.stdout and "65536" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--sizes", "16Q"], "size must look like"),
    (["--sizes", "4096", "--peers", "8"], "at least one 1024-value bucket per peer (8192"),
    (["--bits", "9"], "--bits must be 1..8, got [9]"),
    (["--peers", "0"], "--peers must be at least 1, got 0"),
    (["--rounding", "up"], "invalid choice: 'up'"),
    (["--bucket-sizes", "0"], "--bucket-sizes: bucket_size must be"),
    (["--sizes", "8192", "--peers", "4", "--bucket-sizes", "4096"],
     "at least one 4096-value bucket per peer (16384"),
])
def test_bad_arguments_exit_with_a_message(args, message):
    done = run_cli(*args)
    assert done.returncode == 2
    assert message in done.stderr, done.stderr
