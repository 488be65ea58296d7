"""Which connections are up, from zmq's socket monitor: a dead peer is noticed when its
connections close, not a heartbeat timeout later.

A process killed with SIGKILL (or by the OOM killer) has its TCP connections
closed by the kernel at once, and zmq reports each close as a monitor event.
A connection that closes and comes back within ``RECONNECT_GRACE`` seconds
(zmq reconnects on its own) is not a lost peer. Heartbeats stay for peers
that hang or vanish without closing anything.
"""
from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from adtopk_ps.core.env import env_int

#: how long a closed connection may take to come back before its peer counts as lost
RECONNECT_GRACE = 1.0


def stall_limits() -> tuple[float, float]:
    """Seconds a wait on a worker that sends nothing may last before it is named
    (``PS_STALL_WARN_S``, 60) and before the job ends or goes on without it
    (``PS_STALL_ABORT_S``, 300; 0: never): a server's rounds and the scheduler's calls alike."""
    return (float(env_int("PS_STALL_WARN_S", 60, minimum=1)),
            float(env_int("PS_STALL_ABORT_S", 300, minimum=0)))

_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake with it failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake with it failed (a protocol error)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it refused our key",
}


class Monitor:
    """The monitor of one socket, read without blocking; ``sock`` goes into pollers so
    that an event wakes the loop that owns the watched socket (zmq sockets are not
    thread-safe: the monitor belongs to the watched socket's thread)."""

    def __init__(self, watched: zmq.Socket):
        self._watched = watched
        self.sock = watched.get_monitor_socket(_EVENTS)
        self.sock.setsockopt(zmq.LINGER, 0)

    def events(self) -> list[tuple[int, int]]:
        """(event, value) pairs that have arrived; the value is the fd for accepted,
        connected and disconnected connections."""
        out = []
        while self.sock.poll(0):
            try:
                event = recv_monitor_message(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append((int(event["event"]), int(event["value"])))
        return out

    def close(self) -> None:
        """Stop the monitor, then close its socket; before the watched socket closes. (A
        monitor left running sends the watched socket's last events to a socket nobody reads,
        which blocks the context's I/O thread: every later connection of the process stalls.)"""
        try:
            self._watched.disable_monitor()
        except zmq.ZMQError:
            pass  # the watched socket is already closed
        self.sock.close(0)


class PeerWatch(Monitor):
    """A connecting socket's view of its one peer: reachable yet, and since when down."""

    def __init__(self, watched: zmq.Socket):
        super().__init__(watched)
        self.ever_connected = False
        self.down_since: float | None = None
        self.retries = 0  # connection attempts that failed before the first handshake
        self.tcp_connected = False  # a TCP connection was made, handshake or not
        self.problem: str | None = None  # the last handshake failure, if any
        self.reconnects = 0  # handshakes after the first: the connection closed and came back

    def update(self) -> None:
        """Read the socket's pending connect and disconnect events."""
        for event, _ in self.events():
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.reconnects += self.ever_connected
                self.ever_connected, self.down_since, self.problem = True, None, None
            elif event == zmq.EVENT_DISCONNECTED:
                if self.ever_connected and self.down_since is None:
                    self.down_since = time.monotonic()
            elif event == zmq.EVENT_CONNECTED:
                self.tcp_connected = True
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.retries += 1
            elif event in _HANDSHAKE_FAILED:
                self.problem = _HANDSHAKE_FAILED[event]

    def lost(self) -> bool:
        """True once the connection has been closed for longer than the grace."""
        self.update()
        return self.down_since is not None and time.monotonic() - self.down_since > RECONNECT_GRACE

    def closed_for(self) -> float:
        """Seconds the connection has been down (0 while up)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since


class ConnectionTable(Monitor):
    """A binding socket's open connections, by fd, for mapping a peer to the connection
    its messages arrive on (``frame.get(zmq.SRCFD)``)."""

    def __init__(self, watched: zmq.Socket):
        super().__init__(watched)
        self.open: set[int] = set()

    def update(self) -> list[int]:
        """Apply the new events; returns the fds that closed."""
        closed = []
        for event, fd in self.events():
            if event == zmq.EVENT_ACCEPTED:
                self.open.add(fd)
            elif event == zmq.EVENT_DISCONNECTED:
                self.open.discard(fd)
                closed.append(fd)
        return closed
