"""Daemons with a mutual-TLS listener, for the tests of jaild over the network.

:func:`start_tls_daemon` starts ``jaild serve`` (through :func:`tests.conftest.start_daemon`)
with a config that adds ``daemon.listen`` and ``[tls]`` from a :class:`tests.tls.Pki`, waits
until the listener is up and reads the address it listens on (``port 0``: the kernel's
choice, so that suites running side by side never collide on a port). ``wrapper`` runs the
daemon inside a test bed's node namespace (``nsenter --net=...``: :mod:`tests.fleet`).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from jaild.client import Client
from tests.conftest import REPO_POLICIES, DaemonHandle, guard, start_daemon, wait_listening
from tests.tls import Issued, Pki

DEFAULT_POLICY = (REPO_POLICIES / "default.toml").read_text()

LISTENING = re.compile(r"listening on (tls://\S+) \(mutual TLS\)")
METRICS = re.compile(r"serving Prometheus metrics on (http://\S+/metrics)")


@dataclass
class TlsDaemon:
    """A daemon with its Unix socket and its network listener."""

    handle: DaemonHandle
    address: str
    """``tls://HOST:PORT`` it listens on."""
    pki: Pki
    config_path: Path
    audit_path: Path

    @property
    def socket(self) -> str:
        return self.handle.socket

    def client(self, cert: Issued | None = None, **kwargs: object) -> Client:
        """A blocking client over TLS, as ``cert`` (default: alice)."""
        cert = cert or self.pki.client
        return Client(self.address, cert=cert.cert, key=cert.key, ca=self.pki.ca.cert,
                      **kwargs)  # type: ignore[arg-type]

    def audit(self) -> list[dict[str, object]]:
        """The audit log's records so far."""
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The daemon's Prometheus samples now: (name, labels) -> value (the daemon must
        have been started with ``metrics=``)."""
        found = METRICS.search(self.handle.log())
        assert found, "the daemon serves no metrics"
        with urllib.request.urlopen(found.group(1), timeout=guard(10)) as answer:
            text = answer.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def stop(self) -> int:
        return self.handle.stop()


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return str(value)


def tls_config(directory: Path, pki: Pki, *, listen: str = "tls://127.0.0.1:0",
               principals: tuple[str, ...] = ("*",), liveness_s: float | None = None,
               metrics: str | None = None, limits: dict[str, object] | None = None,
               tls: dict[str, object] | None = None,
               daemon: dict[str, object] | None = None,
               access: dict[str, object] | None = None) -> tuple[Path, Path]:
    """A daemon config file with a TLS listener: (its path, its audit log's path).
    ``limits``, ``tls``, ``daemon``, ``access``: more keys of those sections."""
    directory.mkdir(parents=True, exist_ok=True)
    audit = directory / "audit.jsonl"
    own: dict[str, object] = {"listen": [listen], "audit_log": str(audit), **(daemon or {})}
    if metrics:
        own["metrics_address"] = metrics
    sections: dict[str, dict[str, object]] = {
        "daemon": own,
        "access": {"principals": list(principals), **(access or {})},
        "tls": {"cert": pki.server.cert, "key": pki.server.key, "client_ca": pki.ca.cert,
                **(tls or {})},
        "limits": {**({"liveness_timeout_s": liveness_s} if liveness_s is not None else {}),
                   **(limits or {})},
    }
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items())
        for name, keys in sections.items() if keys
    )
    path = directory / "jaild.toml"
    path.write_text(text)
    return path, audit


def start_tls_daemon(directory: Path, pki: Pki, *, policies: dict[str, str] | None = None,
                     wrapper: tuple[str, ...] = (), args: tuple[str, ...] = (),
                     **config: object) -> TlsDaemon:
    """Start a daemon serving ``policies`` (default: the repository's ``default``) on a Unix
    socket and a TLS listener (``config``: :func:`tls_config`'s options)."""
    return _listening(_started(directory, pki, policies, wrapper, args, config))


def start_tls_daemons(directories: list[Path], pki: Pki, **config: object) -> list[TlsDaemon]:
    """:func:`start_tls_daemon` for each directory, started side by side."""
    started = [_started(d, pki, None, (), (), config) for d in directories]
    return [_listening(s) for s in started]


def _started(directory: Path, pki: Pki, policies: dict[str, str] | None,
             wrapper: tuple[str, ...], args: tuple[str, ...],
             config: dict[str, object]) -> tuple[DaemonHandle, Pki, Path, Path]:
    path, audit = tls_config(directory / "conf", pki, **config)  # type: ignore[arg-type]
    handle = start_daemon(directory, policies or {"default": DEFAULT_POLICY},
                          with_repo_policies=False, wrapper=wrapper,
                          args=("--config", str(path), *args), wait=False)
    return handle, pki, path, audit


def _listening(started: tuple[DaemonHandle, Pki, Path, Path]) -> TlsDaemon:
    handle, pki, path, audit = started
    wait_listening(handle.socket, handle.proc, handle.log_path)
    handle.subtree_dirs  # noqa: B018 -- where it placed itself, remembered while it runs
    deadline = time.monotonic() + guard(30)
    while True:
        found = LISTENING.search(Path(handle.log_path).read_text(errors="replace"))
        if found:
            return TlsDaemon(handle, found.group(1), pki, path, audit)
        if handle.proc.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise AssertionError("the TLS listener did not come up:\n" + handle.log()[-3000:])
        time.sleep(0.05)
