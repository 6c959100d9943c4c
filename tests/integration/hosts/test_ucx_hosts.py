"""UCX across two namespace hosts joined by a shaped veth link: a client on host b reads and writes through a
daemon on host a over ``ucx://`` (the simple deployment), and two cluster nodes read each other's objects over
UCX (``--peer-transport ucx``). UCX picks its TCP transport over the veth pair (no RDMA device here); the
point is that the UCX data path works between hosts, not only over loopback.
"""

from __future__ import annotations

import shutil

import pytest
from host_cluster import cluster_fleet
from host_fleet import Fleet, token_hosts

pytest.importorskip("ucxx", reason="ucxx is not installed (pip install -e '.[ucx]')")

MiB = 1 << 20
UCX_PORT = 7071


def ucx_connections(stats: dict) -> int:
    return sum(1 for c in stats.get("connections", []) if c.get("transport") == "ucx")


def test_a_client_on_b_moves_bytes_through_a_daemon_on_a_over_ucx():
    with token_hosts() as hosts:
        link = hosts.link("a", "b")
        fleet = Fleet(hosts, link, serve_args=("--listen", f"ucx://{link.address(hosts['a'])}:{UCX_PORT}"))
        fleet.start_daemon()
        try:
            assert fleet.client(fleet.b, fleet.tcp_url, "transport", "--transport", "ucx") == [{"transport": "ucx"}]
            for size in (1000, 3 * MiB + 7):
                assert fleet.client(fleet.a, fleet.unix_url, "put", f"x/{size}", size, 5)[-1] == {"ok": True}
                got = fleet.client(fleet.b, fleet.tcp_url, "get", f"x/{size}", size, 5, "--transport", "ucx")
                assert got[-1] == {"ok": True, "equal": True}
                put = fleet.client(fleet.b, fleet.tcp_url, "put", f"y/{size}", size, 6, "--transport", "ucx")
                assert put[-1] == {"ok": True}
                assert fleet.client(fleet.a, fleet.unix_url, "get", f"y/{size}", size, 6)[-1] == {"ok": True,
                                                                                                    "equal": True}
            assert fleet.client(fleet.a, fleet.unix_url, "publish", "u1", 24, 3) == [{"published": "u1"}]
            assert fleet.client(fleet.b, fleet.tcp_url, "fetch", "u1", 24, 3, "--transport", "ucx") == [{"equal": True}]
        finally:
            assert fleet.stop_daemon() == 0, fleet.daemon_log()


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                    reason="redis-server / redis-cli are not on PATH (apt-get install -y redis-server)")
def test_cluster_nodes_read_each_other_over_ucx():
    with cluster_fleet(ucx=True) as cluster:
        a, b, url = cluster.a, cluster.b, cluster.unix_url
        for size in (1000, 3 * MiB + 5):
            assert cluster.client(a, url, "put", f"c/{size}", size, 11)[-1] == {"ok": True}
            assert cluster.client(b, url, "get", f"c/{size}", size, 11)[-1] == {"ok": True, "equal": True}
            assert cluster.client(b, url, "put", f"d/{size}", size, 12)[-1] == {"ok": True}
            assert cluster.client(a, url, "get", f"d/{size}", size, 12)[-1] == {"ok": True, "equal": True}
        assert cluster.client(a, url, "publish", "cu1", 24, 4) == [{"published": "cu1"}]
        assert cluster.client(b, url, "fetch", "cu1", 24, 4) == [{"equal": True}]
        for host in (a, b):
            stats = cluster.node_stats(host)
            assert stats["cluster"]["remote_gets"] > 0 and stats["cluster"]["remote_misses"] == 0
            assert ucx_connections(stats) >= 1, stats.get("connections")  # the other node, over UCX
