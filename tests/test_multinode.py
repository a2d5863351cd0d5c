"""Many nodes on one host: a Ray cluster of 2 network namespaces, an IP each (conftest.netns_cluster,
cluster/netns.sh), so that Ray numbers them node 0 and node 1 as on a real cluster."""

import pytest

pytestmark = pytest.mark.slow  # starts Ray: not in make test-fast

SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as s:
    print(s.getsockname()[1], flush=True)
    conn, peer = s.accept()
    with conn:
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        print(peer[0], len(got), flush=True)
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as c:
    c.sendall(b"x" * (1 << 20))
"""


def test_nodes_reach_each_other_over_their_private_network_and_nothing_else(netns_cluster):
    c = netns_cluster
    server = c.popen(1, "python3", "-c", SERVER, c.ip(1), stdout=-1, text=True)
    try:
        port = server.stdout.readline().strip()
        sent = c.run(0, "python3", "-c", CLIENT, c.ip(1), port, timeout=60)
        assert sent.returncode == 0, sent.stderr
        assert server.stdout.readline().split() == [c.ip(0), str(1 << 20)]  # from node 0's address, every byte
    finally:
        server.kill()
        server.wait()
    for node in range(c.nodes):
        # a node has its loopback and its one link, and a route to the cluster's /24 only: no way out of it
        links = c.run(node, "ip", "-o", "link").stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"]
        assert c.run(node, "ip", "route").stdout.split() == \
            ["10.213.0.0/24", "dev", "eth0", "proto", "kernel", "scope", "link", "src", c.ip(node)]

