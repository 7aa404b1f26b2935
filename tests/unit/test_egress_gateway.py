"""The egress gateway (issue 16) on its own: real sockets on loopback, no jail yet.

Every upstream is a server of this test on 127.0.0.1; names resolve through a resolver the
test controls. ``deny_private`` is off where a test must reach its loopback servers, and
on (the default) where the refusal of private addresses is what is tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import ipaddress
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaild.daemon.egress.gateway import MAX_HEAD_BYTES, EgressDoor, EgressQuota, connect, listen_in
from jaild.policy.egress import Address, EgressRules
from tests.conftest import guard
from tests.tls import test_ca

# --------------------------------------------------------------------------- upstreams


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with what it received, as JSON."""

    seen: list[dict[str, Any]]

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        record = {"method": self.command, "path": self.path, "body": body.decode(),
                  "headers": {k.lower(): v for k, v in self.headers.items()}}
        self.seen.append(record)
        out = json.dumps(record).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def http_upstream() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    handler = type("Echo", (_Echo,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def tcp_echo() -> Iterator[int]:
    """A raw TCP echo server (what a TLS server looks like to a tunnel: bytes)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            with sock:
                sock.settimeout(0.2)
                while not stop.is_set():
                    try:
                        data = sock.recv(65536)
                    except TimeoutError:
                        continue
                    if not data:
                        break
                    sock.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


# --------------------------------------------------------------------------- the door


class Door:
    """An EgressDoor serving a loopback listener from its own event-loop thread."""

    def __init__(self, door: EgressDoor, listener: socket.socket | None = None) -> None:
        self.door = door
        self.listener = listener or socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Door:
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result()
        return self

    async def _serve(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.door.serve(self.listener))

    async def _stop(self) -> None:
        self.task.cancel()  # and its connections, each closing its upstream
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(guard(30))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
        self.listener.close()

    def raw(self, data: bytes, timeout: float = 10) -> bytes:
        """Send ``data`` to the door, read until it closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=guard(timeout)) as s:
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out


def fixed_resolver(answers: dict[str, list[str]], asked: list[str] | None = None) -> Any:
    async def resolve(host: str, port: int) -> list[Address]:
        if asked is not None:
            asked.append(host)
        if host not in answers:
            raise OSError(f"no such name: {host}")
        return [ipaddress.ip_address(a) for a in answers[host]]

    return resolve


def door(allow: list[str], deny_private: bool = False, **kwargs: Any) -> EgressDoor:
    quota = kwargs.pop("quota", EgressQuota())
    return EgressDoor(EgressRules.parse(allow, deny_private=deny_private), quota, "web",
                      **kwargs)


def urlopen(proxy: str, url: str) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy,
                                                                      "https": proxy}))
    try:
        with opener.open(url, timeout=guard(10)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# --------------------------------------------------------------------------- allowed


def test_an_allowed_host_is_reached_with_urllib_and_httpx() -> None:
    observed: list[dict[str, Any]] = []
    with http_upstream() as (port, seen), Door(door(
        [f"api.test:{port}"], resolver=fixed_resolver({"api.test": ["127.0.0.1"]}),
        observe=observed.append,
    )) as d:
        status, body = urlopen(d.url, f"http://api.test:{port}/v1/x?q=1")
        assert status == 200 and json.loads(body)["path"] == "/v1/x?q=1"
        with httpx.Client(proxy=d.url, timeout=guard(10)) as client:
            r = client.post(f"http://api.test:{port}/post", content=b"hello",
                            headers={"Proxy-Authorization": "Basic c2VjcmV0"})
        assert r.status_code == 200 and r.json()["body"] == "hello"
    assert [s["method"] for s in seen] == ["GET", "POST"]
    # hop-by-hop and proxy headers stop at the gateway; the Host is the target's
    assert "proxy-authorization" not in seen[1]["headers"]
    assert seen[1]["headers"]["host"] == f"api.test:{port}"
    usage = d.door.usage
    assert usage.requests == 2 and usage.hosts == {"api.test"}
    assert usage.bytes_out > 0 and usage.bytes_in > 0
    assert [(o["host"], o["method"], o["status"]) for o in observed] == [
        ("api.test", "GET", 200), ("api.test", "POST", 200)]
    assert all("headers" not in o for o in observed)  # never a header value in the audit


def test_connect_tunnels_bytes_untouched() -> None:
    with tcp_echo() as port, Door(door([f"127.0.0.1:{port}"])) as d, \
            socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as s:
        s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
                  + b"\x16\x03\x01early")  # a TLS hello may follow the head at once
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        head, _, rest = head.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        s.sendall(b"\x00\xffbinary")
        got = rest
        while len(got) < len(b"\x16\x03\x01early\x00\xffbinary"):
            got += s.recv(4096)
        assert got == b"\x16\x03\x01early\x00\xffbinary"


# --------------------------------------------------------------------------- refused


def test_a_denied_host_gets_a_reason_a_model_can_act_on() -> None:
    asked: list[str] = []
    with Door(door(["api.test"], resolver=fixed_resolver({}, asked))) as d:
        status, body = urlopen(d.url, "http://evil.test/steal")
        assert status == 403
        assert body.decode() == (
            "egress to evil.test:80 is not allowed by policy 'web': evil.test is not on the "
            "allow-list; allowed: api.test\n")
        reply = d.raw(b"CONNECT api.test:22 HTTP/1.1\r\nHost: api.test\r\n\r\n")
        # the reason is the status line's too: clients drop a refused CONNECT's body
        status_line = reply.split(b"\r\n", 1)[0]
        assert status_line == (b"HTTP/1.1 403 egress to api.test:22 is not allowed by policy "
                               b"'web': port 22 of api.test is not allowed (its ports: 80, 443);"
                               b" allowed: api.test"), status_line
    assert asked == []  # refused before any name was resolved
    assert d.door.usage.refused == {"not_allowed": 2}


def test_private_addresses_are_refused_after_resolution() -> None:
    with tcp_echo() as port, Door(door(
        [f"internal.test:{port}", f"127.0.0.1:{port}"], deny_private=True,
        resolver=fixed_resolver({"internal.test": ["10.0.0.8", "127.0.0.1"]}),
    )) as d:
        reply = d.raw(f"CONNECT internal.test:{port} HTTP/1.1\r\nHost: internal.test\r\n\r\n".encode())
        assert reply.startswith(b"HTTP/1.1 403"), reply
        assert b"10.0.0.8 is a private address; 127.0.0.1 is a loopback address" in reply
        # an allowed literal is still a private address
        reply = d.raw(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert reply.startswith(b"HTTP/1.1 403") and b"loopback" in reply
    # positive control: the same door without deny_private reaches the echo server
    with tcp_echo() as port, Door(door(
        [f"internal.test:{port}"], resolver=fixed_resolver({"internal.test": ["127.0.0.1"]}),
    )) as d, socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as s:
        s.sendall(f"CONNECT internal.test:{port} HTTP/1.1\r\nHost: internal.test\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_rebinding_name_is_dialled_at_the_address_that_was_checked() -> None:
    """The name answers a public address, then a private one: the gateway asks once and
    dials the address it checked."""
    answers = iter([["93.184.216.34"], ["127.0.0.1"]])
    asked: list[str] = []
    dialled: list[str] = []

    async def rebinding(host: str, port: int) -> list[Address]:
        asked.append(host)
        return [ipaddress.ip_address(a) for a in next(answers)]

    with tcp_echo() as echo_port:
        async def dial(address: Address, port: int, timeout_s: float) -> Any:
            dialled.append(str(address))
            return await connect(ipaddress.ip_address("127.0.0.1"), echo_port, timeout_s)

        with Door(door(["rebind.test"], deny_private=True, resolver=rebinding,
                       connector=dial)) as d, \
                socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as s:
            s.sendall(b"CONNECT rebind.test:443 HTTP/1.1\r\nHost: rebind.test\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
    assert asked == ["rebind.test"] and dialled == ["93.184.216.34"]


def test_request_and_byte_quotas() -> None:
    with http_upstream() as (port, seen), Door(door(
        [f"127.0.0.1:{port}"], quota=EgressQuota(max_requests=2, max_bytes=1 << 20)
    )) as d:
        for _ in range(2):
            assert urlopen(d.url, f"http://127.0.0.1:{port}/")[0] == 200
        status, body = urlopen(d.url, f"http://127.0.0.1:{port}/")
        assert status == 403 and b"2 requests per job (policy 'web', egress.max_requests)" in body
    assert len(seen) == 2
    with tcp_echo() as port, Door(door(
        [f"127.0.0.1:{port}"], quota=EgressQuota(max_requests=10, max_bytes=10_000)
    )) as d, socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as s:
        s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        received = 0
        with pytest.raises(OSError):  # BrokenPipe/ConnectionReset once it is cut
            for _ in range(100):
                s.sendall(b"x" * 1000)
                received += len(s.recv(65536) or b"")
                if not received:
                    break
        assert d.door.usage.bytes <= 10_000 + 65536
        assert d.door.usage.refused["quota"] == 1


# --------------------------------------------------------------------------- hostile


def test_a_smuggled_second_request_is_never_read() -> None:
    asked: list[str] = []
    with http_upstream() as (port, seen), Door(door(
        [f"ok.test:{port}"], resolver=fixed_resolver({"ok.test": ["127.0.0.1"]}, asked)
    )) as d:
        smuggle = (f"POST http://ok.test:{port}/a HTTP/1.1\r\nHost: ok.test\r\n"
                   "Content-Length: 4\r\n\r\nbody"
                   f"GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n").encode()
        reply = d.raw(smuggle)
        assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1") == 1
        # both framings at once: refused, nothing forwarded
        both = (f"POST http://ok.test:{port}/b HTTP/1.1\r\nHost: ok.test\r\n"
                "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode()
        reply = d.raw(both)
    assert reply.startswith(b"HTTP/1.1 400") and b"both Content-Length and" in reply
    assert [s["path"] for s in seen] == ["/a"]
    assert "evil.test" not in asked


def test_odd_requests_are_refused_plainly() -> None:
    with Door(door(["api.test"])) as d:
        assert d.raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert d.raw(b"GET https://api.test/ HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
            b"HTTP/1.1 400")
        assert d.raw(b"CONNECT api.test HTTP/1.1\r\nHost: api.test\r\n\r\n").startswith(b"HTTP/1.1 400")
        for split in (False, True):  # arriving whole, or still unfinished past the limit
            long_head = (b"GET http://api.test/ HTTP/1.1\r\nHost: api.test\r\nX: "
                         + b"a" * (2 * MAX_HEAD_BYTES) + (b"" if split else b"\r\n\r\n"))
            reply = d.raw(long_head)
            assert reply.startswith(b"HTTP/1.1 431"), reply[:80]
        assert d.raw(b"\x16\x03\x01 not http at all\r\n\r\n").startswith(b"HTTP/1.1 400")


def test_a_slow_client_is_cut_and_holds_up_no_one() -> None:
    with http_upstream() as (port, _), Door(door(
        [f"127.0.0.1:{port}"], head_timeout_s=2.0
    )) as d, socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as slow:
        slow.sendall(b"GET http://127.0.0.1/ HTTP/1.1\r\n")  # and never the rest
        assert urlopen(d.url, f"http://127.0.0.1:{port}/")[0] == 200  # served meanwhile
        reply = b""
        while chunk := slow.recv(4096):
            reply += chunk
        assert reply == b"" or reply.startswith(b"HTTP/1.1 408")
    assert d.door.usage.refused["slow_request"] == 1


# --------------------------------------------------------------------------- the namespace

JAIL = """
import socket, sys, urllib.request
from jaild.runtime.zygote import _loopback_up
_loopback_up()
print("ready", flush=True)
proxy, upstream = sys.stdin.readline().split()
try:
    socket.create_connection(("127.0.0.1", int(upstream)), timeout=5).close()
    print("direct: connected")
except OSError as exc:
    print("direct:", type(exc).__name__)
opener = urllib.request.build_opener(urllib.request.ProxyHandler(
    {"http": f"http://127.0.0.1:{proxy}"}))
with opener.open(f"http://127.0.0.1:{upstream}/from-the-jail", timeout=10) as r:
    print("proxy:", r.status)
"""


def test_a_listener_made_in_the_jails_namespace_is_its_only_way_out() -> None:
    """A process in a fresh network namespace (only loopback, as a jail's) cannot reach the
    host's loopback server; through a listener the daemon made in its namespace, the
    gateway reaches it for the process. Positive control: the host reaches it directly."""
    with http_upstream() as (up_port, seen):
        jail = subprocess.Popen(
            ["unshare", "--net", sys.executable, "-c", JAIL],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert jail.stdout is not None and jail.stdin is not None
            assert jail.stdout.readline().strip() == "ready"
            listener = listen_in(f"/proc/{jail.pid}/ns/net", 3128)
            with Door(door([f"127.0.0.1:{up_port}"]), listener=listener):
                jail.stdin.write(f"3128 {up_port}\n")
                jail.stdin.flush()
                out, _ = jail.communicate(timeout=guard(30))
        finally:
            jail.kill()
            jail.wait()
        assert "direct: ConnectionRefusedError" in out, out
        assert "proxy: 200" in out, out
        assert [s["path"] for s in seen] == ["/from-the-jail"]
        socket.create_connection(("127.0.0.1", up_port), timeout=guard(10)).close()


# --------------------------------------------------------------------------- TLS, untouched


def test_tls_goes_through_untouched_and_the_client_checks_the_chain(tmp_path: Any) -> None:
    """HTTPS through CONNECT: the gateway never sees inside. With the CA that signed the
    server's certificate the client gets its answer; with the default trust store it
    refuses the same server -- the chain is checked end to end, by the client."""
    import ssl

    ca, cert, key = test_ca(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    seen: list[dict[str, Any]] = []
    handler = type("Echo", (_Echo,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        summaries: list[dict[str, Any]] = []
        with Door(door([f"tls.test:{port}"], observe=summaries.append,
                       resolver=fixed_resolver({"tls.test": ["127.0.0.1"]}))) as d:
            trusting = ssl.create_default_context(cafile=ca)
            with httpx.Client(proxy=d.url, verify=trusting, timeout=guard(10)) as client:
                r = client.get(f"https://tls.test:{port}/secret-path")
            assert r.status_code == 200 and r.json()["path"] == "/secret-path"
            with httpx.Client(proxy=d.url, timeout=guard(10)) as client, \
                    pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                client.get(f"https://tls.test:{port}/")
        observed = d.door.usage
        assert observed.requests == 2 and observed.hosts == {"tls.test"}
        assert [x["method"] for x in summaries] == ["CONNECT", "CONNECT"]
        assert "secret" not in repr(summaries)  # what travels inside TLS stays inside
    finally:
        server.shutdown()
        server.server_close()
    assert [s["path"] for s in seen] == ["/secret-path"]


def test_a_job_holds_at_most_max_connections_of_the_daemon() -> None:
    """Connections past the door's cap wait in the kernel's backlog, not in the daemon: the
    cap is never passed, and a waiting request is served once a slot frees."""
    with http_upstream() as (port, _), Door(door(
        [f"127.0.0.1:{port}"], max_connections=2
    )) as d:
        held = [socket.create_connection(("127.0.0.1", d.port), timeout=guard(10))
                for _ in range(2)]
        for s in held:
            s.sendall(b"GET http://127.0.0.1/ HTTP/1.1\r\n")  # unfinished: each holds a slot
        waiting = socket.create_connection(("127.0.0.1", d.port), timeout=guard(30))
        waiting.sendall(f"GET http://127.0.0.1:{port}/late HTTP/1.1\r\n"
                        f"Host: 127.0.0.1\r\n\r\n".encode())
        held[0].close()  # a slot frees: the waiting request is accepted and served
        reply = b""
        while chunk := waiting.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:80]
        waiting.close()
        held[1].close()
    assert d.door.peak_connections == 2


# --------------------------------------------------------------------------- injection


class _Quiet(_Echo):
    """Records every header it gets, answers with the path only (echoing headers back
    would hand the jail the credential: docs/using/egress.md's threat model says so)."""

    def _answer(self) -> None:
        self.seen.append({"path": self.path,
                          "headers": {k.lower(): v for k, v in self.headers.items()}})
        out = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer


@contextmanager
def https_upstream(tmp: Any) -> Iterator[tuple[int, list[dict[str, Any]], str]]:
    import ssl

    ca, cert, key = test_ca(tmp)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    seen: list[dict[str, Any]] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             type("Quiet", (_Quiet,), {"seen": seen}))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen, ca
    finally:
        server.shutdown()
        server.server_close()


def test_a_credential_is_added_on_the_host_side_and_never_reaches_the_jail(
    tmp_path: Any,
) -> None:
    import ssl

    from jaild.daemon.egress.ca import EgressCA

    interception = EgressCA(tmp_path / "egress-ca")
    assert (interception.directory.stat().st_mode & 0o777) == 0o700
    assert ((interception.directory / "ca.key").stat().st_mode & 0o777) == 0o600
    (tmp_path / "upstream").mkdir()
    summaries: list[dict[str, Any]] = []
    with https_upstream(tmp_path / "upstream") as (port, seen, upstream_ca), Door(door(
        [f"tls.test:{port}"], observe=summaries.append,
        resolver=fixed_resolver({"tls.test": ["127.0.0.1"]}),
        injections={"tls.test": [("Authorization", "Bearer s3cret")]}, ca=interception,
        upstream_tls=ssl.create_default_context(cafile=upstream_ca),
    )) as d:
        jail_trust = ssl.create_default_context(cafile=str(interception.certificate_path))
        with httpx.Client(proxy=d.url, verify=jail_trust, timeout=guard(10)) as client:
            r = client.get(f"https://tls.test:{port}/repos",
                           headers={"Authorization": "Bearer made-up-in-the-jail"})
            assert r.status_code == 200 and r.json() == {"path": "/repos"}
            assert "s3cret" not in r.text and "s3cret" not in repr(r.headers)
            # a request for another name through this host's tunnel: refused, not sent
            r = client.get(f"https://tls.test:{port}/x", headers={"Host": "other.test"})
            assert r.status_code == 421 and "this tunnel is for tls.test" in r.text
        # a client that does not trust the interception CA refuses it: no silent bypass
        with httpx.Client(proxy=d.url, timeout=guard(10)) as client, \
                pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            client.get(f"https://tls.test:{port}/")
    assert [(s["path"], s["headers"]["authorization"]) for s in seen] == [
        ("/repos", "Bearer s3cret")]  # the jail's own value replaced, the other never sent
    assert "s3cret" not in repr(summaries) and any(x.get("intercepted") for x in summaries)
    assert d.door.usage.refused["misdirected"] == 1


def test_the_interception_ca_is_made_once_and_is_needed(tmp_path: Any) -> None:
    from jaild.daemon.egress.ca import EgressCA

    first = EgressCA(tmp_path / "ca")
    assert EgressCA(tmp_path / "ca").certificate_pem == first.certificate_pem
    assert first.server_context("a.test") is first.server_context("a.test")  # cached
    with pytest.raises(ValueError, match="needs the interception CA"):
        door(["a.test"], injections={"a.test": [("X-Key", "v")]})


_HEAD_PARTS = st.sampled_from([
    b"GET ", b"CONNECT ", b"POST ", b"http://api.test/", b"https://x/", b"api.test:443",
    b"[::1]:80", b" HTTP/1.1", b" HTTP/1.0", b" HTTP/9", b"\r\n", b"Host: api.test",
    b"Content-Length: 3", b"Content-Length: -1", b"Transfer-Encoding: chunked", b": ",
    b"\x00", b"\xff\xfe", b"0\r\n\r\n", b"abc", b"\r\n\r\n",
])


@settings(max_examples=60, deadline=None)
@given(st.lists(_HEAD_PARTS, max_size=12).map(b"".join))
def test_any_bytes_get_an_answer_or_a_close_and_the_door_keeps_serving(data: bytes) -> None:
    """Hostile input: whatever arrives, the door answers it (or closes), reaches nothing it
    was not allowed to, and still serves the next client."""
    dialled: list[str] = []

    async def dial(address: Address, port: int, timeout_s: float) -> Any:
        dialled.append(f"{address}:{port}")
        raise OSError("the test dials nothing")

    with Door(door(["api.test"], resolver=fixed_resolver({"api.test": ["127.0.0.1"]}),
                   connector=dial, head_timeout_s=2.0)) as d:
        with socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply == b"" or reply.startswith(b"HTTP/1.1 "), reply[:80]
        assert all(x.endswith((":80", ":443")) for x in dialled)  # only what is allowed
        reply = d.raw(b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 403")  # still serving, still refusing


def test_a_reason_phrase_is_one_line_of_printable_ascii() -> None:
    from jaild.daemon.egress.gateway import MAX_REASON_CHARS, _reason_phrase

    assert _reason_phrase("a\r\nb\x00c\u00e9d") == b"a??b?c?d"
    assert len(_reason_phrase("x" * 5000)) == MAX_REASON_CHARS


# --------------------------------------------------------------------------- labels


class _Held(http.server.BaseHTTPRequestHandler):
    """Answers once the test opens ``gate``; tells it (``received``) the request is in."""

    received: threading.Event
    gate: threading.Event

    def do_GET(self) -> None:
        self.received.set()
        self.gate.wait(guard(10))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_label_cuts_what_can_still_send_and_leaves_a_sent_request_its_answer() -> None:
    """A label arriving while a plain request waits for its answer cuts nothing: the request
    is all sent, and that connection carries nothing more of the jail's (one request a
    connection) -- so its answer comes in and nothing is recorded as cut (before, it raced:
    the connection was still tracked until the answer had been written). The control: a
    tunnel open at that moment is cut, and recorded."""
    from jaild.policy.flow import compile_flow, parse_sink

    received, gate = threading.Event(), threading.Event()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Held", (_Held,), {"received": received, "gate": gate}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    labels: set[str] = set()
    refused: list[tuple[str, ...]] = []
    rules = compile_flow("web", (), (parse_sink({"label": "private", "egress": []}),),
                         ("untrusted",), (), "refuse")
    try:
        with tcp_echo() as echo, Door(door(
                [f"127.0.0.1:{port}", f"127.0.0.1:{echo}"], flow=rules,
                labels=lambda: frozenset(labels),
                on_flow_refused=lambda *a: refused.append(a))) as d:
            answer: list[tuple[int, bytes]] = []
            client = threading.Thread(
                target=lambda: answer.append(urlopen(d.url, f"http://127.0.0.1:{port}/x")))
            client.start()
            with socket.create_connection(("127.0.0.1", d.port), timeout=guard(10)) as tunnel:
                tunnel.sendall(f"CONNECT 127.0.0.1:{echo} HTTP/1.1\r\n"
                               f"Host: 127.0.0.1:{echo}\r\n\r\n".encode())
                assert tunnel.recv(4096).startswith(b"HTTP/1.1 200")
                assert received.wait(guard(10))  # the request is in: the answer waits
                labels.add("private")
                d.loop.call_soon_threadsafe(d.door.recheck)
                assert tunnel.recv(4096) == b""  # the tunnel is cut (the control)
                gate.set()
                client.join(guard(10))
            assert answer == [(200, b"ok")]
            assert [(r[0], r[3]) for r in refused] == [("egress", "flow_cut")]
            assert refused[0][2] == f"127.0.0.1:{echo}"
    finally:
        gate.set()
        server.shutdown()
        server.server_close()
