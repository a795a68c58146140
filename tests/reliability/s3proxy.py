"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of an S3 server (tests only).

Threads, one per client connection, each with its own upstream connection.  Each request is
parsed (request line, headers, Content-Length or chunked body) and then, by a seeded RNG or a
forced plan, one of:

* ``pass``: relayed to the upstream, the response relayed back (Content-Length, chunked, HEAD).
* ``throttle``: answered ``503 SlowDown`` with a valid S3 XML error body (the upstream never sees
  the request); the connection is then closed.
* ``reset_req``: the request is read (headers and part of the body) and the socket is reset (RST,
  SO_LINGER 0) without an answer.
* ``reset_resp``: the request is relayed, and the socket is reset after the response headers and
  part of the body were sent back (the upstream *did* execute the request).
* ``delay``: relayed after ``delay_s`` seconds.

``only = "/data/"`` limits the random faults to requests whose request line contains it.
``mode = "fail_all"`` answers every request with 503 (an endpoint that throttles forever);
``mode = "fail_writes"`` answers 503 to every PUT/POST and relays the rest;
``mode = "reset_all"`` resets every connection (a dead server behind a load balancer).

Counts of what happened are in :attr:`FaultProxy.counts`.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time
from typing import Any

KINDS = ("pass", "throttle", "reset_req", "reset_resp", "delay")

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><Resource>/</Resource>"
    b"<RequestId>s4w-fault-proxy</RequestId></Error>"
)


class _Closed(Exception):
    pass


class _Conn:
    """A socket with a read buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        d = self.sock.recv(65536)
        if not d:
            raise _Closed()
        self.buf += d

    def readline(self) -> bytes:
        while b"\r\n" not in self.buf:
            if len(self.buf) > 1 << 20:
                raise _Closed()
            self._fill()
        i = self.buf.index(b"\r\n") + 2
        line, self.buf = self.buf[:i], self.buf[i:]
        return line

    def read_head(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > 1 << 20:
                raise _Closed()
            self._fill()
        i = self.buf.index(b"\r\n\r\n") + 4
        head, self.buf = self.buf[:i], self.buf[i:]
        return head

    def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_until_close(self) -> bytes:
        try:
            while True:
                self._fill()
        except (_Closed, OSError):
            pass
        out, self.buf = self.buf, b""
        return out


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    hdrs: dict[str, str] = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
    return lines[0], hdrs


def _read_body(c: _Conn, hdrs: dict[str, str]) -> bytes:
    """The raw body bytes as on the wire (chunked framing kept)."""
    if "chunked" in hdrs.get("transfer-encoding", "").lower():
        out = []
        while True:
            line = c.readline()
            out.append(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers up to the empty line
                    t = c.readline()
                    out.append(t)
                    if t == b"\r\n":
                        return b"".join(out)
            out.append(c.read_exact(size + 2))
    return c.read_exact(int(hdrs.get("content-length", "0") or 0))


def _rst(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        p_throttle: float = 0.0,
        p_reset_req: float = 0.0,
        p_reset_resp: float = 0.0,
        p_delay: float = 0.0,
        delay_s: float = 0.3,
    ) -> None:
        hostport = upstream.split("://", 1)[-1].rstrip("/")
        host, _, port = hostport.partition(":")
        assert host == "127.0.0.1", "loopback only"
        self.upstream = (host, int(port))
        self.rng = random.Random(seed)
        self.p = {"throttle": p_throttle, "reset_req": p_reset_req, "reset_resp": p_reset_resp, "delay": p_delay}
        self.delay_s = delay_s
        self.only = ""  # when set, faults hit only requests whose request line contains it
        self.mode = "faults"  # or "fail_all", "fail_writes", "reset_all", "clean"
        self.plan: collections.deque[str] = collections.deque()  # forced kinds, used first
        self.counts: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[str, str]] = []  # (kind, request line)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", 0))
        self._lsock.listen(128)
        self._lsock.settimeout(0.2)
        self.port = self._lsock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._socks: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="s3proxy-accept", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control
    def set(self, **kw: Any) -> None:
        with self._lock:
            for k, v in kw.items():
                if k == "mode":
                    self.mode = v
                elif k == "delay_s":
                    self.delay_s = v
                elif k == "only":
                    self.only = v
                else:
                    self.p[k.removeprefix("p_")] = v

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.log.clear()

    def _choose(self, reqline: str) -> str:
        method = reqline.split(" ", 1)[0].upper()
        with self._lock:
            if self.mode == "fail_writes" and method in ("PUT", "POST"):
                kind = "throttle"
            elif self.mode == "fail_writes":
                kind = "pass"
            elif self.mode == "fail_all":
                kind = "throttle"
            elif self.mode == "reset_all":
                kind = "reset_req"
            elif self.mode == "clean" or (self.only and self.only not in reqline):
                kind = "pass"
            elif self.plan:
                kind = self.plan.popleft()
            else:
                x = self.rng.random()
                kind = "pass"
                acc = 0.0
                for k in ("throttle", "reset_req", "reset_resp", "delay"):
                    acc += self.p[k]
                    if x < acc:
                        kind = k
                        break
            self.counts[kind] += 1
            self.counts["requests"] += 1
            self.log.append((kind, reqline))
            return kind

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._lsock.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                cs, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            cs.settimeout(30)
            with self._lock:
                self._socks.add(cs)
            threading.Thread(target=self._serve, args=(cs,), name="s3proxy-conn", daemon=True).start()

    def _serve(self, cs: socket.socket) -> None:
        client = _Conn(cs)
        up: _Conn | None = None
        try:
            while not self._stop.is_set():
                try:
                    head = client.read_head()
                except (_Closed, OSError):
                    return
                reqline, hdrs = _headers(head)
                method = reqline.split(" ", 1)[0].upper()
                kind = self._choose(reqline)
                if kind == "throttle":
                    # answer without reading the body; close so no half-read body is reused
                    cs.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"x-amz-request-id: s4w-fault-proxy\r\nConnection: close\r\n"
                        + f"Content-Length: {len(_SLOWDOWN)}\r\n\r\n".encode()
                        + _SLOWDOWN
                    )
                    try:
                        cs.shutdown(socket.SHUT_WR)
                        cs.settimeout(1)
                        client.read_until_close()
                    except OSError:
                        pass
                    return
                if kind == "reset_req":
                    n = int(hdrs.get("content-length", "0") or 0)
                    if n:
                        try:
                            client.read_exact(min(n, 1 + n // 2))
                        except (_Closed, OSError):
                            pass
                    _rst(cs)
                    return
                body = _read_body(client, hdrs)
                if kind == "delay":
                    time.sleep(self.delay_s)
                if up is None:
                    us = socket.create_connection(self.upstream, timeout=30)
                    with self._lock:
                        self._socks.add(us)
                    up = _Conn(us)
                up.sock.sendall(head + body)
                while True:  # skip (relay) 1xx responses
                    rhead = up.read_head()
                    status_line, rh = _headers(rhead)
                    status = int(status_line.split(" ")[1])
                    if status >= 200 or status == 101:
                        break
                    cs.sendall(rhead)
                if method == "HEAD" or status in (204, 304):
                    rbody, until_close = b"", False
                elif "chunked" in rh.get("transfer-encoding", "").lower() or "content-length" in rh:
                    rbody, until_close = _read_body(up, rh), False
                else:
                    rbody, until_close = up.read_until_close(), True
                if kind == "reset_resp":
                    cs.sendall(rhead + rbody[: len(rbody) // 2])
                    _rst(cs)
                    return
                cs.sendall(rhead + rbody)
                if until_close or "close" in rh.get("connection", "").lower():
                    return
        except (_Closed, OSError, ValueError, IndexError):
            return
        finally:
            for s in (cs, up.sock if up else None):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
                    with self._lock:
                        self._socks.discard(s)
