"""``python -m cgx_jax.bench allreduce`` (bench/allreduce.py, bench/common.py; docs/design.md
section 9): argument parsing, the report arithmetic, an unshaped end-to-end run across real
processes (flat and hierarchical), and, where this machine allows network namespaces (root),
that a shaped run removes its network also when the workers time out or the benchmark gets
SIGTERM (the network itself is tested in test_netem.py)."""

import argparse
import json
import subprocess
import sys
import time

import pytest
from helpers import usage_error
from processes import launcher_env, needs_netns

from cgx_jax._src import netem
from cgx_jax.bench import allreduce
from cgx_jax.bench.common import parse_size, size_label


def run_cli(*args, timeout=240):
    env = launcher_env()
    return subprocess.run([sys.executable, "-m", "cgx_jax.bench", "allreduce", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_parse_size_and_rate():
    assert [parse_size(s) for s in ("4096", "64K", "1M", "16m")] == [
        4096, 65536, 1 << 20, 16 << 20]
    assert [size_label(s) for s in (4096, 65536, 1 << 20, 3000)] == [
        "4K", "64K", "1M", "3000"]
    assert netem.parse_rate("1gbit") == 1e9
    assert netem.parse_rate("100mbit") == 1e8
    assert netem.parse_rate("none") is None
    for bad, parse in (("16 MB", parse_size), ("-1", parse_size),
                       ("1gb", netem.parse_rate), ("fast", netem.parse_rate)):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            parse(bad)


def test_layouts_split_the_values_as_the_models_leaves():
    assert allreduce.leaf_sizes("flat", 1000) == [1000]
    assert allreduce.leaf_sizes("mlp", 10014720) == list(allreduce.MLP_KERNELS)
    vit = allreduce.vit_leaves()
    assert len(vit) == 80 and sum(vit) == 18_979_338  # bench train's ViT, 19.0M parameters
    assert allreduce.leaf_sizes("vit", sum(vit)) == vit
    scaled = allreduce.leaf_sizes("vit", 1 << 20)
    assert sum(scaled) == 1 << 20 and len(scaled) == 80 and min(scaled) >= 1
    with pytest.raises(ValueError, match="too small for the vit layout's 80 leaves"):
        allreduce.leaf_sizes("vit", 50)


@pytest.mark.parametrize("args, message", [
    (["--processes", "1"], "--processes must be at least 2, got 1"),
    (["--devices-per-process", "0"], "--devices-per-process must be at least 1, got 0"),
    (["--link", "1gbit", "3gb"], "link rate must look like"),
    (["--netns-prefix", "bad name"], "--netns-prefix"),
    (["--algorithms", "tree"], "invalid choice: 'tree'"),
    (["--layouts", "vit", "--sizes", "64"], "--sizes 64 is too small for the vit layout"),
])
def test_bad_arguments_exit_with_a_message(args, message, capsys):
    assert message in usage_error(allreduce.main, args, capsys)


def synthetic_rows():
    rows = []
    for link, f32, cgx in (("1gbit", 0.8, 0.16), ("none", 0.2, 0.1)):
        for method, seconds in (("psum f32", f32), ("psum bf16", f32 * 1.1),
                                ("cgx sra 4b", cgx), ("torch ddp fp16", f32 / 2)):
            rows.append(dict(link=link, elements=16 << 20, method=method, seconds=seconds,
                             rel_error=0.0 if method == "psum f32" else 0.2,
                             wire_promoted_to_f32=method == "psum bf16"))
    return rows


def test_ratios_table_markdown_and_plot(tmp_path):
    rows = allreduce.add_ratios(synthetic_rows(), num_participants=4)
    by = {(r["link"], r["method"]): r for r in rows}
    assert by[("1gbit", "cgx sra 4b")]["vs_f32"] == pytest.approx(5.0)
    assert by[("1gbit", "cgx sra 4b")]["vs_bf16"] == pytest.approx(5.5)
    assert by[("none", "cgx sra 4b")]["vs_f32"] == pytest.approx(2.0)  # per-link baselines
    # algbw: 2(N-1)/N * 4 bytes * size / time
    assert by[("1gbit", "psum f32")]["algbw_gb_per_s"] == pytest.approx(
        1.5 * 4 * (16 << 20) / 0.8 / 1e9)
    table = allreduce.format_table(rows)
    assert "cgx sra 4b" in table and "5.00" in table
    markdown = allreduce.format_markdown(rows, "title")
    assert "| 1gbit | 16M | flat | cgx sra 4b | 160.00 |" in markdown
    assert "promoted the bf16 all-reduce to f32" in markdown
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedup.png"
    allreduce.plot(rows, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.starts_processes
def test_unshaped_run_flat_and_hierarchical(tmp_path):
    out = tmp_path / "rows.json"
    done = run_cli("--processes", "2", "--devices-per-process", "2", "--link", "none",
                   "--sizes", "8192", "--layouts", "flat", "mlp", "--bits", "4", "8",
                   "--algorithms", "sra", "hierarchical", "sra-wire", "--repeats", "1",
                   "--warmup", "0", "--torch", "no", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and result["devices_per_process"] == 2
    rows = {r["method"]: r for r in result["rows"] if r["layout"] == "flat"}
    tree = {r["method"]: r for r in result["rows"] if r["layout"] == "mlp"}
    # The pytree layout: the same values as four leaves, the same methods but the wire-only
    # one, the same sums within the codec's error.
    assert sorted(tree) == sorted(m for m in rows if not m.startswith("wire"))
    assert all(r["page_faults"] >= 0 for r in result["rows"])
    for method, bound in (("cgx sra 8b", 0.03), ("cgx sra 4b", 0.4)):
        assert 0 < tree[method]["rel_error"] < bound
    assert sorted(rows) == sorted(["psum f32", "psum bf16", "cgx sra 4b", "cgx sra 8b",
                                   "cgx hier-sra 4b", "cgx hier-sra 8b", "wire sra 4b",
                                   "wire sra 8b"])
    assert rows["wire sra 4b"]["rel_error"] is None  # bytes only, no sum to compare
    assert {r["link"] for r in result["rows"]} == {"none"}
    assert rows["psum f32"]["rel_error"] == 0.0 and rows["psum f32"]["vs_f32"] == 1.0
    assert 0 < rows["psum bf16"]["rel_error"] < 1e-2
    # 4 N(0,1) summands, buckets of 1024: one 8-bit SRA is about 1% off, 4-bit about 24%.
    for method, bound in (("8b", 0.03), ("4b", 0.4)):
        for algorithm in ("sra", "hier-sra"):
            assert 0 < rows[f"cgx {algorithm} {method}"]["rel_error"] < bound
    assert all(r["seconds"] > 0 and r["vs_f32"] > 0 for r in rows.values())
    # The report can be rebuilt from the JSON alone.
    markdown = tmp_path / "table.md"
    again = run_cli("--from-json", str(out), "--markdown", str(markdown))
    assert again.returncode == 0, again.stderr
    assert "| none | 8K | flat | cgx hier-sra 4b |" in markdown.read_text()
    assert "| none | 8K | mlp | cgx sra 8b |" in markdown.read_text()
    assert "| none | 8K | flat | wire sra 8b |" in markdown.read_text()
    assert again.stdout.count("\n") > len(rows)  # the text table is printed too


@needs_netns
def test_shaped_run_removes_the_network_when_workers_time_out():
    prefix = "cgxtbt"  # each namespace test its own prefix and subnet (tests/processes.py)
    done = run_cli("--processes", "2", "--link", "100mbit", "--sizes", "4096", "--bits", "4",
                   "--repeats", "1", "--torch", "no", "--timeout", "1",
                   "--netns-prefix", prefix, "--subnet", "10.213.84")
    assert done.returncode == 124, done.stderr[-3000:]
    assert "timed out" in done.stderr
    assert not netem.namespaces(prefix)


@needs_netns
def test_shaped_run_removes_the_network_on_sigterm():
    prefix = "cgxtbs"
    env = launcher_env()
    process = subprocess.Popen(
        [sys.executable, "-m", "cgx_jax.bench", "allreduce", "--processes", "2", "--link",
         "100mbit", "--sizes", "16M", "--repeats", "50", "--torch", "no", "--netns-prefix",
         prefix, "--subnet", "10.213.85"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while f"{prefix}1" not in netem.namespaces(prefix) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"{prefix}1" in netem.namespaces(prefix)
        time.sleep(1.0)  # the workers are starting inside the namespaces
        process.terminate()
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert not netem.namespaces(prefix)
