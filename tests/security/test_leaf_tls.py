"""A leaf's upstream link over mutual TLS with a persistent identity key."""

from __future__ import annotations

import pytest

from murmura.protocols.identity import NodeKey
from murmura.protocols.tls import make_ca, make_client_cert, make_server_cert
from murmura.server import ServerConfig, ServerThread, build_core
from murmura.server.leaf import Leaf
from tests.integration.test_leaf import TASK, run_clients

pytestmark = pytest.mark.integration


def test_a_leaf_joins_its_parent_over_mutual_tls_under_its_own_key(tmp_path) -> None:
    make_ca(tmp_path / "ca")
    make_server_cert(tmp_path / "ca", tmp_path / "top", ["127.0.0.1"])
    make_client_cert(tmp_path / "ca", tmp_path / "leaf", "site-a")
    key = NodeKey.generate()
    key.save(tmp_path / "site-a.key")
    top_core = build_core(ServerConfig.from_flat(min_clients=1, max_versions=1, workers=0,
                                                 tls_cert=str(tmp_path / "top" / "server.crt"),
                                                 tls_key=str(tmp_path / "top" / "server.key"),
                                                 client_ca=str(tmp_path / "ca" / "ca.crt"),
                                                 allowed_keys=str(tmp_path / "site-a.key.pub"),
                                                 leaf_keys=str(tmp_path / "site-a.key.pub")),
                          TASK, out_dir=None, evaluate=False)
    servers: list[ServerThread] = []
    try:
        top = ServerThread(top_core, "127.0.0.1:0").start()
        servers.append(top)
        leaf_cfg = ServerConfig.from_flat(role="leaf", upstream=top.address, min_clients=2,
                                          workers=0, key=str(tmp_path / "site-a.key"),
                                          upstream_tls_ca=str(tmp_path / "ca" / "ca.crt"),
                                          upstream_tls_cert=str(tmp_path / "leaf" / "site-a.crt"),
                                          upstream_tls_key=str(tmp_path / "leaf" / "site-a.key"))
        leaf = ServerThread(Leaf(leaf_cfg, TASK)).start()
        servers.append(leaf)
        threads = run_clients([leaf.address] * 2)  # its own clients: signed, plaintext loopback
        assert top.wait_done(timeout=120)
        for th in threads:
            th.join(30)
        ids = top.call(lambda: {r.client_id for r in top_core.sessions.values()}
                       | set(top_core._left.values()))
        assert ids == {key.client_id}  # the allow-listed key, and nobody else
        assert top.call(lambda: top_core.version) == 1
        assert top.call(lambda: top_core.traffic.refused) == {}
    finally:
        for srv in reversed(servers):
            srv.stop(grace=None)
