"""The namespace hosts themselves: isolated from each other except for the link, and removed completely."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import pid_alive, wait_until

from kvstore.testing import hosts as H

pytestmark = pytest.mark.skipif(H.unavailable_reason() is not None, reason=str(H.unavailable_reason()))

_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)"


def test_hosts_share_only_the_link():
    with H.Hosts(("a", "b"), rate_gbit=1) as hosts:
        a, b = hosts["a"], hosts["b"]
        link = hosts.link("a", "b")
        a.run(["sh", "-c", "echo a > /dev/shm/mark && echo a > /tmp/mark"])
        assert "mark" not in b.run(["sh", "-c", "ls /dev/shm /tmp"]).stdout  # private /dev/shm and /tmp
        with open(a.path("/tmp/mark")) as f:  # reachable from outside through the keeper
            assert f.read() == "a\n"
        ids = [h.run([sys.executable, "-c", "from kvstore.protocol.url import host_id; print(host_id())"]).stdout
               for h in (a, b)]
        assert ids[0] != ids[1]  # so a daemon's same-host paths stay off between them
        rate = H.measure_link(link, 4 << 20, 2)  # the raw socket crosses the link
        assert rate.nbytes == 4 << 20 and len(rate.seconds) == 2 and rate.gbit_s > 0
        listener = a.popen([sys.executable, "-c", "import socket, time; s = socket.create_server(('0.0.0.0', 7011));"
                            "time.sleep(600)"])
        assert a.wait_listening(7011, 30, listener)
        assert b.run([sys.executable, "-c", _CONNECT, link.address(a), "7011"], check=False).returncode == 0
        link.set_up(False)
        assert b.run([sys.executable, "-c", _CONNECT, link.address(a), "7011"], check=False).returncode != 0
        assert H.namespaces()  # alive while open
    assert H.namespaces() == []
    assert listener.poll() is not None


def test_failed_setup_removes_what_it_made():
    with pytest.raises(KeyError):
        with H.Hosts(("a", "b"), links=[("a", "zz")]):
            pass
    assert H.namespaces() == []
    with pytest.raises(ValueError):
        H.Hosts(("a", "a"))


def test_processes_left_behind_in_a_host_end_with_it():
    with H.Hosts(("a", "b")) as hosts:
        starter = hosts["a"].popen(["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE, text=True)
        orphan = int(starter.stdout.readline())
        starter.wait(10)
    wait_until(lambda: not pid_alive(orphan), 10)
    assert not pid_alive(orphan)
