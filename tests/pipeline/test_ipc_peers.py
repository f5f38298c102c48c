"""A ROUTER's reply to a client that has gone is dropped, not fatal (the scheduler once died of
'Host unreachable' answering a stats call from an ingress that was shutting down)."""
import zmq

from pagedserve.pipeline import ipc, messages


def test_reply_to_a_gone_peer_is_dropped(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/r.sock"
    router = ipc.make_socket(ctx, zmq.ROUTER, addr, bind=True)
    dealer = ipc.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"client")
    try:
        msg = messages.Abort(["r1"])
        ipc.send(dealer, msg)
        identity, got = ipc.recv_routed(router)
        assert identity == b"client" and got == msg
        assert ipc.send_to_peer(router, msg, b"client")
        assert ipc.recv(dealer) == msg
        assert not ipc.send_to_peer(router, msg, b"nobody")   # gone: dropped, no exception
    finally:
        dealer.close()
        router.close()
        ctx.term()
