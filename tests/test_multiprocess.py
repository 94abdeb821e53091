"""compressed_psum across real processes (``python -m cgx_jax.launch``, jax.distributed on
127.0.0.1, CPU collectives through Gloo; docs/design.md section 5) equals the single-process
result on simulated devices bitwise, for every algorithm and the hierarchical reduction, also
with multi-MiB hierarchical pieces. The launcher itself is tested in test_launch.py."""

import json
import os
import re

import jax
import multiprocess_worker as worker
import numpy as np
import pytest
from processes import assert_bitwise_equal, gather_results, launch_worker, single_process

pytestmark = pytest.mark.starts_processes  # run first (tests/conftest.py)


@pytest.mark.parametrize("num_processes, devices_per_process", [(4, 1), (2, 2)],
                         ids=["4x1", "2x2"])
def test_processes_match_single_process_bitwise(tmp_path, num_processes, devices_per_process):
    """Two processes of one device each are tested through network namespaces in
    test_launch.py (test_link_runs_each_process_in_its_namespace_bitwise). With two devices
    per process the launch also runs the hierarchical reduction on multi-MiB pieces.
    Regression: XLA:CPU's multi-process reduce-scatter returns wrong values for such pieces
    in some calls (jax-ml/jax#40830); the hierarchical reduction must not use it there."""
    hierarchical = devices_per_process > 1
    done, _ = launch_worker(num_processes, devices_per_process, tmp_path,
                            "hier" if hierarchical else "flat", timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(num_processes):
        assert f"[rank {rank}] process {rank}: wrote" in done.stdout
    got = gather_results(tmp_path, num_processes)
    want = single_process(num_processes * devices_per_process,
                          num_processes if hierarchical else None)
    expected = {"sra", "allgather", "ring", "tree_half", "tree_count", "segments_big",
                "segments_big2", "segments_x"}
    if hierarchical:
        expected |= {"hier_sra", "hier_allgather", "hier_ring", "gspmd_w1", "gspmd_w2"}
    assert set(want) == expected
    assert_bitwise_equal(got, want)
    # Compression did something, and the algorithms differ from each other.
    x = worker.inputs(num_processes * devices_per_process)[0]
    assert np.max(np.abs(got["sra"][0] - x.sum(0))) > 0
    assert not np.array_equal(got["sra"], got["ring"])
    # 2 * big is big scaled exactly: the same noise would give exactly twice the sum; the
    # segments draw their own.
    assert not np.array_equal(got["segments_big2"], 2 * got["segments_big"])
    if hierarchical:  # every row of every large call equals the single-process result
        large = {}
        for rank in range(num_processes):
            with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
                for call, rows in json.load(f).items():
                    large.setdefault(call, {}).update(rows)
        want = worker.compute_large(worker.hier_mesh(jax.devices("cpu")[:4], 2))
        assert len(want) == worker.LARGE_CALLS and all(len(r) == 4 for r in want.values())
        assert large == want


# ---------------------------------------------------------------------------
# Processes that disagree on the wire (cgx_jax/_src/consistency.py)
# ---------------------------------------------------------------------------

EXPECTED_DIFFERENCE = {  # setting changed on rank 1 -> a line the error must hold
    "bits": r"segments \(codec, leaves, values\): .*bits=4.* on process 0; .*bits=2.* on process 1",
    "bucket_size": r"segments .*bucket_size=1024.* on process 0; .*bucket_size=512.* on process 1",
    "policy": r"exact leaves: \[\] on process 0; \[0\] on process 1",
    "algorithm": r"algorithm: \"sra\" on process 0; \"allgather\" on process 1",
    # The sharded ops, 8-bit codecs on rank 0 and 4-bit ones on rank 1.
    "gather_bits": r"segments \(codec, leaves, values\): .*bits=8.* on process 0; .*bits=4.* "
                   r"on process 1",
    "scatter_bits": r"segments \(codec, leaves, values\): .*bits=8.* on process 0; .*bits=4.* "
                    r"on process 1",
}
OPERATION = {"gather_bits": "compressed_all_gather", "scatter_bits": "compressed_psum_scatter"}


def test_processes_that_disagree_get_a_clear_error_and_nothing_else(tmp_path):
    """One launch, each setting in turn (the all-reduce's and both sharded ops')."""
    done, _ = launch_worker(2, 1, tmp_path, "disagree:" + ",".join(EXPECTED_DIFFERENCE),
                            timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for setting, expected in EXPECTED_DIFFERENCE.items():
        for rank in range(2):
            outcome = (tmp_path / f"rank{rank}_{setting}.txt").read_text()
            assert outcome.startswith(
                "ProcessesDisagreeError: cgx_jax: the processes disagree on what this "
                f"{OPERATION.get(setting, 'compressed all-reduce')} sends"), outcome
            assert re.search(expected, outcome), (setting, outcome)
    assert "terminate called" not in done.stderr and "Gloo" not in done.stderr


def test_every_process_names_the_difference_when_one_ends_at_once(tmp_path):
    """Rank 1 reads the others' settings slowly and rank 0, which holds jax.distributed's
    key-value store, ends the moment it has raised: rank 0 waits until rank 1 has read every
    setting, so rank 1 names the differing setting too (not 'process 0 did not reach'), on
    stderr even when it is killed before its own caller sees the error."""
    done, _ = launch_worker(2, 1, tmp_path, "disagree_exit:gather_bits", timeout=90)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    # Each process says it before the handshake, so what it says survives JAX's coordination
    # agent killing it once process 0 has gone (its caller may then never see the error).
    for rank in range(2):
        said = "\n".join(line for line in output.splitlines()
                         if line.startswith(f"[rank {rank}]"))
        assert (f"process {rank}: cgx_jax: the processes disagree on what this "
                f"compressed_all_gather sends") in said, output[-3000:]
        assert re.search(EXPECTED_DIFFERENCE["gather_bits"], said), said
    outcome = (tmp_path / "rank0_gather_bits.txt").read_text()  # process 0 is never cut off
    assert outcome.startswith("ProcessesDisagreeError: cgx_jax: the processes disagree"), outcome


def test_a_disagreeing_script_ends_with_the_error_not_an_abort(tmp_path):
    done, seconds = launch_worker(2, 1, tmp_path, "disagree_uncaught:bits", timeout=90)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "returned a result" not in done.stdout
    assert "ProcessesDisagreeError: cgx_jax: the processes disagree" in done.stderr
    assert "terminate called" not in done.stderr and "Gloo" not in done.stderr
