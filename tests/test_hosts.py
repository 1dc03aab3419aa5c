"""Hosts on one machine (benchmarks/hosts.py: network namespaces on a bridge) and chaos runs
across them (benchmarks/chaos.py --partitions): the harness removes what it made whatever
happens, its faults cut what they say, and every invariant of the chaos runs holds through
partitions, one-way cuts, delay above the op timeout, packet loss and partitions that heal mid
resize and mid loan, with the daemon on one host and CURVE over TCP to the others."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")


def _hosts_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_hosts", BENCH / "hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def tcp_probe(hosts, i: int, address: str, port: int) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=1.5).close()"
    return hosts.run(i, [sys.executable, "-c", code], timeout=30)


def test_hosts_reach_each_other_and_a_cut_or_a_blackhole_stops_exactly_what_it_says() -> None:
    mod = _hosts_module()
    server = ("import socket\ns = socket.socket(); s.bind(('10.77.0.1', 7100)); s.listen()\n"
              "while True: s.accept()[0].close()")
    with mod.Hosts(3, tag="probe") as net:
        net.popen(0, [sys.executable, "-c", server])
        for _ in range(50):
            if tcp_probe(net, 1, "10.77.0.1", 7100).returncode == 0:
                break
            time.sleep(0.1)
        assert tcp_probe(net, 2, "10.77.0.1", 7100).returncode == 0
        net.cut(2)
        assert tcp_probe(net, 2, "10.77.0.1", 7100).returncode != 0
        assert tcp_probe(net, 1, "10.77.0.1", 7100).returncode == 0  # the other host is not cut
        net.heal(2)
        assert tcp_probe(net, 2, "10.77.0.1", 7100).returncode == 0
        net.block(1, 0)  # host 1's packets to host 0 are discarded at host 1
        assert tcp_probe(net, 1, "10.77.0.1", 7100).returncode != 0
        net.heal(1)
        assert tcp_probe(net, 1, "10.77.0.1", 7100).returncode == 0
        made = set(net.made)
        assert made <= namespaces()
        # nothing of it in this machine's own namespace
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert "br0" not in links and " p0" not in links
    assert not made & namespaces()


def test_everything_is_removed_after_a_failure_inside_the_harness() -> None:
    mod = _hosts_module()
    with pytest.raises(RuntimeError, match="a failing run"):
        with mod.Hosts(2, tag="fails") as net:
            made = set(net.made)
            sleeper = net.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("a failing run")
    assert made and not made & namespaces()
    assert sleeper.poll() is not None  # its processes are stopped too


def test_a_harness_stopped_by_sigterm_removes_its_namespaces_and_one_killed_is_swept(tmp_path: Path) -> None:
    script = tmp_path / "harness.py"
    script.write_text(f"""
import sys, time
sys.path.insert(0, {str(BENCH)!r})
from hosts import Hosts
with Hosts(2, tag="sig") as net:
    print(" ".join(net.made), flush=True)
    time.sleep(600)
""")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        made = set(proc.stdout.readline().split())
        assert made and made <= namespaces()
        proc.send_signal(sig)
        proc.wait(timeout=30)
        if sig == signal.SIGKILL:  # nothing could run in it: the next harness sweeps its leftovers
            assert made <= namespaces()
            assert made <= set(_hosts_module().sweep())
        assert not made & namespaces()


@pytest.mark.slow
def test_chaos_runs_across_hosts_keep_every_invariant_through_partitions(tmp_path: Path) -> None:
    # Seeds 0-7: one of each network fault (PARTITIONS[seed % 8]); the benchmark runs more
    # (`python benchmarks/chaos.py --partitions --runs N`).
    done = subprocess.run([sys.executable, str(BENCH / "chaos.py"), "--partitions", "--runs", "8", "--seed", "0",
                           "--jobs", "4", "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["runs"] == 8
    assert report["violations"] == 0, json.dumps(report["violation_list"], indent=1)
    kinds = report["partitions"]
    assert set(kinds) == {"partition_short", "partition_long", "one_way_to_daemon", "one_way_from_daemon", "delay",
                          "loss", "heal_mid_resize", "heal_mid_loan"}
    timed = ("partition_short", "partition_long", "one_way_to_daemon", "one_way_from_daemon", "delay")
    assert all(kinds[k]["applied"] == 1 for k in timed)
    if shutil.which("nft"):
        assert kinds["loss"]["applied"] == 1
    # A cut longer than the heartbeat timeout loses the host's workers; they come back and
    # converge (settling checked it); one shorter loses nobody.
    assert kinds["partition_long"]["workers_lost"] > 0
    assert kinds["partition_short"]["workers_lost"] == 0
    assert report["resizes_committed"] > 0
