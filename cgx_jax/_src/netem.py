"""Emulated slow links between local processes (root only): one network namespace per
process, joined through a bridge in a hub namespace by veth pairs whose two ends are shaped
with ``tc ... tbf rate RATE`` (the process's egress, and the switch port's egress towards it,
like a full-duplex link of that rate). Addresses are private (``SUBNET.(rank+1)``) and exist
only inside these namespaces; each namespace gets ``/etc/netns/PREFIXrank/hosts`` mapping the
host name to its veth address, so Gloo binds there (docs/design.md section 9).
``shaped_network`` builds one for the length of a ``with`` block and removes exactly what it
made afterwards; ``python -m cgx_jax.launch --link`` and ``python -m cgx_jax.bench
allreduce`` both run their processes inside one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess

BRIDGE = "cgxbr0"  # inside the hub namespace, so runs with different prefixes do not clash


def parse_rate(text: str) -> float | None:
    """tc rate (``1gbit``, ``100mbit``, ``500kbit``) -> bits per second; ``none`` -> None."""
    if text.lower() in ("none", "unshaped", "0"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(
            f"link rate must look like 1gbit, 10gbit, 100mbit, or none: {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return result


class Network:
    """The namespaces, bridge, veth pairs, tc qdiscs and hosts files of one run; ``remove()``
    deletes exactly what ``create()`` made (idempotent)."""

    def __init__(self, num_processes: int, rate_bps: float, rate_text: str,
                 subnet: str = "10.213.0", prefix: str = "cgxnet"):
        self.n = num_processes
        self.rate_bps, self.rate_text = rate_bps, rate_text
        self.subnet = subnet
        self.prefix = prefix
        self.hub = prefix + "hub"
        self.namespaces: list[str] = []
        self.etc_dirs: list[str] = []
        self.made_etc_netns = False

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` run inside the namespace of the rank ``cgx_jax.launch`` gives it."""
        return ["sh", "-c", f'exec ip netns exec {self.prefix}"$CGX_JAX_PROCESS_ID" "$@"',
                "sh", *command]

    def _tbf(self, dev: str, ns: str) -> None:
        _ip("tc", "qdisc", "add", "dev", dev, "root", *_tbf_args(self.rate_text), ns=ns)

    def create(self) -> None:
        existing = namespaces(self.prefix)
        wanted = [self.hub] + [self.namespace(r) for r in range(self.n)]
        clash = [ns for ns in wanted if ns in existing]
        if clash:
            raise RuntimeError(
                f"network namespaces {clash} exist already (another run using them, or a "
                f"killed one): remove them with `ip netns del NAME` and "
                f"`rm -r /etc/netns/NAME` if they are stale")
        hostname = socket.gethostname()
        self.made_etc_netns = not os.path.isdir("/etc/netns")
        hub = self.hub
        _ip("ip", "netns", "add", hub)
        self.namespaces.append(hub)
        _ip("ip", "link", "set", "lo", "up", ns=hub)
        _ip("ip", "link", "add", BRIDGE, "type", "bridge", ns=hub)
        _ip("ip", "link", "set", BRIDGE, "up", ns=hub)
        for rank in range(self.n):
            ns = self.namespace(rank)
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            self.etc_dirs.append(etc)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(rank)} {hostname}\n")
            _ip("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            inner, outer = veth_names(rank)
            # Both ends are created directly inside their namespaces: nothing appears in
            # the host's own namespace.
            _ip("ip", "link", "add", inner, "netns", ns, "type", "veth",
                "peer", "name", outer, "netns", hub, ns=hub)
            _ip("ip", "link", "set", outer, "master", BRIDGE, ns=hub)
            _ip("ip", "link", "set", outer, "up", ns=hub)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _ip("ip", "addr", "add", f"{self.address(rank)}/24", "dev", inner, ns=ns)
            _ip("ip", "link", "set", inner, "up", ns=ns)
            self._tbf(inner, ns)
            self._tbf(outer, hub)

    def remove(self) -> list[str]:
        """Deletes the namespaces (which deletes their veths, bridge and qdiscs) and the
        hosts files; returns the problems met (empty when all went)."""
        problems = []
        for ns in reversed(self.namespaces):
            r = _ip("ip", "netns", "del", ns, check=False)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        self.namespaces = []
        for etc in self.etc_dirs:
            shutil.rmtree(etc, ignore_errors=True)
            if os.path.exists(etc):
                problems.append(f"could not remove {etc}")
        self.etc_dirs = []
        if self.made_etc_netns:
            try:
                os.rmdir("/etc/netns")  # only when this run created it and it is empty
            except OSError:
                pass
            self.made_etc_netns = False
        return problems


def veth_names(rank: int) -> tuple[str, str]:
    """The veth pair of ``rank``: (the end in its namespace, the end on the hub's bridge)."""
    return f"cgxv{rank}", f"cgxp{rank}"


def _tbf_args(rate_text: str) -> list[str]:
    """The ``tbf ...`` part of a ``tc qdisc add|change`` at ``rate_text``."""
    # Burst: at least one timer tick of traffic at 250 Hz, and no less than 32 KiB.
    burst = max(int(parse_rate(rate_text) / 8 / 250), 32 * 1024)
    return ["tbf", "rate", rate_text, "burst", str(burst), "latency", "100ms"]


def set_rate(prefix: str, num_processes: int, rate_text: str) -> None:
    """Changes the rate of every link of the running network ``prefix`` (both ends of each
    process's veth pair) to ``rate_text`` (``"200mbit"``), as a shared link slows or
    recovers. Root, from any namespace (a process of the run may call it between steps)."""
    if parse_rate(rate_text) is None:
        raise ValueError(f"set_rate needs a rate such as 200mbit, got {rate_text!r}")
    for rank in range(num_processes):
        inner, outer = veth_names(rank)
        _ip("tc", "qdisc", "change", "dev", inner, "root", *_tbf_args(rate_text),
            ns=f"{prefix}{rank}")
        _ip("tc", "qdisc", "change", "dev", outer, "root", *_tbf_args(rate_text),
            ns=f"{prefix}hub")


@contextlib.contextmanager
def shaped_network(num_processes: int, link: str | None, *, subnet: str, prefix: str, warn):
    """A ``Network`` of ``num_processes`` namespaces behind ``link`` (a tc rate such as
    ``"1gbit"``) for the ``with`` block, removed afterwards, also on an exception. Yields
    ``None`` (run unshaped on loopback) for ``link`` None or ``"none"``, and, after
    ``warn(message)``, where namespaces cannot be made (not root, no ``ip``/``tc``).
    Cleanup problems are reported through ``warn`` too.

    Example:
        >>> with shaped_network(2, None, subnet="10.213.9", prefix="doc", warn=print) as net:
        ...     print(net)
        None
    """
    rate = None if link is None else parse_rate(link)
    if rate is None:
        yield None
        return
    ok, why = can_shape()
    if not ok:
        warn(f"WARNING: cannot emulate a {link} link ({why}); running UNSHAPED on loopback")
        yield None
        return
    network = Network(num_processes, rate, link, subnet, prefix)
    try:
        network.create()
        yield network
    finally:
        for problem in network.remove():
            warn(f"cleanup problem: {problem}")


def can_shape() -> tuple[bool, str]:
    """Whether this process may build the namespaces: root, ``ip`` and ``tc`` present, and a
    probe namespace can be added and deleted (containers often lack the capability)."""
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "`ip` or `tc` not found"
    probe = f"cgxprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, text=True)
    return True, ""


def namespaces(prefix: str = "") -> set[str]:
    """Names of the network namespaces that exist now (those starting with ``prefix``)."""
    listing = _ip("ip", "netns", "list").stdout
    return {line.split()[0] for line in listing.splitlines()
            if line.strip() and line.startswith(prefix)}


def argument_problem(links: list[str], prefix: str, subnet: str) -> str | None:
    """What is wrong with the ``--link`` values, ``--netns-prefix`` and ``--subnet`` of a
    command line, or None; for ``parser.error``."""
    for link in links:
        try:
            parse_rate(link)
        except argparse.ArgumentTypeError as e:
            return f"argument --link: {e}"
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,9}", prefix) is None:
        return (f"--netns-prefix must be a letter and up to 9 letters, digits, _ or -, "
                f"got {prefix!r}")
    if re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet) is None:
        return f"--subnet must be three octets such as 10.213.1, got {subnet!r}"
    return None
