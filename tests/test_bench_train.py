"""``python -m cgx_jax.bench train`` (bench/train.py; docs/design.md section 9): argument
checks, the report arithmetic, the models' parameter counts, and an unshaped end-to-end run
of every mode (data-parallel and FSDP) across two real processes on a small MLP."""

import json
import subprocess
import sys

import jax
import pytest
from helpers import usage_error
from processes import launcher_env

from cgx_jax.bench import train


def run_cli(*args, timeout=400):
    env = launcher_env()
    return subprocess.run([sys.executable, "-m", "cgx_jax.bench", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args, message", [
    (["--processes", "1"], "--processes must be at least 2, got 1"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--mlp-hidden", "0"], "--mlp-hidden must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--modes", "fast"], "invalid choice: 'fast'"),
    (["--link", "3gb"], "link rate must look like"),
])
def test_bad_arguments_exit_with_a_message(args, message, capsys):
    assert message in usage_error(train.main, args, capsys)


def test_models_have_the_documented_sizes():
    count = lambda params: sum(leaf.size for leaf in jax.tree.leaves(params))  # noqa: E731
    assert count(train.mlp_init(jax.random.key(0))) == 10_020_874  # 784-2048x3-10
    shapes = jax.eval_shape(train.vit_init, jax.random.key(0))
    assert 18e6 < count(shapes) < 20e6
    images = jax.ShapeDtypeStruct((2, 32, 32, 3), jax.numpy.float32)
    assert jax.eval_shape(train.vit_apply, shapes, images).shape == (2, 10)


def test_ratios_and_reports(tmp_path):
    rows = [dict(model="mlp", mode=mode, seconds=seconds, loss=1.0, parameters=10**7,
                 wire_bytes=wire, f32_bytes=4 * 10**7, link="1gbit", memory_bytes=3 << 20)
            for mode, seconds, wire in (("floor", 0.2, 0), ("exact", 0.8, 4 * 10**7),
                                        ("cgx", 0.4, 5 * 10**6), ("gspmd fsdp", 1.2, 4 * 10**7),
                                        ("gspmd fsdp cgx", 0.3, 5 * 10**6))]
    rows = {r["mode"]: r for r in train.add_ratios(rows)}
    assert rows["cgx"]["vs_exact"] == pytest.approx(2.0)
    assert rows["gspmd fsdp cgx"]["vs_exact"] == pytest.approx(4.0)  # against gspmd fsdp
    assert rows["cgx"]["wire_ratio"] == pytest.approx(8.0)
    assert rows["cgx"]["floor_seconds"] == 0.2 and rows["floor"]["wire_ratio"] is None
    table = train.format_table(list(rows.values()))
    assert "2.00" in table and "8.00" in table
    assert "| 1gbit | mlp (10.0M) | cgx | 0.400 | 0.200 | 8.00 | 2.00 | 1.0000 | 3.0 |" in (
        train.format_markdown(list(rows.values()), "title"))
    pytest.importorskip("matplotlib")
    path = tmp_path / "train.png"
    train.plot(list(rows.values()), str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# One mode per way a step is built: "cgx 4b" is built as "cgx 2b" is, "fsdp cgx" as "fsdp 4b".
MODES = ["floor", "exact", "cgx", "cgx 2b", "adaptive", "fsdp exact", "fsdp 4b", "gspmd fsdp",
         "gspmd fsdp cgx"]


@pytest.mark.starts_processes
def test_unshaped_run_of_each_kind_of_step(tmp_path):
    out = tmp_path / "train.json"
    done = run_cli("--processes", "2", "--link", "none", "--mlp-hidden", "256", "--batch", "8",
                   "--repeats", "2", "--warmup", "1", "--modes", *MODES, "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == MODES and set(MODES) <= set(train.MODES)
    assert all(r["seconds"] > 0 and r["steps"] == 3 and r["link"] == "none"
               and r["memory_bytes"] > 0 for r in rows.values())
    # Exact and compressed runs train the same model on the same batches: after 3 Adam
    # steps their losses are close (2 bits, the coarsest, less so); 2 bits moves fewer bytes.
    for mode, bound in (("cgx", 0.15), ("adaptive", 0.15), ("cgx 2b", 0.5)):
        assert abs(rows[mode]["loss"] - rows["exact"]["loss"]) < bound, (mode, rows[mode])
    assert rows["cgx 2b"]["wire_bytes"] < rows["cgx"]["wire_bytes"] < rows["exact"]["wire_bytes"]
    assert rows["exact"]["vs_exact"] == 1.0 and rows["floor"]["wire_bytes"] == 0
    # Sharded: exact FSDP trains exactly as the exact data-parallel step (the same sums);
    # compressed FSDP stays close and moves fewer bytes, each against FSDP's own baseline.
    assert rows["fsdp exact"]["loss"] == pytest.approx(rows["exact"]["loss"], rel=1e-5)
    assert abs(rows["fsdp 4b"]["loss"] - rows["exact"]["loss"]) < 0.15, rows["fsdp 4b"]
    assert rows["fsdp 4b"]["wire_bytes"] < rows["fsdp exact"]["wire_bytes"]
    assert rows["fsdp 4b"]["vs_exact"] == pytest.approx(
        rows["fsdp exact"]["seconds"] / rows["fsdp 4b"]["seconds"])
    # GSPMD FSDP trains as exact FSDP (the same sums, XLA's collectives); its one-line cgx
    # port stays close with fewer bytes, against GSPMD FSDP.
    assert rows["gspmd fsdp"]["loss"] == pytest.approx(rows["exact"]["loss"], rel=1e-4)
    assert abs(rows["gspmd fsdp cgx"]["loss"] - rows["exact"]["loss"]) < 0.15
    assert rows["gspmd fsdp cgx"]["wire_bytes"] < rows["gspmd fsdp"]["wire_bytes"]
    assert rows["gspmd fsdp cgx"]["vs_exact"] == pytest.approx(
        rows["gspmd fsdp"]["seconds"] / rows["gspmd fsdp cgx"]["seconds"])
