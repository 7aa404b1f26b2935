"""The daemon's side of ``network.mode = "egress"``: the trust bundle, the secrets, and a
door per jail.

Theory of operation
-------------------
At start (:meth:`EgressService.prepare`, only if some policy egresses):

* the interception CA (:class:`~jaild.daemon.egress.ca.EgressCA`) is loaded or made in
  ``<state_dir>/egress/ca`` (0700; its key 0600, the daemon's only);
* ``<state_dir>/egress/trust.pem`` (0644) is written: the host's CA bundle plus the CA's
  certificate. Jails of egress policies see it at ``/opt/jaild/egress-trust.pem`` (and in
  place of their env's certifi bundle), so hosts tunnelled untouched verify as they would
  on the host, and the hosts the gateway intercepts verify against the CA;
* every ``[[egress.inject]]`` value is read -- from ``daemon.egress_secrets`` (a file of
  ``NAME=value`` lines, mode 0600 and owned by the daemon's user, or it is refused), else
  the daemon's environment. A value that is missing stops the start, naming the policy
  file and key. Values stay in the daemon: the jail's environment, files and proxy
  settings never hold one.

Per jail, once it is hardened and before any job code runs in it, :meth:`listener` makes
a TCP listener on ``127.0.0.1:3128`` *inside the jail's network namespace*
(:func:`~jaild.daemon.egress.gateway.listen_in`): the jail's only way out, which the daemon
serves. Per run, :meth:`door` makes a fresh :class:`~jaild.daemon.egress.gateway.EgressDoor`
(its quotas and usage are the run's), whose requests are audited and counted per policy.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaild.daemon.egress.flowwatch import OnRefused
from jaild.daemon.egress.gateway import EgressDoor, EgressQuota, listen_in
from jaild.errors import StartupError
from jaild.policy.compile import EGRESS_PORT
from jaild.policy.schema import Policy, egress_rules, flow_rules, resolve_env

if TYPE_CHECKING:
    from jaild.daemon.egress.ca import EgressCA

log = logging.getLogger("jaild")

AUDITED_BEYOND_QUOTA = 32
"""Requests a run may have audited one by one past its ``max_requests`` (refused ones):
the rest are only counted, in the record's ``egress.refused``."""

Observer = Callable[[str, str, dict[str, Any]], None]
"""(job_id, policy, request summary): each request through a door (audit, metrics)."""


def host_ca_bundle() -> str | None:
    """The host's CA bundle file (OpenSSL's default), else certifi's, else None."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile):
        if candidate and os.path.isfile(candidate):
            return candidate
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()


def read_secrets(path: str) -> dict[str, str]:
    """``NAME=value`` lines (``#`` comments, blank lines) of a file only the daemon's user
    can read. Raises StartupError naming the file and why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise StartupError(f"{path}: daemon.egress_secrets: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "r", encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StartupError(f"{path}: daemon.egress_secrets: not a regular file")
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise StartupError(
                f"{path}: daemon.egress_secrets: mode {oct(st.st_mode & 0o777)}, owner uid "
                f"{st.st_uid}: must be 0600 (or stricter) and owned by the daemon's user "
                f"(uid {os.geteuid()})"
            )
        secrets = {}
        for n, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            name, sep, value = text.partition("=")
            if not sep or not name.strip():
                raise StartupError(f"{path}:{n}: daemon.egress_secrets: expected NAME=value")
            secrets[name.strip()] = value.strip()
    return secrets


def certifi_bundles(policies: Mapping[str, Policy], envs_dir: str) -> tuple[tuple[str, str], ...]:
    """(env, its certifi cacert.pem) for the envs of egress policies (see HostLayout)."""
    found = []
    for policy in policies.values():
        if policy.network.mode != "egress":
            continue
        env = resolve_env(policy, envs_dir)
        for cacert in sorted(Path(env).glob("lib/python3*/site-packages/certifi/cacert.pem")):
            pair = (env, str(cacert))
            if pair not in found:
                found.append(pair)
    return tuple(found)


@dataclass
class EgressService:
    """See the module docstring."""

    trust_path: str
    ca: EgressCA
    upstream_tls: ssl.SSLContext
    observe: Observer
    # policy name -> canonical host -> [(header, value)]
    injections: dict[str, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)

    @classmethod
    def prepare(
        cls,
        policies: Mapping[str, Policy],
        state_dir: str,
        observe: Observer,
        *,
        secrets_file: str | None = None,
        upstream_ca: str | None = None,
    ) -> EgressService | None:
        """The service, or None when no policy egresses. Raises StartupError."""
        egressing = [p for p in policies.values() if p.network.mode == "egress"]
        if not egressing:
            return None
        secrets = read_secrets(secrets_file) if secrets_file else {}
        injections: dict[str, dict[str, list[tuple[str, str]]]] = {}
        problems = []
        for policy in egressing:
            for i, inj in enumerate(policy.egress.inject):
                value = secrets.get(inj.value_env, os.environ.get(inj.value_env))
                if not value:
                    where = f"{secrets_file} or " if secrets_file else ""
                    problems.append(
                        f"{policy.path}: egress.inject[{i}].value_env: {inj.value_env} is not "
                        f"set in {where}the daemon's environment"
                    )
                    continue
                hosts = injections.setdefault(policy.name, {})
                hosts.setdefault(inj.host, []).append((inj.header, value))
        if problems:
            raise StartupError("invalid policies:\n  " + "\n  ".join(problems))
        base = Path(state_dir) / "egress"
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        # imported here: cryptography is ~9 MiB of a daemon's memory that serves no egress
        from jaild.daemon.egress.ca import EgressCA

        ca = EgressCA(base / "ca")  # always: daemons sharing a state dir write one bundle
        trust = _write_trust(base / "trust.pem", ca)
        try:
            upstream = ssl.create_default_context(cafile=upstream_ca)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"daemon.egress_upstream_ca: {upstream_ca}: {exc}") from None
        return cls(str(trust), ca, upstream, observe, injections)

    def listener(self, pid: int) -> socket.socket:
        """The jail's door: a listener on its own loopback (the jail of process ``pid``).
        Refused if ``pid`` shares the daemon's network namespace: a door there would be
        every local user's."""
        ours = os.stat("/proc/self/ns/net").st_ino
        netns = f"/proc/{pid}/ns/net"
        if os.stat(netns).st_ino == ours:
            raise OSError(f"process {pid} is in the daemon's own network namespace")
        return listen_in(netns, EGRESS_PORT)

    def door(self, policy: Policy, job_id: str,
             labels: Callable[[], frozenset[str]] = frozenset,
             on_flow_refused: OnRefused = lambda *_: None,
             ) -> EgressDoor:
        """A run's door: the policy's rules, a fresh quota and usage; ``labels``: what the
        job holds now (its flow rules close hosts by them)."""
        egress = policy.egress
        quota = EgressQuota(egress.max_requests, egress.max_bytes)
        audited = egress.max_requests + AUDITED_BEYOND_QUOTA
        seen = [0]

        def observe(summary: dict[str, Any]) -> None:
            seen[0] += 1
            if seen[0] <= audited:
                self.observe(job_id, policy.name, summary)

        return EgressDoor(
            egress_rules(egress), quota, policy.name, observe=observe,
            injections=self.injections.get(policy.name), ca=self.ca,
            upstream_tls=self.upstream_tls, flow=flow_rules(policy), labels=labels,
            on_flow_refused=on_flow_refused,
        )


def _write_trust(path: Path, ca: EgressCA) -> Path:
    """The host's CAs and ours, written whole and renamed into place (0644)."""
    parts = []
    host = host_ca_bundle()
    if host is not None:
        parts.append(Path(host).read_bytes())
    else:
        log.warning("no CA bundle on this host: egress jails trust only jaild's CA")
    parts.append(ca.certificate_pem)
    data = b"\n".join(p.rstrip(b"\n") for p in parts) + b"\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


__all__ = ["EgressService", "certifi_bundles", "host_ca_bundle", "read_secrets"]
