"""``make image``: jaild's OCI image, built offline from Debian's packages and PyPI.

Theory of operation
-------------------
The image is two layers, each built in a chroot, never in a container, and written by this
script as tar files itself (sorted, owners numeric, every time clamped to
``SOURCE_DATE_EPOCH``, gzip without a name or a time), so the same inputs give the same bytes:

1. **base**: Debian bookworm, ``mmdebstrap --variant=minbase`` with
   ``image/packages-runtime.txt``, documentation and locales left out as in
   ``debian:bookworm-slim``. The mirrors are the host's own apt sources for bookworm
   (``/etc/apt/sources.list*``), so the build uses whatever mirror or proxy apt uses here.
2. **jaild**: what ``image/install.sh jaild`` adds to the base, run in a chroot of it with no
   network (a fresh network namespace): jaild's venv from a wheel of this checkout, the
   policies, the daemon's config and the jail environments, all from a *wheelhouse*. The layer
   is the difference from the base (a deleted file is a whiteout).

The wheelhouse is made by ``image/install.sh wheels`` in a throwaway chroot (``mmdebstrap
--format=null``) that has the compilers (``image/packages-build.txt``; python-prctl has no
wheel), trusting the host's CA bundle, so they never reach the image.

Each step is cached under ``/var/cache/jaild-image`` (``JAILD_IMAGE_CACHE``) by a hash of its
inputs: the base by its package list, mirrors and recipe; the wheelhouse by those and
``pyproject.toml``, ``envs/*.txt`` and ``install.sh``; the jaild layer by those and the files of
this checkout it reads. An unchanged build reuses all three and only checks that podman has the
image, in seconds. ``--refresh`` rebuilds the base and the wheelhouse (newer Debian and PyPI
versions); what was installed is listed in the image, ``/opt/jaild/image-manifest.txt``.

Out: ``build/jaild-image.oci.tar`` (an OCI archive: ``skopeo``, ``podman load`` and ``ctr
images import`` read it) and, in podman's local storage, ``localhost/jaild:VERSION`` and
``localhost/jaild:latest``. ``SOURCE_DATE_EPOCH`` is the last commit's time (the base's and the
wheelhouse's: that of the last commit that changed ``image/packages-runtime.txt``). The
image's layout, and the Containerfile that gives the same one for builders with a registry:
docs/running/container-image.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import gzip
import hashlib
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE_DIR = Path(os.environ.get("JAILD_IMAGE_CACHE", "/var/cache/jaild-image"))
OUT = REPO / "build" / "jaild-image.oci.tar"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CONTAINERS_CONF = HERE / "containers.conf"
# Scratch space (mmdebstrap's chroots, the jaild layer's tree) goes here, not in /tmp.
TMP = Path(os.environ.get("JAILD_IMAGE_TMP", "/var/tmp"))

SUITE = "bookworm"
VARIANT = "minbase"
NAME = "localhost/jaild"
# What `install.sh jaild` reads of the checkout (the Containerfile copies the same).
SOURCE_PATHS = ("pyproject.toml", "README.md", "jaild", "policies", "envs", "image")
# As in debian:bookworm-slim: no manual pages, documentation (but the copyrights) or locales.
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
)
# The host's apt settings the chroots' apt gets too (a proxy, a snapshot's old Release files).
APT_OPTIONS_FROM_HOST = (
    "Acquire::Check-Valid-Until",
    "Acquire::Check-Date",
    "Acquire::http::Proxy",
    "Acquire::https::Proxy",
)
PROXY_VARIABLES = (
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "PIP_INDEX_URL",
    "PIP_DEFAULT_TIMEOUT",
)
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The image's configuration (image/Containerfile says the same; tests/unit/test_image.py).
ENTRYPOINT = ("/usr/bin/tini", "--")
CMD = ("/opt/jaild/venv/bin/jaild", "serve")
STOPSIGNAL = "SIGTERM"
METRICS_PORT = "9464/tcp"
ENV = (f"PATH={CHROOT_PATH}",)

BASE_RECIPE = 2  # bump to rebuild the cached base layers (their tar, not their packages)


def log(msg: str) -> None:
    print(f"image: {msg}", flush=True)


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, text=True, **kw)


def sha256_of(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "big") + b)
    return h.hexdigest()


# ---------------------------------------------------------------------------- inputs


def git(*args: str) -> str:
    return run(["git", "-C", str(REPO), *args], capture_output=True).stdout.strip()


def source_files() -> list[str]:
    """The checkout's tracked files under SOURCE_PATHS, as they are in the work tree."""
    names = git("ls-files", "-z", "--", *SOURCE_PATHS).split("\0")
    return sorted(n for n in names if n and (REPO / n).is_file())


def tree_digest(files: list[str]) -> str:
    parts: list[str | bytes] = []
    for name in files:
        p = REPO / name
        parts += [name, oct(p.stat().st_mode & 0o777), p.read_bytes()]
    return sha256_of(*parts)


def packages(kind: str) -> list[str]:
    text = (HERE / f"packages-{kind}.txt").read_text(encoding="utf-8")
    return [w for line in text.splitlines() for w in line.split("#")[0].split()]


def _deb822(text: str) -> Iterator[dict[str, str]]:
    for para in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in para.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
        if fields:
            yield fields


def debian_sources(etc: Path = Path("/etc/apt")) -> list[str]:
    """The host's apt sources for SUITE (and its -updates, -security), as one-line ``deb``
    entries for mmdebstrap; other suites and repositories (a vendor's) are left out."""
    entries: list[tuple[str, str, str]] = []
    files = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for f in files:
        if not f.is_file():
            continue
        for line in f.read_text(encoding="utf-8").splitlines():
            words = line.split("#")[0].split()
            if len(words) >= 4 and words[0] == "deb":
                if words[1].startswith("["):  # options: [signed-by=...]
                    while words and not words[1].endswith("]"):
                        del words[1]
                    del words[1]
                if len(words) >= 4:
                    entries.append((words[1], words[2], " ".join(words[3:])))
    for f in sorted((etc / "sources.list.d").glob("*.sources")):
        for para in _deb822(f.read_text(encoding="utf-8")):
            if "deb" not in para.get("types", "").split():
                continue
            if para.get("enabled", "yes").lower() == "no":
                continue
            for uri in para.get("uris", "").split():
                for suite in para.get("suites", "").split():
                    entries.append((uri, suite, para.get("components", "main")))
    lines = []
    for uri, suite, comps in entries:
        if suite == SUITE or suite.startswith(f"{SUITE}-") or suite.startswith(f"{SUITE}/"):
            line = f"deb {uri} {suite} {comps}"
            if line not in lines:
                lines.append(line)
    return lines


def host_apt_options() -> list[str]:
    """The host's values of APT_OPTIONS_FROM_HOST, as mmdebstrap --aptopt settings."""
    try:
        dump = run(["apt-config", "dump"], capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    wanted = {k.lower() for k in APT_OPTIONS_FROM_HOST}
    out = []
    for line in dump.splitlines():
        key, _, value = line.partition(" ")
        if key.lower() in wanted:
            out.append(f"{key} {value}")
    return sorted(out)


def commit_time(*paths: str) -> int:
    stamp = git("log", "-1", "--format=%ct", "--", *paths) or git("log", "-1", "--format=%ct")
    return int(stamp)


def version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def revision() -> str:
    rev = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *SOURCE_PATHS)
    return f"{rev}-dirty" if dirty else rev


# ---------------------------------------------------------------------------- layers


class _Hashing(io.RawIOBase):
    """A writer that passes bytes on and counts and hashes them."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.sha.update(data)
        self.size += len(data)
        self.out.write(data)
        return len(data)


@dataclass(frozen=True)
class Blob:
    path: Path
    digest: str  # sha256:... of the file
    size: int
    diff_id: str = ""  # a layer's: sha256:... of its uncompressed tar

    def to_json(self) -> str:
        return json.dumps({"digest": self.digest, "size": self.size, "diff_id": self.diff_id})

    @classmethod
    def load(cls, path: Path) -> Blob | None:
        try:
            d = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return cls(path, d["digest"], d["size"], d["diff_id"]) if path.is_file() else None


class LayerWriter:
    """A gzipped tar layer written in the order entries come, normalized: numeric owners
    without names, times clamped to ``epoch``, no gzip name or time."""

    def __init__(self, path: Path, epoch: int) -> None:
        self.path, self.epoch = path, epoch
        self._file = open(path, "wb")  # noqa: SIM115
        self._outer = _Hashing(self._file)
        self._gz = gzip.GzipFile(fileobj=self._outer, mode="wb", compresslevel=6, mtime=0)
        self._inner = _Hashing(self._gz)  # type: ignore[arg-type]
        self._tar = tarfile.open(  # noqa: SIM115 (closed by close())
            fileobj=self._inner, mode="w|", format=tarfile.GNU_FORMAT
        )

    def add(self, info: tarfile.TarInfo, data: IO[bytes] | None = None) -> None:
        info.mtime = min(int(info.mtime), self.epoch)
        info.uname = info.gname = ""
        info.pax_headers = {}
        self._tar.addfile(info, data if info.isreg() else None)

    def close(self) -> Blob:
        self._tar.close()
        self._gz.close()
        self._file.close()
        blob = Blob(
            self.path,
            f"sha256:{self._outer.sha.hexdigest()}",
            self._outer.size,
            f"sha256:{self._inner.sha.hexdigest()}",
        )
        self.path.with_suffix(".json").write_text(blob.to_json(), encoding="utf-8")
        return blob


def _layer_name(name: str) -> str:
    """A member's name in a layer: relative, no "./", no trailing "/"; "" for the root."""
    name = name.removeprefix("./").rstrip("/")
    return "" if name in (".", "/") else name


Signature = tuple[bytes, int, int, int, int, int, str]


def _signature(info: tarfile.TarInfo) -> Signature:
    kind = tarfile.REGTYPE if info.isreg() else info.type
    return (
        kind,
        info.mode & 0o7777,
        info.uid,
        info.gid,
        info.size if info.isreg() else 0,
        int(info.mtime),
        info.linkname,
    )


def base_layer(rootfs_tar: Path, out: Path, epoch: int) -> Blob:
    """mmdebstrap's tar as a layer: /dev's nodes left out (the runtime makes /dev)."""
    writer = LayerWriter(out, epoch)
    with tarfile.open(rootfs_tar) as tar:
        for info in tar:
            name = _layer_name(info.name)
            if not name or (name.startswith("dev/") and name != "dev"):
                continue
            info.name = name
            if info.islnk():
                info.linkname = _layer_name(info.linkname)
            writer.add(info, tar.extractfile(info) if info.isreg() else None)
    return writer.close()


def layer_index(layer: Path) -> dict[str, Signature]:
    """Each member's signature; a hard link's is its target's, as a file on disk has it."""
    index: dict[str, Signature] = {}
    with tarfile.open(layer, "r:gz") as tar:
        for info in tar:
            index[info.name] = index[info.linkname] if info.islnk() else _signature(info)
    return index


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    def walk(rel: str) -> Iterator[tuple[str, os.stat_result]]:
        for entry in sorted(
            os.scandir(root / rel) if rel else os.scandir(root), key=lambda e: e.name
        ):
            name = f"{rel}/{entry.name}" if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            yield name, st
            if stat.S_ISDIR(st.st_mode):
                yield from walk(name)

    yield from walk("")


def diff_layer(root: Path, base: dict[str, Signature], out: Path, epoch: int) -> tuple[Blob, int]:
    """What ``root`` has that the base has not, or has otherwise, as a layer; whiteouts for
    what it removed. Returns the layer and the number of entries in it."""
    writer = LayerWriter(out, epoch)
    seen: set[str] = set()
    links: dict[tuple[int, int], str] = {}
    count = 0
    for name, st in _walk(root):
        seen.add(name)
        path = root / name
        info = tarfile.TarInfo(name)
        info.mode, info.uid, info.gid = st.st_mode & 0o7777, st.st_uid, st.st_gid
        info.mtime = int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            info.size = st.st_size
        else:
            raise SystemExit(f"image: {path}: not a file, directory or symlink")
        if base.get(name) == _signature(info):
            continue
        count += 1
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            first = links.setdefault((st.st_dev, st.st_ino), name)
            if first != name:
                info.type, info.linkname, info.size = tarfile.LNKTYPE, first, 0
                writer.add(info)
                continue
        if info.isreg():
            with open(path, "rb") as f:
                writer.add(info, f)
        else:
            writer.add(info)
    gone = sorted(n for n in base if n not in seen)
    for name in gone:
        parent = name.rpartition("/")[0]
        if parent and parent in gone:
            continue
        info = tarfile.TarInfo(f"{parent}/.wh.{name.rpartition('/')[2]}".lstrip("/"))
        info.mtime = epoch
        writer.add(info, io.BytesIO(b""))
        count += 1
    return writer.close(), count


# ---------------------------------------------------------------------------- cache


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prune(kind: str, keep: Path, n: int = 2) -> None:
    """Keep the ``n`` entries of a kind used last (``keep`` among them)."""
    keep.touch()
    entries = sorted(CACHE_DIR.glob(f"{kind}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [e for e in entries if e != keep][n - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def mmdebstrap(
    include: list[str],
    target: str,
    sources: list[str],
    apt_options: list[str],
    epoch: int,
    extra: list[str],
) -> None:
    argv = ["mmdebstrap", f"--variant={VARIANT}", f"--include={','.join(include)}"]
    argv += [f"--aptopt={o}" for o in apt_options]
    argv += [*extra, SUITE, target, *sources]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "TMPDIR": str(TMP)}
    log(" ".join(shlex.quote(a) for a in argv))
    run(argv, env=env)


@dataclass
class Inputs:
    version: str
    revision: str
    epoch: int
    recipe_epoch: int
    files: list[str]
    sources: list[str]
    apt_options: list[str]

    @property
    def base_key(self) -> str:
        return sha256_of(
            str(BASE_RECIPE),
            SUITE,
            VARIANT,
            *packages("runtime"),
            *DPKG_OPTIONS,
            *self.sources,
            *self.apt_options,
            str(self.recipe_epoch),
        )[:16]

    @property
    def wheels_key(self) -> str:
        reqs = [(REPO / f).read_bytes() for f in self.files if f.startswith("envs/")]
        return sha256_of(
            SUITE,
            *packages("runtime"),
            *packages("build"),
            *self.sources,
            *self.apt_options,
            str(self.recipe_epoch),
            (HERE / "install.sh").read_bytes(),
            (REPO / "pyproject.toml").read_bytes(),
            *reqs,
        )[:16]

    @property
    def top_key(self) -> str:
        return sha256_of(
            self.base_key,
            self.wheels_key,
            tree_digest(self.files),
            str(self.epoch),
            self.revision,
            Path(__file__).read_bytes(),
        )[:16]


def build_base(inp: Inputs, refresh: bool) -> Blob:
    d = CACHE_DIR / f"base-{inp.base_key}"
    blob = Blob.load(d / "layer.tar.gz")
    if blob and not refresh:
        log(f"base: reused {d}")
        prune("base", d)
        return blob
    t = time.monotonic()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="jaild-image-", dir=TMP) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        mmdebstrap(
            packages("runtime"),
            str(rootfs),
            inp.sources,
            inp.apt_options,
            inp.recipe_epoch,
            [f"--dpkgopt={o}" for o in DPKG_OPTIONS],
        )
        blob = base_layer(rootfs, d / "layer.tar.gz", inp.recipe_epoch)
    log(f"base: built {d} in {time.monotonic() - t:.0f} s ({blob.size >> 20} MiB)")
    prune("base", d)
    return blob


def _stage_source(files: list[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def build_wheels(inp: Inputs, refresh: bool) -> Path:
    d = CACHE_DIR / f"wheels-{inp.wheels_key}"
    if (d / ".complete").is_file() and not refresh:
        log(f"wheelhouse: reused {d}")
        prune("wheels", d)
        return d
    t = time.monotonic()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    env = ["env", "-i", f"PATH={CHROOT_PATH}", "HOME=/root", "LANG=C.UTF-8"]
    env += [f"{k}={os.environ[k]}" for k in PROXY_VARIABLES if k in os.environ]
    with tempfile.TemporaryDirectory(prefix="jaild-image-", dir=TMP) as tmp:
        stage = Path(tmp) / "src"
        _stage_source(inp.files, stage)
        if CA_BUNDLE.is_file():  # pip in the chroot trusts what the host trusts (a proxy's CA)
            shutil.copy(CA_BUNDLE, stage / "host-ca.crt")
            env.append("PIP_CERT=/tmp/jaild-src/host-ca.crt")
        step = [
            *env,
            "sh",
            "/tmp/jaild-src/image/install.sh",
            "wheels",
            "/tmp/jaild-src",
            "/tmp/jaild-wheels",
        ]
        hooks = [
            'mkdir -p "$1/tmp/jaild-src"',
            f"sync-in {shlex.quote(str(stage))} /tmp/jaild-src",
            'chroot "$1" ' + " ".join(shlex.quote(a) for a in step),
            f"sync-out /tmp/jaild-wheels {shlex.quote(str(d))}",
        ]
        mmdebstrap(
            packages("runtime") + packages("build"),
            "/dev/null",
            inp.sources,
            inp.apt_options,
            inp.recipe_epoch,
            ["--format=null", *[f"--customize-hook={h}" for h in hooks]],
        )
    wheels = sorted(p.name for p in d.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"image: no wheels in {d}")
    (d / ".complete").write_text("\n".join(wheels) + "\n", encoding="utf-8")
    log(f"wheelhouse: built {d} in {time.monotonic() - t:.0f} s ({len(wheels)} wheels)")
    prune("wheels", d)
    return d


def build_top(inp: Inputs, base: Blob, wheels: Path) -> Blob:
    d = CACHE_DIR / f"jaild-{inp.top_key}"
    blob = Blob.load(d / "layer.tar.gz")
    if blob:
        log(f"jaild layer: reused {d}")
        prune("jaild", d)
        return blob
    t = time.monotonic()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="jaild-image-", dir=TMP) as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        run(["tar", "-xzpf", str(base.path), "--numeric-owner", "-C", str(root)])
        index = layer_index(base.path)
        _stage_source(inp.files, root / "tmp/jaild-src")
        shutil.copytree(wheels, root / "tmp/jaild-wheels")
        env = [
            "/usr/bin/env",
            "-i",
            f"PATH={CHROOT_PATH}",
            "HOME=/root",
            "LANG=C.UTF-8",
            f"SOURCE_DATE_EPOCH={inp.epoch}",
            f"JAILD_REVISION={inp.revision}",
        ]
        step = [
            *env,
            "sh",
            "/tmp/jaild-src/image/install.sh",
            "jaild",
            "/tmp/jaild-src",
            "/tmp/jaild-wheels",
        ]
        # A mount namespace of its own (its /proc and /dev go with it), no network (the
        # wheelhouse must hold everything) and a pid namespace: `jaild env build` builds in
        # envs/.NAME.build-<pid>, a path its scripts and byte-code keep, and pids counted
        # from 1 in a fresh namespace are the same each build.
        script = (
            'mount -t proc proc "$1/proc" && mount --bind /dev "$1/dev" && shift && '
            'exec chroot "$@"'
        )
        log("jaild layer: image/install.sh jaild, in a chroot of the base with no network")
        run(
            [
                "unshare",
                "--mount",
                "--net",
                "--pid",
                "--fork",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
                str(root),
                str(root),
                *step,
            ]
        )
        for leftover in ("tmp/jaild-src", "tmp/jaild-wheels"):
            shutil.rmtree(root / leftover)
        blob, count = diff_layer(root, index, d / "layer.tar.gz", inp.epoch)
    log(
        f"jaild layer: built {d} in {time.monotonic() - t:.0f} s "
        f"({count} entries, {blob.size >> 20} MiB)"
    )
    prune("jaild", d)
    return blob


# ---------------------------------------------------------------------------- the image


def _architecture() -> str:
    arch = run(["dpkg", "--print-architecture"], capture_output=True).stdout.strip()
    return {"i386": "386", "armhf": "arm", "ppc64el": "ppc64le"}.get(arch, arch)


def labels(inp: Inputs) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": "jaild",
        "org.opencontainers.image.description": "jaild: untrusted Python in nsjail jails, "
        "tool calls routed to the host",
        "org.opencontainers.image.version": inp.version,
        "org.opencontainers.image.revision": inp.revision,
        "org.opencontainers.image.created": _iso(inp.epoch),
        "org.opencontainers.image.base.name": f"debian:{SUITE} ({VARIANT}, mmdebstrap)",
    }


def _iso(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def image_config(inp: Inputs, layers: list[Blob]) -> bytes:
    return _json(
        {
            "architecture": _architecture(),
            "os": "linux",
            "created": _iso(inp.epoch),
            "config": {
                "Env": list(ENV),
                "Entrypoint": list(ENTRYPOINT),
                "Cmd": list(CMD),
                "StopSignal": STOPSIGNAL,
                "ExposedPorts": {METRICS_PORT: {}},
                "WorkingDir": "/",
                "Labels": labels(inp),
            },
            "rootfs": {"type": "layers", "diff_ids": [b.diff_id for b in layers]},
            "history": [
                {
                    "created": _iso(inp.recipe_epoch),
                    "created_by": f"mmdebstrap --variant={VARIANT} {SUITE} (image/build.py)",
                },
                {
                    "created": _iso(inp.epoch),
                    "created_by": "image/install.sh jaild (image/build.py)",
                },
            ],
        }
    )


def write_archive(out: Path, inp: Inputs, layers: list[Blob]) -> tuple[str, str]:
    """The OCI archive (an image layout in a tar); returns (manifest, config) digests."""
    config = image_config(inp, layers)
    config_digest = f"sha256:{hashlib.sha256(config).hexdigest()}"
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": b.digest,
                    "size": b.size,
                }
                for b in layers
            ],
        }
    )
    manifest_digest = f"sha256:{hashlib.sha256(manifest).hexdigest()}"
    ref = f"{NAME}:{inp.version}"
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "org.opencontainers.image.ref.name": ref,
                        "io.containerd.image.name": ref,
                    },
                }
            ],
        }
    )
    stamp = out.with_name(out.name + ".digest")
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == manifest_digest:
        log(f"archive: reused {out.relative_to(REPO)}")
        return manifest_digest, config_digest
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:

        def add(name: str, data: IO[bytes] | None, size: int = 0) -> None:
            info = tarfile.TarInfo(name)
            info.mtime, info.uname, info.gname = inp.epoch, "", ""
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            else:
                info.size, info.mode = size, 0o644
            tar.addfile(info, data)

        def add_bytes(name: str, data: bytes) -> None:
            add(name, io.BytesIO(data), len(data))

        add("blobs", None)
        add("blobs/sha256", None)
        blobs: list[tuple[str, Path | bytes]] = [
            (config_digest, config),
            (manifest_digest, manifest),
        ]
        blobs += [(b.digest, b.path) for b in layers]
        for digest, content in sorted(blobs, key=lambda x: x[0]):
            name = f"blobs/sha256/{digest.removeprefix('sha256:')}"
            if isinstance(content, bytes):
                add_bytes(name, content)
            else:
                with open(content, "rb") as f:
                    add(name, f, content.stat().st_size)
        add_bytes("index.json", index)
        add_bytes("oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
    tmp.replace(out)
    stamp.write_text(manifest_digest + "\n", encoding="utf-8")
    log(f"archive: wrote {out.relative_to(REPO)} ({out.stat().st_size >> 20} MiB)")
    return manifest_digest, config_digest


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return subprocess.run(["podman", *args], env=env, text=True, capture_output=True, check=check)


def load_into_podman(out: Path, inp: Inputs, config_digest: str) -> None:
    want = config_digest.removeprefix("sha256:")
    ref, latest = f"{NAME}:{inp.version}", f"{NAME}:latest"

    def image_id(name: str) -> str:
        return podman("image", "inspect", "--format", "{{.Id}}", name, check=False).stdout.strip()

    before = {image_id(ref), image_id(latest)} - {"", want}
    if image_id(ref) == want:
        log(f"podman: {ref} is this image already ({want[:12]})")
    else:
        run(["skopeo", "copy", "--quiet", f"oci-archive:{out}:{ref}", f"containers-storage:{ref}"])
        log(f"podman: loaded {ref} ({want[:12]})")
    podman("tag", ref, latest)
    log(f"podman: {latest} -> {ref}")
    for old in before:  # earlier builds, now untagged unless something else names them
        tags = podman("image", "inspect", "--format", "{{.RepoTags}}", old, check=False)
        if not tags.stdout.strip("[] \n") and podman("rmi", old, check=False).returncode == 0:
            log(f"podman: removed the previous build, {old[:12]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="rebuild the base and the wheelhouse (newer Debian and PyPI "
        "versions) even where their cached copies are current",
    )
    parser.add_argument(
        "--no-load", action="store_true", help="write the archive only; do not load it into podman"
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("image: needs root (mmdebstrap, chroot, podman's storage)")
    t = time.monotonic()
    sources = debian_sources()
    if not sources:
        raise SystemExit(f"image: no apt source for {SUITE} in /etc/apt/sources.list*")
    inp = Inputs(
        version=version(),
        revision=revision(),
        epoch=commit_time(),
        recipe_epoch=commit_time("image/packages-runtime.txt"),
        files=source_files(),
        sources=sources,
        apt_options=host_apt_options(),
    )
    log(
        f"jaild {inp.version} at {inp.revision[:12]}, SOURCE_DATE_EPOCH={inp.epoch} "
        f"({_iso(inp.epoch)}); Debian from {', '.join(s.split()[1] for s in sources)}"
    )
    with cache_lock():  # a build beside this one (.ci/run's) finishes first; this one reuses
        base = build_base(inp, args.refresh)
        wheels = build_wheels(inp, args.refresh)
        top = build_top(inp, base, wheels)
        manifest_digest, config_digest = write_archive(OUT, inp, [base, top])
        if not args.no_load:
            load_into_podman(OUT, inp, config_digest)
    image_id = config_digest.removeprefix("sha256:")[:12]
    log(
        f"done in {time.monotonic() - t:.0f} s: {OUT.relative_to(REPO)}, "
        f"manifest {manifest_digest[:19]}, image id {image_id}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
