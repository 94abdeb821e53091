"""What the benchmarks share: element counts written with suffixes, timing a call, and running
one link rate after another with a clean stop (docs/design.md section 9)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``1M`` -> 1048576 elements, ``16M``, ``64M``, ``4096``.

    Example:
        >>> parse_size("64K")
        65536
    """
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"size must look like 4096, 64K, 1M or 16M: {text!r}")
    return int(m.group(1)) * _SUFFIXES[m.group(2).upper()]


def size_label(size: int) -> str:
    """The shortest suffixed name of ``size`` (``1 << 20`` -> ``1M``)."""
    for suffix in ("G", "M", "K"):
        if size % _SUFFIXES[suffix] == 0:
            return f"{size // _SUFFIXES[suffix]}{suffix}"
    return str(size)


def cpu_description() -> str:
    """This machine's CPU as benchmarks name it: vendor, family, model, name, core count and
    the variant of the kernels' loops this process uses (from ``/proc/cpuinfo`` on Linux).

    Example:
        >>> "loops isa_" in cpu_description()
        True
    """
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() not in info:
                    info[key.strip()] = value.strip()
    except OSError:
        pass
    if "vendor_id" in info:  # x86
        parts = [info["vendor_id"], f"family {info.get('cpu family', '?')}",
                 f"model {info.get('model', '?')}", info.get("model name", "")]
    elif "CPU implementer" in info:  # aarch64: implementer and part numbers
        parts = [f"implementer {info['CPU implementer']}", f"part {info.get('CPU part', '?')}"]
    else:
        parts = [platform.processor() or platform.machine()]
    from cgx_jax import _cgx_cpu

    parts += [f"{os.cpu_count()} cores", f"loops {_cgx_cpu.cpu_isa()}"]
    return ", ".join(p for p in parts if p)


def median_seconds(fn, repeats: int, calls: int = 1, warmup: int = 3) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` runs after ``warmup`` calls (the
    first calls also pay for compiling and for first-touching XLA's output buffers). A run
    dispatches ``calls`` calls back to back and waits once: on a GPU, where dispatch is
    asynchronous, the host's dispatch then overlaps the device's work instead of adding to it.

    Example:
        >>> median_seconds(lambda: None, repeats=3) >= 0
        True
    """
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
        # Freed before the next run, as a loop that consumes its results frees them: two
        # large outputs alive at once make glibc alternate between fresh mappings, and the
        # page faults of a large output would be timed as the kernel's.
        del out
    return statistics.median(times)


def add_report_arguments(p: argparse.ArgumentParser, plot: str) -> None:
    """``--json``, ``--markdown``, ``--plot`` (``plot`` says what it draws) and
    ``--from-json``, the same in every benchmark that runs across processes."""
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    p.add_argument("--markdown", default=None, help="also write a markdown table to this path")
    p.add_argument("--plot", default=None,
                   help=f"also write a PNG of {plot} (needs matplotlib)")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="measure nothing: print and write the reports of an earlier --json")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The hidden options with which a benchmark starts its own worker processes."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)


def ran_worker_or_report(args, worker, write_reports) -> bool:
    """Runs ``worker(args)`` for ``--worker``, or rewrites the reports of an earlier
    ``--json`` for ``--from-json``; returns whether it did either (then ``main`` is done)."""
    if args.worker:
        worker(args)
        return True
    if args.from_json:
        with open(args.from_json) as f:
            write_reports(json.load(f), args)
        return True
    return False


def check_network_arguments(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` unless ``--processes`` is at least 2 and ``--link``, ``--netns-prefix``
    and ``--subnet`` can build the benchmark's network (``cgx_jax._src.netem.argument_problem``)."""
    from cgx_jax._src.netem import argument_problem

    if args.processes < 2:
        parser.error(f"--processes must be at least 2, got {args.processes}")
    problem = argument_problem(args.link, args.netns_prefix, args.subnet)
    if problem:
        parser.error(problem)


class Terminated(Exception):
    """SIGTERM or SIGHUP, raised so that every ``with shaped_network(...)`` unwinds."""


def run_links(name: str, links, run_link) -> tuple[int, list, list]:
    """Calls ``run_link(link, tmp) -> (exit code, rows, note)`` for each link rate in turn
    (stopping at the first failure) with a temporary directory; SIGTERM, SIGHUP and Ctrl-C
    stop it cleanly with exit code 130. Returns ``(exit code, rows, notes)``."""
    def on_term(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
    tmp = tempfile.mkdtemp(prefix=f"cgx_bench_{name}_")
    code, rows, notes = 0, [], []
    try:
        for link in links:
            code, link_rows, note = run_link(link, tmp)
            if code != 0:
                break
            rows += link_rows
            notes += [note] if note else []
    except (KeyboardInterrupt, Terminated) as e:
        print(f"cgx_jax.bench {name}: interrupted ({e or 'Ctrl-C'}); cleaned up",
              file=sys.stderr)
        code = 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(tmp, ignore_errors=True)
    return code, rows, notes


def write_reports(result: dict, args, title: str, format_table, format_markdown, plot,
                  footnote: str = "") -> None:
    """Prints ``title``, the CPU, ``result["notes"]``, the table (``format_table(rows)``) and
    ``footnote``; writes ``--json`` (the whole result), ``--markdown``
    (``format_markdown(rows, title)``) and ``--plot`` (``plot(rows, path, title)``) where
    asked."""
    rows = result["rows"]
    print(f"# {title}")
    print(f"# CPU: {cpu_description()}")
    for note in result["notes"]:
        print(f"# {note}")
    print(format_table(rows))
    if footnote:
        print(f"# note: {footnote}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(rows, f"`{result['command']}`: {title}"))
    if args.plot:
        plot(rows, args.plot, result["command"])
