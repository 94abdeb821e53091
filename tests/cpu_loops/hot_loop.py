"""Extracts a function's hottest innermost loop from a perf profile of the loop driver, as
input for llvm-mca, to predict how the loops run on CPUs one cannot measure on
(docs/performance.md, Kernels):

    bash tests/cpu_loops/build.sh /tmp/loops_check
    perf record -o /tmp/perf.data /tmp/loops_check time
    python tests/cpu_loops/hot_loop.py /tmp/perf.data \\
        "cgx::isa_avx2::(anonymous namespace)::dequantize" > /tmp/loop.s
    llvm-mca-14 -mcpu=znver1 -iterations=100 /tmp/loop.s | grep "Total Cycles"

The loop is the backward branch of at most 150 instructions that holds the most samples;
its jumps are dropped (llvm-mca simulates one basic block).
"""

import re
import subprocess
import sys


def hottest_loop(perf_data: str, symbol: str) -> tuple[list[str], float]:
    listing = subprocess.run(["perf", "annotate", "-i", perf_data, "--stdio", "-s", symbol],
                             capture_output=True, text=True, check=True).stdout
    rows = []  # (address, percent of samples, instruction)
    for line in listing.splitlines():
        m = re.match(r"\s+([0-9.]+)?\s*:\s+([0-9a-f]+):\s+(.*)", line)
        if m:
            rows.append((int(m.group(2), 16), float(m.group(1) or 0),
                         m.group(3).split("#")[0].strip()))
    index = {address: i for i, (address, _, _) in enumerate(rows)}
    best = None
    for end, (address, _, text) in enumerate(rows):
        m = re.match(r"j\w+\s+([0-9a-f]+)\s*<", text)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < address and target in index:
            start = index[target]
            weight = sum(r[1] for r in rows[start:end + 1])
            if end - start <= 150 and (best is None or weight > best[0]):
                best = (weight, start, end)
    if best is None:
        raise SystemExit(f"no loop with samples in {symbol}")
    weight, start, end = best
    return [t for _, _, t in rows[start:end] if not re.match(r"j\w+\s", t)], weight


if __name__ == "__main__":
    body, weight = hottest_loop(sys.argv[1], sys.argv[2])
    print("\n".join(body))
    print(f"{len(body)} instructions, {weight:.0f}% of the function's samples", file=sys.stderr)
