"""A link with a settable one-way delay, in user space (this kernel has no netem qdisc).

A `DelayWire` is an Ethernet cable with a delay: a process holds two TAP devices, one
that becomes a host's eth0 in its namespace and one on the bridge, and copies every
frame from each to the other `delay_ms` after it arrived (asyncio; each direction a FIFO,
so order is kept, and lowering the delay never reorders frames already on the wire).
Transparent to what crosses it: every TCP connection of the host (gRPC to its services,
Ray's control traffic, Redis) pays the delay each way, as across a real link, and no
service needs to be told of a proxy. The delay is changed while it runs (`set_delay`).

Timers have asyncio's (epoll's) millisecond resolution: a frame leaves up to about 1 ms
late, and every frame pays the copy through this process (tens of microseconds, more on
a busy machine); `measure_rtt` says what a round trip across it really costs.

Run as a script it is the wire itself:
    python tests/delay_proxy.py wire TAP_OUTSIDE TAP_INSIDE DELAY_MS
(it prints `ready` once both devices exist; a line `delay MS` on stdin changes the delay).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
FRAME_BYTES = 65536


def open_tap(name: str) -> int:
    """Create TAP device `name` (gone when the descriptor closes) and return its descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class _Direction:
    """Frames from `src` written to `dst` `wire.delay_s` after they arrived, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: int, dst: int, wire: "_Wire"):
        self.loop, self.src, self.dst, self.wire = loop, src, dst, wire
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.timer: asyncio.TimerHandle | None = None
        loop.add_reader(src, self.readable)

    def readable(self) -> None:
        due = self.loop.time() + self.wire.delay_s
        while True:
            try:
                self.queue.append((due, os.read(self.src, FRAME_BYTES)))
            except BlockingIOError:
                break
        if self.timer is None:
            self.flush()

    def flush(self) -> None:
        self.timer = None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now:
            frame = self.queue.popleft()[1]
            try:
                os.write(self.dst, frame)
            except (BlockingIOError, OSError):  # the device's queue is full (or it is down): dropped,
                pass  # as a congested link drops; TCP sends it again
        if self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self.flush)


class _Wire:
    def __init__(self, delay_ms: float):
        self.delay_s = delay_ms / 1000


async def _run(outside: str, inside: str, delay_ms: float) -> None:
    loop = asyncio.get_running_loop()
    a, b = open_tap(outside), open_tap(inside)
    wire = _Wire(delay_ms)
    _Direction(loop, a, b, wire)
    _Direction(loop, b, a, wire)
    print("ready", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        words = line.split()
        if len(words) == 2 and words[0] == b"delay":
            wire.delay_s = float(words[1]) / 1000
            print(f"delay {float(words[1])}", flush=True)
    # stdin closed: the wire's owner is gone; so is the wire (and both devices with it)


class DelayWire:
    """The wire's process, started with both TAP devices made (`outside` stays in this
    namespace, for the bridge; `inside` is moved into the host's by the caller)."""

    def __init__(self, outside: str, inside: str, delay_ms: float, log: Path):
        self.delay_ms = delay_ms
        self.proc = subprocess.Popen([sys.executable, __file__, "wire", outside, inside, str(delay_ms)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "ab"),
                                     text=True, start_new_session=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the delay wire did not start (see {log})")

    def set_delay(self, delay_ms: float) -> None:
        self.proc.stdin.write(f"delay {delay_ms}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == f"delay {float(delay_ms)}"
        self.delay_ms = delay_ms

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# --- measuring a link ---------------------------------------------------------------
ECHO = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := c.recv(65536):
    c.sendall(data)
"""


@contextlib.contextmanager
def echo_server(host, port: int = 7999):
    """A TCP echo server (one connection) on `host` (a tests.netns.Host); yields its address."""
    echo = subprocess.Popen(host.cmd(sys.executable, "-c", ECHO, host.ip, str(port)), stdout=subprocess.PIPE,
                            text=True, env=host.env)
    try:
        assert echo.stdout.readline().strip() == "listening"
        yield host.ip, port
    finally:
        echo.kill()
        echo.wait()


def measure_rtt(host, port: int = 7999, rounds: int = 50) -> tuple[float, float]:
    """(median, minimum) ms of a one-byte TCP round trip from this namespace to an echo
    server on `host` (a tests.netns.Host): twice the one-way delay and what the path adds."""
    import socket

    with echo_server(host, port) as address, socket.create_connection(address, timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return times[len(times) // 2], times[0]


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "wire":
        raise SystemExit(__doc__)
    asyncio.run(_run(sys.argv[2], sys.argv[3], float(sys.argv[4])))
