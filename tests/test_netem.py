"""netem.py: a shaped network of namespaces (netem.Network) is built as described (a tbf qdisc
at the link rate, hosts files), carries TCP traffic from one namespace to another through the
bridge, takes a new rate while it runs (set_rate), cannot be created twice, and is removed
without problems afterwards (docs/design.md section 9). Needs root for network namespaces
and skips elsewhere. parse_rate is tested with
the benchmark's arguments in test_bench_allreduce.py; the launcher's and the benchmark's
shaped runs in test_launch.py and test_bench_allreduce.py."""

import os
import subprocess
import sys
import time

import pytest
from processes import needs_netns

from cgx_jax._src import netem

NETNS_PREFIX, NETNS_SUBNET = "cgxtnm", "10.213.82"  # this test's own (tests/processes.py)


@needs_netns
def test_network_is_built_carries_traffic_and_is_removed():
    stale = netem.namespaces(NETNS_PREFIX)
    assert not stale, f"stale namespaces from an earlier run: {stale}"
    network = netem.Network(2, 1e8, "100mbit", subnet=NETNS_SUBNET, prefix=NETNS_PREFIX)
    try:
        network.create()
        assert netem.namespaces(NETNS_PREFIX) == {f"{NETNS_PREFIX}{n}" for n in ("0", "1", "hub")}
        qdisc = subprocess.run(["ip", "netns", "exec", f"{NETNS_PREFIX}0", "tc", "qdisc", "show"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
        with open(f"/etc/netns/{NETNS_PREFIX}1/hosts") as f:
            assert f"{NETNS_SUBNET}.2 " in f.read()
        # A TCP round trip from namespace 1 to namespace 0's address, through the bridge.
        server = subprocess.Popen(
            ["ip", "netns", "exec", f"{NETNS_PREFIX}0", sys.executable, "-c",
             "import socket; s = socket.create_server(('" + NETNS_SUBNET + ".1', 23999)); "
             "c, _ = s.accept(); c.sendall(c.recv(16))"])
        try:
            client = None
            for _ in range(50):
                client = subprocess.run(
                    ["ip", "netns", "exec", f"{NETNS_PREFIX}1", sys.executable, "-c",
                     "import socket; c = socket.create_connection(('" + NETNS_SUBNET
                     + ".1', 23999), timeout=5); c.sendall(b'ping'); print(c.recv(16).decode())"],
                    capture_output=True, text=True)
                if client.returncode == 0:
                    break
                time.sleep(0.1)
            assert client.stdout.strip() == "ping", client.stderr
        finally:
            server.kill()
            server.wait()
        # A link that slows: both ends of every veth pair take the new rate.
        netem.set_rate(NETNS_PREFIX, 2, "20mbit")
        for ns in (f"{NETNS_PREFIX}0", f"{NETNS_PREFIX}1", f"{NETNS_PREFIX}hub"):
            qdisc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"],
                                   capture_output=True, text=True).stdout
            assert qdisc.count("rate 20Mbit") == (2 if ns.endswith("hub") else 1), qdisc
            assert "100Mbit" not in qdisc, qdisc
        with pytest.raises(ValueError, match="needs a rate such as 200mbit, got 'none'"):
            netem.set_rate(NETNS_PREFIX, 2, "none")
        with pytest.raises(RuntimeError, match="exist already"):
            netem.Network(2, 1e8, "100mbit", subnet=NETNS_SUBNET, prefix=NETNS_PREFIX).create()
    finally:
        problems = network.remove()
    assert problems == []
    assert not netem.namespaces(NETNS_PREFIX)
    assert not os.path.exists(f"/etc/netns/{NETNS_PREFIX}0")
