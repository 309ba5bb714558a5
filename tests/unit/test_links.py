"""The scheduler <-> worker links (shared/links.py) and the Ray placement layout: ipc:// in the
private runtime folder by default; over TCP, CurveZMQ that admits the instance's workers only
(a peer with other keys, or none, gets no message through), with the secrets kept out of reprs.
"""
import zmq

from conveyor.ray_workers import layout
from conveyor.shared import links
from conveyor.shared.config import EngineConfig, ServeConfig
from conveyor.shared.messages.control import Ready
from conveyor.shared.sockets import Socket


def serve_config(tmp_path, tcp: links.TcpLinks | None = None) -> ServeConfig:
    return ServeConfig(EngineConfig(), str(tmp_path), 1, links=tcp)


def test_links_stay_ipc_in_the_runtime_folder_by_default(tmp_path):
    cfg = serve_config(tmp_path)
    assert links.address(cfg, "worker-0") == f"ipc://{tmp_path}/worker-0"
    tcp = links.TcpLinks.draw("127.0.0.1", ["worker-0"], ())
    cfg = serve_config(tmp_path, tcp)
    assert links.address(cfg, "worker-0") == f"tcp://127.0.0.1:{tcp.ports['worker-0']}"
    assert links.address(cfg, "launcher") == f"ipc://{tmp_path}/launcher"   # local: ipc
    text = repr(cfg)
    assert all(k.decode() not in text for k in (*tcp.server_keys, *tcp.worker_keys))


def test_tcp_links_admit_the_instance_s_workers_only(tmp_path):
    cfg = serve_config(tmp_path, links.TcpLinks.draw("127.0.0.1", ["results"], ()))
    ctx = zmq.Context()
    auth = links.admit_workers(ctx, cfg)
    try:
        server = links.bind(ctx, zmq.PULL, cfg, "results", allowed=(Ready,))
        address = links.address(cfg, "results")
        stranger_keys = zmq.curve_keypair()   # knows the server's public key, not the workers'
        strangers = [Socket(ctx, zmq.PUSH, address, bind=False),
                     Socket(ctx, zmq.PUSH, address, bind=False, curve_keys=stranger_keys,
                            curve_server_key=cfg.links.server_keys[0])]
        for sock in strangers:
            sock.sock.setsockopt(zmq.SNDTIMEO, 300)
            try:
                sock.send(Ready("stranger"))
            except zmq.Again:                 # no handshake completed: nowhere to send
                pass
        assert not server.sock.poll(500)
        worker = links.connect(ctx, zmq.PUSH, cfg, "results")
        worker.send(Ready("worker-0", {"num_blocks": 3}))
        assert server.sock.poll(5000)
        assert server.recv()[1] == Ready("worker-0", {"num_blocks": 3})
        for sock in [*strangers, worker, server]:
            sock.close()
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_ray_layout_packs_a_replica_then_its_stages_then_spreads():
    assert layout([8, 8], tp=4, pp=2) == [("STRICT_PACK", 8)]          # one node holds it
    assert layout([4, 4], tp=4, pp=2) == [("STRICT_PACK", 4)] * 2      # stage s on a node
    assert layout([1, 1], tp=2, pp=1) == [("PACK", 2)]                 # TP over nodes
    assert layout([], tp=1, pp=1) == [("PACK", 1)]
