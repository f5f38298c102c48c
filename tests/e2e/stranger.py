"""A peer without the cluster secret: `python tests/e2e/stranger.py ADDR SECONDS` connects to
the scheduler's plan socket twice - with CURVE keys from another secret, and in plain text - and
sends each a message a worker would send (run inside the other "host" of the netns test)."""
import sys
import time

import zmq

from pagedserve import cluster_auth, transport
from pagedserve.pipeline import messages

addr, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
wrong = cluster_auth.curve_client(cluster_auth.curve_keys(b"another secret, not the cluster's"))
socks = [transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"worker1",
                               secure=wrong),
         transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=b"worker0")]
for sock in socks:
    try:    # never delivered: the handshake fails, so there is no peer to queue it for
        transport.send(sock, messages.WorkerReady(1, 1, 10, 0), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass
time.sleep(seconds)
for sock in socks:
    sock.close(0)
ctx.term()
