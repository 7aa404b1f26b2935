"""network.mode = "egress": real jails of a real daemon reach servers on this machine's
loopback through the daemon's gateway, by name, and nothing else.

Every server here is on the host's 127.0.0.1, so the policies allow it explicitly and most
set ``deny_private = false`` (``deny_private`` would refuse loopback: one test shows it
does). The jails have their own network namespaces: the host's 127.0.0.1 is not theirs,
and the only way to it is the gateway.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import secrets
import socket
import ssl
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jaild.client import Client
from tests.conftest import (
    DaemonHandle,
    guard,
    run_unjailed,
    start_daemon,
    sweep_cgroups,
    until,
)
from tests.tls import test_ca

pytestmark = pytest.mark.integration

BIG = 256 * 1024
PROBE_WHEEL = "jaildprobe-1.0-py3-none-any.whl"


def _wheel() -> bytes:
    """A pure-Python wheel of one module, ``jaildprobe`` (VALUE = 42)."""
    files = {
        "jaildprobe/__init__.py": b"VALUE = 42\n",
        "jaildprobe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: jaildprobe\n"
                                             b"Version: 1.0\n",
        "jaildprobe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: jaild-tests\n"
                                          b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}\n"
        for name, data in files.items()
    ) + "jaildprobe-1.0.dist-info/RECORD,,\n"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("jaildprobe-1.0.dist-info/RECORD", record)
    return out.getvalue()


def _b64(digest: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class _Server(http.server.BaseHTTPRequestHandler):
    """Answers with the method and path it got -- never the request's headers (those it
    keeps in ``seen`` for the test: a server that echoed them would show a jail the
    credential the gateway added, as docs/using/egress.md's threat model says). ``/big`` answers
    :data:`BIG` bytes; ``/simple/jaildprobe/`` and the wheel make a package index."""

    seen: list[dict[str, Any]]
    wheel: bytes

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append({"method": self.command, "path": self.path, "body": body.decode(),
                          "headers": {k.lower(): v for k, v in self.headers.items()}})
        kind = "application/json"
        if self.path == "/big":
            out = b"x" * BIG
        elif self.path.startswith("/simple/jaildprobe"):
            digest = hashlib.sha256(self.wheel).hexdigest()
            out = (f'<a href="/files/{PROBE_WHEEL}#sha256={digest}">{PROBE_WHEEL}</a>').encode()
            kind = "text/html"
        elif self.path == f"/files/{PROBE_WHEEL}":
            out, kind = self.wheel, "application/octet-stream"
        else:
            out = json.dumps({"method": self.command, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Servers:
    plain: int  # HTTP on 127.0.0.1
    tls: int  # HTTPS on 127.0.0.1, a certificate for localhost and 127.0.0.1 (test CA)
    ca: str  # the test CA's certificate (PEM file)
    seen: list[dict[str, Any]]
    token: str  # the credential the gateway adds for localhost


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("egress-servers")
    ca, cert, key = test_ca(tmp, names=("localhost",), ips=("127.0.0.1",))
    seen: list[dict[str, Any]] = []
    handler = type("Server", (_Server,), {"seen": seen, "wheel": _wheel()})
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    tls = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tls.socket = context.wrap_socket(tls.socket, server_side=True)
    for server in (plain, tls):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield Servers(plain.server_address[1], tls.server_address[1], ca, seen,
                      "tok-" + secrets.token_hex(16))
    finally:
        for server in (plain, tls):
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def gateway(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A daemon with three egress policies and a ``none`` one, the token in a 0600 secrets
    file, and the test CA as the gateway's trust for the hosts it intercepts."""
    d = tmp_path_factory.mktemp("egress-daemon")
    p, t = servers.plain, servers.tls
    secrets_file = d / "secrets"
    secrets_file.write_text(f"# the gateway's credentials\nJAILD_TEST_TOKEN={servers.token}\n")
    secrets_file.chmod(0o600)
    config = d / "jaild.toml"
    config.write_text(f'[daemon]\negress_secrets = "{secrets_file}"\n'
                      f'egress_upstream_ca = "{servers.ca}"\n')
    # wall and CPU time far above what any job here needs (pip under TCG takes a while):
    # no limit is under test in this module
    common = ('[network]\nmode = "egress"\n[python]\nenv = "web"\n'
              "[limits]\nwall_time_s = 900\ncpu_time_s = 900\n")
    policies = {
        "web": common + f"""[egress]
allow = ["127.0.0.1:{p}", "localhost:{p}", "127.0.0.1:{t}", "localhost:{t}"]
deny_private = false
max_requests = 100
[[egress.inject]]
host = "localhost"
header = "X-Test-Token"
value_env = "JAILD_TEST_TOKEN"
""",
        "web-spawn": common + f"""[egress]
allow = ["127.0.0.1:{p}"]
deny_private = false
[pool]
mode = "spawn"
""",
        "private": common + f'[egress]\nallow = ["localhost:{p}"]\ndeny_private = true\n',
        "quota": common + f"""[egress]
allow = ["127.0.0.1:{p}"]
deny_private = false
max_requests = 2
max_bytes = 65536
""",
        "nonet": '[network]\nmode = "none"\n[seccomp]\naction = "errno"\n',
    }
    handle = start_daemon(d, policies, with_repo_policies=False, args=("--config", str(config)))
    try:
        yield handle
    finally:
        code = handle.stop()
        sweep_cgroups(handle)
        assert code == 0, handle.log()[-4000:]


def run(gateway: DaemonHandle, code: str, policy: str = "web", **kwargs: Any) -> Any:
    r = gateway.run(code, policy, **kwargs)
    assert r.status == "ok", (r.status, r.error, r.stdout, r.stderr)
    return r


@pytest.mark.parametrize("policy", ["web", "web-spawn"])
def test_an_allowed_host_is_reached_with_urllib_requests_and_httpx(
    gateway: DaemonHandle, servers: Servers, policy: str
) -> None:
    """The jail's code is plain client code: the proxy comes from the environment. A
    zygote's jail and a spawned nsjail's get their doors alike."""
    url = f"http://127.0.0.1:{servers.plain}"
    r = run(gateway, f"""
import urllib.request, requests, httpx
a = urllib.request.urlopen("{url}/urllib").read()
b = requests.get("{url}/requests").content
c = httpx.get("{url}/httpx").content
[a, b, c]
""", policy)
    assert [json.loads(x)["path"] for x in r.result] == ["/urllib", "/requests", "/httpx"]
    egress = r.record.egress
    assert egress is not None and egress.requests == 3 and egress.hosts == ("127.0.0.1",)
    assert egress.bytes_out > 0 and egress.bytes_in > 0 and egress.refused == {}
    assert r.record.limits["network"] == "egress"


def test_a_denied_host_is_refused_with_a_reason_and_audited(
    gateway: DaemonHandle, servers: Servers
) -> None:
    r = run(gateway, """
import urllib.request, urllib.error, requests
out = []
try:
    urllib.request.urlopen("http://example.com/")
except urllib.error.HTTPError as e:
    out.append((e.code, e.read().decode()))
try:
    requests.get("https://example.com/", timeout=30)
except requests.exceptions.ProxyError as e:
    out.append((403, str(e)))
try:
    urllib.request.urlopen("http://127.0.0.1:1/")
except urllib.error.HTTPError as e:
    out.append((e.code, e.read().decode()))
out
""")
    (s1, why), (_, tunnel), (s3, port) = r.result
    assert s1 == 403 and why.startswith("egress to example.com:80 is not allowed by policy 'web': "
                                        "example.com is not on the allow-list; allowed: ")
    assert f"127.0.0.1:{servers.plain}" in why
    # the reason reaches the code even where the client drops a refused CONNECT's body
    assert "403 egress to example.com:443 is not allowed by policy 'web'" in tunnel, tunnel
    assert s3 == 403 and "is not allowed (its ports: " in port
    assert r.record.egress.refused == {"not_allowed": 3} and r.record.egress.hosts == ()
    lines = [line for line in gateway.log().splitlines()
             if "event=egress" in line and r.job_id in line]
    assert len(lines) == 3 and all("refused=not_allowed" in line for line in lines), lines
    assert "host=example.com" in lines[0] and "method=GET" in lines[0]


def test_the_jail_has_no_other_way_out(gateway: DaemonHandle, servers: Servers) -> None:
    """Sockets of its own reach nothing: the host's loopback server is not on the jail's
    loopback, other addresses have no route, raw sockets need a capability it lacks. The
    same probe run on the host reaches the server (the positive control); so does the jail,
    through the gateway (the first test)."""
    probe = f"""
import errno, socket
def attempt(make, address):
    try:
        s = make()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
    s.settimeout(5)
    try:
        s.connect(address)
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
    finally:
        s.close()
def raw():
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        return "made"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
out = [attempt(socket.socket, ("127.0.0.1", {servers.plain})),
       attempt(socket.socket, ("192.0.2.1", 80)),
       raw()]
print(out)
out
"""
    r = run(gateway, probe)
    assert r.result == ["ECONNREFUSED", "ENETUNREACH", "EPERM"], r.result
    host = run_unjailed(probe)
    assert host.returncode == 0 and "['connected'" in host.stdout, host.stdout + host.stderr
    nonet = gateway.run(probe, "nonet")  # mode "none": AF_INET itself is refused (EACCES)
    assert nonet.status == "ok" and nonet.result == ["EACCES"] * 3, nonet.result
    assert nonet.network_refused == 3


def test_a_name_that_resolves_to_a_private_address_is_refused(
    gateway: DaemonHandle, servers: Servers
) -> None:
    """``localhost`` is on the allow-list, and the host resolves it to loopback:
    ``deny_private`` refuses it after resolution. The same request under a policy without
    ``deny_private`` is the control."""
    code = f"""
import urllib.request, urllib.error
try:
    out = (200, urllib.request.urlopen("http://localhost:{servers.plain}/named").read().decode())
except urllib.error.HTTPError as e:
    out = (e.code, e.read().decode())
out
"""
    status, why = run(gateway, code, "private").result
    assert status == 403 and "127.0.0.1 is a loopback address" in why, why
    assert "(egress.deny_private)" in why
    control = run(gateway, code, "web").result
    assert control[0] == 200 and json.loads(control[1])["path"] == "/named"


def test_request_and_byte_quotas_are_kept_per_job_and_recorded(
    gateway: DaemonHandle, servers: Servers
) -> None:
    url = f"http://127.0.0.1:{servers.plain}"
    code = f"""
import urllib.request, urllib.error
out = []
for path in ("/1", "/2", "/3"):
    try:
        out.append(urllib.request.urlopen("{url}" + path).status)
    except urllib.error.HTTPError as e:
        out.append((e.code, e.read().decode()))
out
"""
    r = run(gateway, code, "quota")
    assert r.result[:2] == [200, 200] and r.result[2][0] == 403
    assert "egress quota reached: 2 requests per job (policy 'quota', egress.max_requests)" in (
        r.result[2][1])
    assert (r.record.egress.requests, r.record.egress.refused) == (2, {"quota": 1})
    again = run(gateway, code, "quota")  # the next job has its own quota
    assert again.result[:2] == [200, 200]

    big = run(gateway, f"""
import urllib.request
try:
    n = len(urllib.request.urlopen("{url}/big").read())
except Exception as e:
    n = type(e).__name__
n
""", "quota")
    assert big.result != BIG, "a 256 KiB answer went through a 64 KiB quota"
    assert big.record.egress.refused == {"quota": 1}
    assert big.record.egress.bytes_in <= 65536 + 65536  # cut at the chunk that crossed it


def test_tls_is_tunnelled_untouched_and_checked_by_the_jail(
    gateway: DaemonHandle, servers: Servers
) -> None:
    """127.0.0.1 has no injection: CONNECT, then the jail's TLS to the server itself. With
    the server's CA (uploaded) the jail gets its answer; with its default trust (the host's
    CAs and jaild's) it refuses the server: the chain is checked in the jail, end to end."""
    url = f"https://127.0.0.1:{servers.tls}/tunnelled"
    r = run(gateway, f"""
import ssl, urllib.request
ok = urllib.request.urlopen("{url}", context=ssl.create_default_context(cafile="ca.pem")).read()
try:
    urllib.request.urlopen("{url}")
    default = "trusted"
except Exception as e:
    default = str(e)
[ok, default]
""", files={"ca.pem": Path(servers.ca).read_bytes()})
    ok, default = r.result
    assert json.loads(ok)["path"] == "/tunnelled" and "CERTIFICATE_VERIFY_FAILED" in default
    seen = [s for s in servers.seen if s["path"] == "/tunnelled"]
    assert len(seen) == 1 and "x-test-token" not in seen[0]["headers"]
    lines = [line for line in gateway.log().splitlines()
             if "event=egress" in line and r.job_id in line]
    assert lines and all("method=CONNECT" in line and "tunnelled" not in line for line in lines)


def test_an_injected_credential_reaches_the_host_and_never_the_jail(
    gateway: DaemonHandle, servers: Servers
) -> None:
    """For localhost the gateway ends the jail's TLS with a certificate of its CA (which
    the jail trusts: requests through REQUESTS_CA_BUNDLE, httpx through certifi), adds the
    header, and goes on over its own TLS (checked against daemon.egress_upstream_ca). The
    jail looks for the token everywhere it can: its environment, every file it can read
    under /opt/jaild, /tmp and /proc/self, and what the server answered."""
    base = f"https://localhost:{servers.tls}"
    r = run(gateway, f"""
import os, re, requests, httpx
answers = [requests.get("{base}/injected-requests").text,
           httpx.get("{base}/injected-httpx").text]
texts = [repr(dict(os.environ))] + answers
for top in ("/opt/jaild", "/tmp", "/proc/self"):
    for root, dirs, files in os.walk(top):
        if root.startswith("/proc/self/task") or root.count("/") > 6:
            dirs[:] = []
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    texts.append(f.read(1 << 20).decode("latin-1"))
            except OSError:
                pass
everything = "\\n".join(texts)
# the token is tok-<32 hex>; the jail cannot know it, so it returns every such string
[answers, len(texts), re.findall(r"tok-[0-9a-f]{{32}}", everything),
 "JAILD_TEST_TOKEN" in everything]
""")
    answers, files_read, tokens, named = r.result
    assert [json.loads(a)["path"] for a in answers] == ["/injected-requests", "/injected-httpx"]
    assert files_read > 20
    assert servers.token not in tokens and not named
    got = [s["headers"].get("x-test-token") for s in servers.seen
           if s["path"].startswith("/injected-")]
    assert got == [servers.token, servers.token]
    assert servers.token not in gateway.log()
    assert r.record.egress.hosts == ("localhost",) and r.record.egress.refused == {}


def test_pip_installs_from_a_local_index_in_a_session(
    gateway: DaemonHandle, servers: Servers
) -> None:
    """pip finds the proxy (plain HTTP to a local index) and the wheel; the next run of the
    session imports what it installed; each run's egress is its own."""
    index = f"http://127.0.0.1:{servers.plain}/simple/"
    with Client(gateway.socket) as client, client.session("web") as s:
        first = s.run(f"""
import subprocess, sys
p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir",
                    "--disable-pip-version-check", "--index-url", "{index}",
                    "--trusted-host", "127.0.0.1", "--target", "/tmp/site", "jaildprobe"],
                   capture_output=True, text=True, timeout={guard(120)})
(p.returncode, p.stdout[-2000:], p.stderr[-2000:])
""")
        assert first.status == "ok" and first.result[0] == 0, (first.result, first.error)
        assert first.record.egress.requests >= 2  # the index page and the wheel
        second = s.run("import sys; sys.path.insert(0, '/tmp/site'); import jaildprobe; "
                       "jaildprobe.VALUE")
        assert (second.status, second.result) == ("ok", 42)
        assert second.record.egress.requests == 0  # per run
    assert [x["path"] for x in servers.seen if "jaildprobe" in x["path"]][-1].startswith(
        "/files/")


HOSTILE = r"""
import socket
def ask(raw, read=4096):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    try:
        s.sendall(raw)
    except OSError as e:  # the gateway may answer (and close) before it read everything
        pass
    data = b""
    try:
        while len(data) < read:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        data += b"<timeout>"
    s.close()
    return data.decode("latin-1")
"""


def test_hostile_requests_get_plain_answers(gateway: DaemonHandle, servers: Servers) -> None:
    p = servers.plain
    r = run(gateway, HOSTILE + f"""
out = {{}}
out["port"] = ask(b"CONNECT 127.0.0.1:22 HTTP/1.1\\r\\nHost: 127.0.0.1:22\\r\\n\\r\\n")
out["absolute"] = ask(b"GET http://metadata.google.internal/ HTTP/1.1\\r\\n"
                      b"Host: metadata.google.internal\\r\\n\\r\\n")
out["smuggle"] = ask(b"POST http://127.0.0.1:{p}/a HTTP/1.1\\r\\nHost: 127.0.0.1:{p}\\r\\n"
                     b"Content-Length: 4\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n"
                     b"0\\r\\n\\r\\nGET /smuggled HTTP/1.1\\r\\nHost: 127.0.0.1:{p}\\r\\n\\r\\n")
out["long"] = ask(b"GET http://127.0.0.1:{p}/ HTTP/1.1\\r\\nX-Long: " + b"a" * 70000 + b"\\r\\n\\r\\n")
out["origin"] = ask(b"GET / HTTP/1.1\\r\\nHost: 127.0.0.1:3128\\r\\n\\r\\n")
out
""")
    out = r.result
    assert out["port"].startswith("HTTP/1.1 403") and "port 22 of 127.0.0.1 is not allowed" in (
        out["port"])
    assert out["absolute"].startswith("HTTP/1.1 403") and "not on the allow-list" in (
        out["absolute"])
    assert out["smuggle"].startswith("HTTP/1.1 400"), out["smuggle"]
    assert out["long"].startswith("HTTP/1.1 431"), out["long"][:200]
    assert out["origin"].startswith("HTTP/1.1 400"), out["origin"]
    assert not [s for s in servers.seen if s["path"] in ("/smuggled", "/a")]


def test_a_slow_loris_job_holds_up_no_other_job(gateway: DaemonHandle, servers: Servers) -> None:
    """Job A opens more slow connections than its door serves at once and trickles heads
    into them; meanwhile job B, of the same policy, is served at once by its own door."""
    holding = threading.Event()

    def seen_holding(data: str) -> None:
        if "holding" in data:
            holding.set()

    with Client(gateway.socket) as a_client, Client(gateway.socket) as b_client:
        a = a_client.submit("""
import socket, time
conns = []
for i in range(40):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    s.sendall(b"GET http://127.0.0.1/ HTTP/1.1\\r\\n")
    conns.append(s)
print("holding", flush=True)
while True:
    for s in conns:
        try:
            s.sendall(b"X: y\\r\\n")
        except OSError:
            pass
    time.sleep(0.5)
""", "web", on_stdout=seen_holding)
        try:
            assert holding.wait(guard(60)), "job A never held its connections"
            b = b_client.run(f"""
import urllib.request
urllib.request.urlopen("http://127.0.0.1:{servers.plain}/while-a-holds").status
""", "web")
            assert (b.status, b.result) == ("ok", 200), (b.status, b.error)
            assert not a.done
        finally:
            a.cancel()
        assert a.result(guard(30)).status == "cancelled"


def test_the_trust_bundle_and_the_ca_key_are_where_they_should_be(
    gateway: DaemonHandle,
) -> None:
    """The jail sees the bundle (host CAs + jaild's CA), never the key: the key is in a
    0700 directory, 0600, the daemon's user's."""
    from tests.conftest import STATE_DIR

    ca_dir = Path(STATE_DIR) / "egress" / "ca"
    assert ca_dir.stat().st_mode & 0o777 == 0o700
    key = ca_dir / "ca.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_uid == os.geteuid()
    r = run(gateway, """
import os, certifi
b = open("/opt/jaild/egress-trust.pem").read()
[b.count("BEGIN CERTIFICATE"), open(certifi.where()).read() == b,
 os.path.exists("/opt/jaild/egress/ca/ca.key")]
""")
    count, certifi_covered, key_visible = r.result
    assert count > 1 and certifi_covered and not key_visible


def test_a_local_user_cannot_read_the_ca_key_and_no_door_is_on_the_host(
    gateway: DaemonHandle,
) -> None:
    """A local user who is not root reads the trust bundle (public) but not the CA's key (root
    reading it is the positive control). The doors are in the jails' namespaces: none of the
    daemon's sockets listens on TCP in the host's (while a jail of an egress policy is up)."""
    import subprocess
    import sys

    from tests.conftest import STATE_DIR

    base = Path(STATE_DIR) / "egress"
    probe = f"""
out = []
for path in ("{base}/trust.pem", "{base}/ca/ca.key"):
    try:
        open(path, "rb").read(1)
        out.append("read")
    except OSError as e:
        out.append(type(e).__name__)
print(",".join(out))
"""

    def as_user(uid: int) -> str:
        def drop() -> None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

        # the base interpreter: the venv may sit in a 0700 home the other uid cannot enter
        python = getattr(sys, "_base_executable", "") or sys.executable
        r = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True,
                           timeout=guard(30), preexec_fn=drop if uid else None, check=True)
        return r.stdout.strip()

    assert as_user(65534) == "read,PermissionError"
    assert as_user(0) == "read,read"  # the positive control

    with socket.create_server(("127.0.0.1", 0)):  # the probe's positive control
        assert tcp_listeners_in_host_namespace(os.getpid())
    with Client(gateway.socket) as client:
        job = client.submit("import time; time.sleep(600)", "web")
        try:
            until(lambda: any(j["id"] == job.job_id and j["state"] == "running"
                              for j in client.jobs()), "the job runs")
            assert not tcp_listeners_in_host_namespace(gateway.proc.pid)
        finally:
            job.cancel()


def tcp_listeners_in_host_namespace(pid: int) -> set[str]:
    """The sockets of process ``pid`` that listen on TCP in this (the host's) namespace."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            held.add(target[8:-1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening.add(fields[9])
    return held & listening
