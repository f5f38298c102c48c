"""A ROUTER's reply to a client that has gone is dropped, not fatal (the scheduler once died of
'Host unreachable' answering a stats call from an ingress that was shutting down)."""
import zmq

from pagedserve import transport
from pagedserve.pipeline import messages


def test_reply_to_a_gone_peer_is_dropped(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/r.sock"
    router = transport.make_socket(ctx, zmq.ROUTER, addr, bind=True)
    dealer = transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"client")
    try:
        msg = messages.Abort(["r1"])
        transport.send(dealer, msg)
        identity, got = transport.recv_routed(router)
        assert identity == b"client" and got == msg
        assert transport.send_to_peer(router, msg, b"client")
        assert transport.recv(dealer) == msg
        assert not transport.send_to_peer(router, msg, b"nobody")   # gone: dropped, no exception
    finally:
        dealer.close()
        router.close()
        ctx.term()
