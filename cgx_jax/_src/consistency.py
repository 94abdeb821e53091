"""Processes that disagree on the wire get an error, never garbage (docs/design.md section 8).

Every setting that shapes a compressed all-reduce's packets (codec of every segment, segment
layout, algorithm, participant count, the leaves' shapes and dtypes, the library version) is
decided in Python at trace time, separately in each process. If one process decides
differently (a config read differently on one host, a stale install), the processes exchange
packets of different sizes: Gloo aborts one of them and another may return garbage. So before
a compressed all-reduce is first compiled in a multi-process run, ``check_processes_agree``
publishes this process's settings in ``jax.distributed``'s key-value store, reads every other
process's, and raises ``ProcessesDisagreeError`` on every process, naming the settings that
differ and each process's value, before any byte moves. It runs once per trace: a compiled
step costs nothing more, and a single process skips it. The compressed all-reduce, all-gather
and reduce-scatter all run it.

The key-value store lives in process 0 (``jax.distributed``'s coordination service), and a
script that meets the error usually ends at once, taking the store with it. So before
process 0 raises it waits until every other process has read all the settings (each says so
under ``.../read/<process>``): every process names the differing setting, none reports a
peer "gone".
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import json
import sys

import jax

from cgx_jax._src.collectives.jax_compat import distributed_client

# How long a process waits for the others to reach the same compressed all-reduce (they
# may compile or load data at different speeds).
WAIT_SECONDS = 300.0
# How long process 0 waits, before raising, for the others to have read every setting (they
# are past their own wait, so only reading remains).
READ_WAIT_SECONDS = 60.0

_calls = itertools.count()  # the n-th check of this process meets the n-th of the others


class ProcessesDisagreeError(ValueError):
    """The processes of a multi-process run decided differently what a compressed all-reduce
    sends (or one of them never reached it). A ``ValueError``, raised at trace time on every
    process, before any byte moves, naming each setting that differs.

    Example:
        >>> import cgx_jax as cgx
        >>> try:  # what a process whose policy differs from its peers' meets
        ...     raise cgx.ProcessesDisagreeError("bits: process 0: 4, process 1: 8")
        ... except ValueError as error:
        ...     print(type(error).__name__, error)
        ProcessesDisagreeError bits: process 0: 4, process 1: 8
    """


def check_processes_agree(settings: dict, what: str = "compressed all-reduce") -> None:
    """Compares ``settings`` (a dict of JSON-able values) across the processes of a
    ``jax.distributed`` run; ``ProcessesDisagreeError`` naming what differs. A no-op in one
    process.

    Example:
        >>> check_processes_agree({"bits": 4})  # one process: nothing to compare
    """
    if jax.process_count() == 1:
        return
    client = distributed_client()
    if client is None:
        return
    call, me = next(_calls), jax.process_index()
    key = "cgx_jax/processes_agree/{}/{}"
    client.key_value_set(key.format(call, me), json.dumps(settings, sort_keys=True))
    everyone = {}
    for rank in range(jax.process_count()):
        try:
            value = client.blocking_key_value_get(key.format(call, rank),
                                                  int(WAIT_SECONDS * 1000))
        except Exception as error:  # noqa: BLE001 - jaxlib raises its own XlaRuntimeError
            raise ProcessesDisagreeError(
                f"cgx_jax: process {rank} did not reach this {what} (check {call} of process "
                f"{me}) within {WAIT_SECONDS:g} s: the processes run different programs, or "
                f"it is stuck or gone ({str(error)[:200]})") from None
        everyone[rank] = json.loads(value)
    differing = describe_differences(everyone)
    if differing:
        message = (
            f"cgx_jax: the processes disagree on what this {what} sends, so they would "
            f"exchange packets of different sizes (a crash, or garbage). Nothing was sent. "
            f"Differing settings:\n{differing}\nEvery process must run the same cgx_jax "
            f"with the same codec or policy, algorithm and model: look for a setting read "
            f"differently on one host (environment, config file, command line) or a stale "
            f"install.")
        # Said before the handshake: once process 0, which hosts the key-value store, has
        # exited, JAX's coordination agent may kill this process before its caller could
        # print the error it raises.
        print(f"process {me}: {message}", file=sys.stderr, flush=True)
        _wait_until_all_have_read(client, f"cgx_jax/processes_agree/{call}/read", me)
        raise ProcessesDisagreeError(message)


def _wait_until_all_have_read(client, prefix: str, me: int) -> None:
    """Says that this process has read every setting; process 0, which hosts the key-value
    store, then waits for the others to say so too (at most ``READ_WAIT_SECONDS``), so that
    its exit cannot cut a slower process off in the middle of reading."""
    client.key_value_set(f"{prefix}/{me}", "1")
    if me != 0:
        return
    for rank in range(1, jax.process_count()):
        try:
            client.blocking_key_value_get(f"{prefix}/{rank}", int(READ_WAIT_SECONDS * 1000))
        except Exception:  # noqa: BLE001 - gone or stuck: it cannot be helped by waiting
            return


@functools.cache
def installed_version() -> str:
    """The installed cgx_jax's version (its package metadata)."""
    try:
        return importlib.metadata.version("cgx_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def describe_differences(everyone: dict) -> str:
    """One line per setting whose value is not the same on every process, listing each
    value with the processes that hold it; ``""`` when all agree.

    Example:
        >>> print(describe_differences({0: {"bits": 4, "n": 2}, 1: {"bits": 2, "n": 2}}))
          bits: 4 on process 0; 2 on process 1
    """
    names = sorted(set().union(*(settings.keys() for settings in everyone.values())))
    lines = []
    for name in names:
        holders = {}
        for rank, settings in sorted(everyone.items()):
            value = json.dumps(settings.get(name, "(missing)"))
            holders.setdefault(value, []).append(rank)
        if len(holders) > 1:
            parts = [f"{_shorten(value)} on process{'es' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))}" for value, ranks in holders.items()]
            lines.append(f"  {name}: " + "; ".join(parts))
    return "\n".join(lines)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
