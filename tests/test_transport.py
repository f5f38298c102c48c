"""The transport: a ROUTER's reply to a client that has gone is dropped, not fatal (the
scheduler once died of 'Host unreachable' answering a stats call from an ingress that was
shutting down); frames are dispatched by type, and what no handler takes is counted."""
import pytest
import zmq

from pagedserve import transport
from pagedserve.pipeline import messages

WIRE = transport.Codec(transport.message_types(messages))  # reads every message


def test_reply_to_a_gone_peer_is_dropped(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/r.sock"
    router = transport.make_socket(ctx, zmq.ROUTER, addr, bind=True)
    dealer = transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"client")
    try:
        msg = messages.Abort(["r1"])
        transport.send(dealer, msg)
        identity, got = WIRE.recv_routed(router)
        assert identity == b"client" and got == msg
        assert transport.send_to_peer(router, msg, b"client")
        assert WIRE.recv(dealer) == msg
        assert not transport.send_to_peer(router, msg, b"nobody")   # gone: dropped, no exception
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_dispatcher_calls_the_handler_of_the_type_and_counts_the_rest(caplog):
    from pagedserve.transport import Dispatcher

    seen, reported = [], []
    d = Dispatcher("tester", {messages.Abort: lambda msg, peer: seen.append((msg, peer))},
                   report=lambda tag, why: reported.append(tag))
    d.dispatch(messages.Abort(["a"]), b"peer")
    assert seen == [(messages.Abort(["a"]), b"peer")]
    with caplog.at_level("DEBUG", logger="pagedserve.tester"):
        for _ in range(3):
            assert d.dispatch(messages.Shutdown("x")) is None
        d.reject("Garbage", "undecodable")
    assert d.unknown == {"Shutdown": 3, "Garbage": 1} and reported == ["Shutdown"] * 3 + ["Garbage"]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "Shutdown" in warnings[0].getMessage()  # once per type


def test_a_failing_report_does_not_take_the_receiver_down():
    from pagedserve.transport import Dispatcher

    def broken(tag, why):
        raise OSError("socket gone")
    d = Dispatcher("tester", {}, report=broken)
    d.dispatch(messages.Shutdown("x"))
    assert d.unknown["Shutdown"] == 1


def test_undecodable_frames_name_their_tag():
    with pytest.raises(transport.WireError) as err:
        WIRE.decode([b"NoSuchMessage", b"\x80"])
    assert err.value.tag == "NoSuchMessage"
    with pytest.raises(transport.WireError) as err:
        WIRE.decode([b"Abort", b"\xc1"])
    assert err.value.tag == "Abort"


def test_receive_decodes_routes_and_rejects():
    from pagedserve.transport import Dispatcher

    got = []
    d = Dispatcher("tester", {messages.Abort: lambda msg, *sender: got.append((msg, sender))})
    d.receive(transport.encode(messages.Abort(["a"])))
    d.receive([b"id", *transport.encode(messages.Abort(["b"]))], routed=True)
    d.receive(transport.encode(messages.Abort(["c"])), with_sender=True)
    d.receive([b"id", b"Abort", b"\xc1"], routed=True)
    assert got == [(messages.Abort(["a"]), ()), (messages.Abort(["b"]), (b"id",)),
                   (messages.Abort(["c"]), (None,))]
    assert d.unknown == {"Abort": 1}


def test_an_oversized_frame_drops_its_sender_not_the_receiver(tmp_path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/big.sock"
    router = transport.make_socket(ctx, zmq.ROUTER, addr, bind=True, max_message_bytes=4096)
    big = transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"big")
    small = transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"small")
    try:
        big.send_multipart([b"Abort", b"\x00" * 10_000])
        transport.send(small, messages.Abort(["ok"]))
        assert router.poll(5000)
        identity, msg = WIRE.recv_routed(router)
        assert identity == b"small" and msg == messages.Abort(["ok"])
        assert not router.poll(300)  # the oversized frame never arrived
    finally:
        for s in (router, big, small):
            s.close(0)
        ctx.term()


def test_a_client_that_does_not_read_is_skipped_not_waited_for(tmp_path):
    import time
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/hwm.sock"
    router = transport.make_socket(ctx, zmq.ROUTER, addr, bind=True, hwm=10)
    idle = transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"idle", hwm=10)
    try:
        transport.send(idle, messages.Abort(["hello"]))  # the router learns its identity
        assert router.poll(5000)
        WIRE.recv_routed(router)
        payload = messages.Abort(["x" * 10_000])
        start, sent = time.monotonic(), 0
        while transport.send_to_peer(router, payload, b"idle"):
            sent += 1
            assert sent < 1_000_000
        assert time.monotonic() - start < 10  # a full queue answers at once, it never blocks
    finally:
        router.close(0)
        idle.close(0)
        ctx.term()


def test_a_dispatcher_decodes_only_the_types_it_handles():
    """The transport knows no message module: a role's table says what it decodes, and another
    message's frame is counted as one it has no handler for."""
    from pagedserve.transport import Dispatcher

    d = Dispatcher("tester", {messages.Abort: lambda msg: None})
    assert d.codec.takes(b"Abort") and not d.codec.takes(b"Shutdown")
    d.receive(transport.encode(messages.Shutdown("x")))
    assert d.unknown == {"Shutdown": 1}
    got = []
    d.handlers = {**d.handlers, messages.Shutdown: got.append}  # a new table: decoded too
    d.receive(transport.encode(messages.Shutdown("x")))
    assert got == [messages.Shutdown("x")] and d.unknown == {"Shutdown": 1}
    assert transport.Codec([messages.Abort]).decode(transport.encode(messages.Abort(["a"]))) \
        == messages.Abort(["a"])
