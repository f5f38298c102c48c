"""lifecycle.SignalWakeup: a signal ends a long zmq poll at once, and once drained the poll
waits again (a wakeup left readable would turn the scheduler's loop into a busy spin)."""
from __future__ import annotations

import os
import signal
import time

import zmq

from pagedserve.lifecycle import SignalWakeup


def test_a_signal_wakes_the_poll_and_draining_quiets_it():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    previous_fd = signal.set_wakeup_fd(-1)
    try:
        wakeup = SignalWakeup()
        poller = zmq.Poller()
        poller.register(wakeup.fileno(), zmq.POLLIN)
        assert dict(poller.poll(0)) == {}
        os.kill(os.getpid(), signal.SIGUSR1)
        started = time.monotonic()
        events = dict(poller.poll(5000))
        assert wakeup.fileno() in events and time.monotonic() - started < 1.0
        assert received == [signal.SIGUSR1]
        wakeup.drain()
        started = time.monotonic()
        assert dict(poller.poll(200)) == {}          # waits its whole timeout again
        assert time.monotonic() - started >= 0.15
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGUSR1, previous)
