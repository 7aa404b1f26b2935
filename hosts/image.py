"""Guest images for the real-host harness: Debian root file systems booted under QEMU.

Theory of operation
-------------------
A guest is a *recipe* (:class:`Guest`): a Debian suite, a kernel package and a package list.
:func:`build` turns a recipe into a cached, read-only base disk image with ``debootstrap`` and
``mkfs.ext4 -d`` -- no loop devices, no mounts. The cache key is a hash of the recipe and of the
files baked into the image (``hosts/guest/``), so changing either rebuilds it; an unchanged one
is reused. Each run boots a throw-away qcow2 overlay on top of the base, so a run never changes
the cache.

What a base image holds, besides Debian: a static network config for QEMU's user-mode network
(the guest reaches the package registries through the host, nothing else), the host's CA bundle
for pip (HTTPS to the registries goes through a proxy only that bundle trusts), a 9p mount of
the run's directory at ``/mnt/hosts``, and ``jaild-hosts.service``, which runs
``/mnt/hosts/guest.sh`` once the network is up and powers the guest off when it ends.

A *provisioned* image (:class:`Provision`, CI's profile) also carries what a checkout's ``make
setup`` would download and build, made natively in a chroot of the root file system before
``mkfs`` -- under QEMU's emulation the same work takes 2-3x longer than the rest of a guest run:

* the checkout's apt packages (the Makefile's ``APT_PACKAGES``), installed by debootstrap;
* a wheelhouse, ``/var/cache/jaild-wheels``: a wheel of every Python package the checkout's
  venv (``VENV_EXTRAS``), ``make install`` and its jail environments install, python-prctl's
  built against the guest's own libcap and Python;
* the jail environments, ``/var/lib/jaild/envs/NAME`` for each ``envs/NAME.txt``, built by the
  checkout's own ``jaild env build`` from that wheelhouse with no index (which proves the
  wheelhouse complete), so the guest's ``make setup`` finds each up to date.

Its cache key adds the files those come from (the Makefile, ``pyproject.toml``, ``envs/*.txt``,
the env builder ``jaild/envs.py``) at the commit under test, so a change to any rebuilds it. A
guest booted from it runs offline: pip with ``PIP_NO_INDEX`` and the wheelhouse
(``hosts/guest/steps.sh``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE_DIR = Path(os.environ.get("JAILD_HOSTS_CACHE", "/var/cache/jaild-hosts"))
MIRROR = "http://deb.debian.org/debian"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

# What a fresh Debian server has (a user's starting point), plus what the harness itself needs
# (9p needs no package; iproute2 and procps are for the checks' diagnostics). jaild's own
# `make` installs everything else it needs, as on any fresh machine.
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "udev",
    "dbus",
    "kmod",
    "iproute2",
    "procps",
    "ca-certificates",
    "python3",
    "python3-venv",
    "python3-dev",
    "gcc",
    "make",
    "git",
    "sudo",
)


@dataclass(frozen=True)
class Guest:
    """A guest recipe. ``kernel`` is the Debian package whose kernel and initrd are booted."""

    name: str
    suite: str
    kernel: str
    kernel_suite: str | None = None  # the kernel from another release (None: ``suite``'s)
    disk_gb: int = 24
    extra_packages: tuple[str, ...] = ()

    @property
    def packages(self) -> tuple[str, ...]:
        kernel = () if self.kernel_suite else (self.kernel,)
        return (*BASE_PACKAGES, *kernel, *self.extra_packages)

    def key(self) -> str:
        """The cache key: the recipe and every file baked into the image."""
        h = hashlib.sha256(repr(self).encode())
        h.update(Path(__file__).read_bytes())
        for f in sorted((HERE / "guest").glob("*")):
            if f.name in BAKED_FILES:
                h.update(f.name.encode() + f.read_bytes())
        h.update(CA_BUNDLE.read_bytes() if CA_BUNDLE.exists() else b"")
        return h.hexdigest()[:12]


GUESTS = {
    # Debian 12: systemd 252, kernel 6.1 (the generic kernel: the cloud one lacks 9p), cgroup v2
    # only. What most users run.
    "debian12": Guest(name="debian12", suite="bookworm", kernel="linux-image-amd64"),
    # Debian 12's userland (jaild needs Python >= 3.11; Debian 11 has 3.9) on Debian 11's
    # kernel, 5.10: the older cgroup v2 of many hosts still running (no memory.peak, no
    # pids.peak, no cgroup.kill before 5.14).
    "kernel510": Guest(name="kernel510", suite="bookworm", kernel="linux-image-amd64",
                       kernel_suite="bullseye"),
}

# Files from hosts/guest/ copied into the image (the rest are per-run, on the 9p share).
BAKED_FILES = {"jaild-hosts.service"}


WHEELHOUSE = "/var/cache/jaild-wheels"  # in the guest
# debootstrap resolves no virtual package: what provides podman's container-network-stack
CONTAINER_STACK = ("containernetworking-plugins",)
PROVISION_FILES = ("Makefile", "pyproject.toml", "jaild/envs.py")  # and envs/*.txt


@dataclass(frozen=True)
class Provision:
    """What a provisioned image carries, read from a commit of the checkout (module doc)."""

    repo: Path
    commit: str
    apt_packages: tuple[str, ...]
    venv_extras: str
    env_names: tuple[str, ...]
    digest: str  # of the files the environments come from, at ``commit``
    containers: bool = False  # with the container tests' packages too (IMAGE_PACKAGES)

    @classmethod
    def of_commit(cls, repo: Path, commit: str, *, containers: bool = False) -> Provision:
        """What ``commit`` asks to be provisioned; ``containers``: also what the container
        tests run with (``make image-packages``: podman, skopeo, runc, mmdebstrap)."""
        def show(path: str) -> bytes:
            return subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"],
                                  check=True, capture_output=True).stdout

        envs = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", commit,
                               "envs/"], check=True, capture_output=True, text=True).stdout
        env_files = sorted(f for f in envs.split() if f.endswith(".txt"))
        h = hashlib.sha256()
        for f in (*PROVISION_FILES, *env_files):
            h.update(f.encode() + b"\0" + show(f) + b"\0")
        wanted = ["APT_PACKAGES", "VENV_EXTRAS", *(["IMAGE_PACKAGES"] if containers else [])]
        made = subprocess.run(
            ["make", "-s", "--no-print-directory", "-f", "-",
             *(f"print-{v}" for v in wanted)], input=show("Makefile"), capture_output=True,
            check=False
        )
        printed = made.stdout.decode().splitlines()
        if made.returncode != 0 or len(printed) != len(wanted) or not printed[0].split():
            raise RuntimeError(f"the Makefile at {commit[:12]} does not print "
                               f"{' and '.join(wanted)} (make print-VAR): {printed!r} "
                               f"{made.stderr.decode().strip()}")
        apt = printed[0].split() + ([*printed[2].split(), *CONTAINER_STACK] if containers
                                    else [])
        if containers:
            h.update(b"containers\0" + printed[2].encode())
        return cls(repo=repo, commit=commit, apt_packages=tuple(apt),
                   venv_extras=printed[1].strip(),
                   env_names=tuple(Path(f).stem for f in env_files),
                   digest=h.hexdigest(), containers=containers)


@contextlib.contextmanager
def _tree(repo: Path, commit: str, into: Path | None = None) -> Iterator[Path]:
    """The files of ``commit`` (``git archive``) in ``into``, or in a temporary directory
    removed on the way out."""
    with contextlib.ExitStack() as stack:
        path = into or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="jaild-hosts-src-")))
        path.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
        yield path


@dataclass(frozen=True)
class Image:
    """A built base image: the disk and the kernel to boot it with."""

    guest: Guest
    directory: Path

    @property
    def disk(self) -> Path:
        return self.directory / "base.img"

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    def ready(self) -> bool:
        return all(p.exists() for p in (self.disk, self.kernel, self.initrd))


def _log(message: str) -> None:
    print(f"[hosts] {message}", file=sys.stderr, flush=True)


class Overdue(RuntimeError):
    """A build step ran past the deadline it was given (the harness's whole-run timeout)."""


# Every build command runs in a mount namespace of its own: what it mounts (debootstrap mounts
# /proc and /sys in the new root; the chroot below, /dev too) never shows in the host's mount
# table -- the hostile suite's leak check compares it, and CI builds the image beside `make
# test` -- and goes with the command, however it ends, so a later rmtree of a stale build can
# never reach into the host's /dev through a mount left behind.
PRIVATE_MOUNTS = ("unshare", "--mount", "--propagation", "private")


def _call(argv: list[str], log: Path, deadline: float | None, what: str,
          env: dict[str, str] | None = None) -> None:
    """Run ``argv`` in a mount namespace of its own (PRIVATE_MOUNTS) with its output appended
    to ``log``; fail naming the log, or, past ``deadline`` (monotonic), kill it and raise
    :class:`Overdue` naming ``what``."""
    timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
    with log.open("ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        # its own process group: debootstrap, dpkg and pip start children, and all go
        proc = subprocess.Popen([*PRIVATE_MOUNTS, *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise Overdue(f"{what} was still running at the deadline; see {log}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if status != 0:  # CI keeps only the harness's output: the log's end goes in the message
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"{what} failed with exit {status}; the end of {log}:\n"
                           + "\n".join(f"    {line}" for line in tail))


def _run(argv: list[str], log: Path, deadline: float | None = None) -> None:
    _call(argv, log, deadline, argv[0])


def _configure(root: Path, guest: Guest) -> None:
    """Everything the harness needs inside the root file system."""
    (root / "etc/hostname").write_text(f"jaild-{guest.name}\n")
    (root / "etc/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 jaild-{guest.name}\n")
    (root / "etc/fstab").write_text(
        "/dev/vda / ext4 rw,errors=remount-ro 0 1\n"
        "hosts /mnt/hosts 9p trans=virtio,version=9p2000.L,msize=1048576,cache=none,"
        "x-systemd.requires=systemd-modules-load.service 0 0\n"
    )
    (root / "mnt/hosts").mkdir(parents=True, exist_ok=True)
    # The 9p transport is a module: kernel 5.10 does not load it when a mount asks for it
    # ("Could not find request transport: virtio"), so it is loaded by modules-load.d and the
    # mount waits for that (x-systemd.requires above; without it the two race).
    (root / "etc/modules-load.d/jaild-hosts.conf").write_text("9p\n9pnet_virtio\n")
    # QEMU's user-mode network: static, so nothing waits on DHCP.
    network = root / "etc/systemd/network/10-qemu.network"
    network.parent.mkdir(parents=True, exist_ok=True)
    network.write_text(
        "[Match]\nName=en* eth*\n\n[Network]\nAddress=10.0.2.15/24\nGateway=10.0.2.2\n"
        "DNS=10.0.2.3\n"
    )
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("nameserver 10.0.2.3\n")
    # The host's CA bundle, for pip (and anything else using HTTPS to the registries).
    if CA_BUNDLE.exists():
        shutil.copyfile(CA_BUNDLE, root / "etc/jaild-hosts-ca.crt")
        (root / "etc/pip.conf").write_text("[global]\ncert = /etc/jaild-hosts-ca.crt\n")
    (root / "etc/apt/apt.conf.d/99jaild-hosts").write_text(
        'Acquire::Check-Valid-Until "false";\nAPT::Install-Recommends "false";\n'
    )
    units = root / "etc/systemd/system"
    shutil.copyfile(HERE / "guest/jaild-hosts.service", units / "jaild-hosts.service")
    wants = units / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for link, target in (
        (wants / "jaild-hosts.service", "/etc/systemd/system/jaild-hosts.service"),
        (wants / "systemd-networkd.service", "/lib/systemd/system/systemd-networkd.service"),
        # the serial console stays an output: a getty there would hang it up
        (units / "serial-getty@ttyS0.service", "/dev/null"),
        (units / "getty@tty1.service", "/dev/null"),
    ):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    # root may log in on the console with no password, for debugging a guest by hand
    subprocess.run(["chroot", str(root), "passwd", "-d", "root"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# In a command's own mount namespace (PRIVATE_MOUNTS): the file systems a chroot needs, then
# the chroot. $1 is the root, the rest the command.
_ENTER_CHROOT = ('set -e; root=$1; shift; mount -t proc proc "$root/proc"; '
                 'mount -t sysfs sysfs "$root/sys"; mount --rbind /dev "$root/dev"; '
                 'exec chroot "$root" "$@"')


@contextlib.contextmanager
def _chroot(root: Path, log: Path, deadline: float | None = None
            ) -> Iterator[Callable[..., None]]:
    """``root`` ready for commands run natively in it, with the host's resolver for the
    network; yields ``run(argv, env=...)``, which runs one with /proc, /sys and /dev mounted
    in its own mount namespace and fails naming the log. The guest's resolver is put back on
    the way out."""
    resolv = root / "etc/resolv.conf"
    guest_resolv = resolv.read_bytes() if resolv.exists() else None
    try:
        resolv.unlink(missing_ok=True)
        shutil.copyfile("/etc/resolv.conf", resolv)
        base = {"DEBIAN_FRONTEND": "noninteractive", "HOME": "/root", "LANG": "C.UTF-8",
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

        def run(argv: list[str], env: dict[str, str] | None = None) -> None:
            _call(["sh", "-c", _ENTER_CHROOT, "sh", str(root), *argv], log, deadline,
                  f"{' '.join(argv[:4])} (in the guest's chroot)", env={**base, **(env or {})})

        yield run
    finally:
        resolv.unlink(missing_ok=True)
        if guest_resolv is not None:
            resolv.write_bytes(guest_resolv)


def _install_kernel(root: Path, guest: Guest, log: Path, deadline: float | None) -> None:
    """The kernel of another Debian release, installed into the root file system."""
    (root / "etc/apt/sources.list.d/kernel.list").write_text(
        f"deb {MIRROR} {guest.kernel_suite} main\n"
    )
    with _chroot(root, log, deadline) as run:
        run(["apt-get", "update", "-q"])
        run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "-t",
             str(guest.kernel_suite), guest.kernel])
    (root / "etc/apt/sources.list.d/kernel.list").unlink()


def _provision(root: Path, provision: Provision, log: Path, deadline: float | None) -> None:
    """The wheelhouse and the jail environments, made natively in the guest's root (module
    doc). The apt packages came with debootstrap."""
    src, venv = "/tmp/jaild-src", "/tmp/jaild-provision"
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": WHEELHOUSE}
    requirements = [a for n in provision.env_names for a in ("-r", f"{src}/envs/{n}.txt")]
    with _tree(provision.repo, provision.commit, into=root / src.lstrip("/")), \
            _chroot(root, log, deadline) as run:
        run(["python3", "-m", "venv", venv])
        pip = [f"{venv}/bin/python", "-m", "pip", "--disable-pip-version-check"]
        run([*pip, "install", "--quiet", "--upgrade", "pip"])
        # every package the venv, `make install` (pip itself, and setuptools and wheel to
        # build jaild) and the jail environments install
        run([*pip, "wheel", "--quiet", "--wheel-dir", WHEELHOUSE, "pip", "setuptools>=68",
             "wheel", f"{src}[{provision.venv_extras}]", *requirements])
        for own in (root / WHEELHOUSE.lstrip("/")).glob("jaild-*.whl"):
            own.unlink()  # jaild itself is what the guest builds from its clone
        # the checkout's own env builder, from the wheelhouse alone
        run([*pip, "install", "--quiet", src], env=offline)
        for name in provision.env_names:
            run([f"{venv}/bin/python", "-m", "jaild", "env", "build", name, "-r",
                 f"{src}/envs/{name}.txt", "--state-dir", "/var/lib/jaild", "--quiet"],
                env=offline)
    for leftover in (src, venv, "/root/.cache/pip"):
        shutil.rmtree(root / leftover.lstrip("/"), ignore_errors=True)
    wheels = sorted(p.name for p in (root / WHEELHOUSE.lstrip("/")).glob("*.whl"))
    (root / "etc/jaild-hosts-provisioned").write_text(
        f"commit {provision.commit}\ndigest {provision.digest}\n"
        f"environments {' '.join(provision.env_names)}\nwheels {len(wheels)}\n"
        + "".join(f"  {w}\n" for w in wheels)
    )


def build(guest: Guest, *, provision: Provision | None = None, force: bool = False,
          deadline: float | None = None) -> Image:
    """The base image of ``guest`` (provisioned: with ``provision``), built if the cache has
    none for its current recipe.

    Raises:
        Overdue: a step was still running at ``deadline`` (``time.monotonic()``); it was
            killed and nothing was cached.
    """
    kind, key = guest.name, guest.key()
    packages = guest.packages
    if provision is not None:
        kind = f"{guest.name}+envs" + ("+containers" if provision.containers else "")
        key = hashlib.sha256(f"{key} {provision.digest}".encode()).hexdigest()[:12]
        packages = tuple(dict.fromkeys((*packages, *provision.apt_packages)))
    image = Image(guest, CACHE_DIR / f"{kind}-{key}")
    if image.ready() and not force:
        _log(f"{kind}: cached image {image.directory}")
        return image
    for tool in ("debootstrap", "mkfs.ext4", "qemu-system-x86_64", "qemu-img"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is missing: apt-get install debootstrap qemu-system-x86 "
                               "qemu-utils e2fsprogs (make test-hosts does)")
    work = image.directory.with_name(image.directory.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work / "build.log"
    root = work / "rootfs"
    started = time.monotonic()
    _log(f"{kind}: debootstrap {guest.suite} (log {log})")
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(packages)}",
            guest.suite,
            str(root),
            MIRROR,
        ],
        log,
        deadline,
    )
    if guest.kernel_suite:
        _install_kernel(root, guest, log, deadline)
    _configure(root, guest)
    if provision is not None:
        t0 = time.monotonic()
        _log(f"{kind}: the wheelhouse and jail environments of {provision.commit[:12]}, "
             "natively in a chroot")
        _provision(root, provision, log, deadline)
        _log(f"{kind}: provisioned in {time.monotonic() - t0:.0f} s")
    boot = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if not boot or not initrds:
        raise RuntimeError(f"{guest.kernel} installed no kernel and initrd in {root}/boot")
    shutil.copyfile(boot[-1], work / "vmlinuz")
    shutil.copyfile(initrds[-1], work / "initrd.img")
    _log(f"{kind}: mkfs.ext4 -d ({guest.disk_gb} GiB, sparse)")
    _run(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(root), str(work / "base.img"),
          f"{guest.disk_gb}G"], log, deadline)
    shutil.rmtree(root)
    os.chmod(work / "base.img", 0o444)
    shutil.rmtree(image.directory, ignore_errors=True)
    work.rename(image.directory)
    # older images of this kind are stale: drop them
    for old in CACHE_DIR.glob(f"{kind}-*"):
        if old != image.directory and not old.name.endswith(".building"):
            shutil.rmtree(old, ignore_errors=True)
    _log(f"{kind}: image built in {time.monotonic() - started:.0f} s")
    return image
