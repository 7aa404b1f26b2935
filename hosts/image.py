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
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
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


def _run(argv: list[str], log: Path) -> None:
    with log.open("ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed with exit {proc.returncode}; see {log}")


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


def _install_kernel(root: Path, guest: Guest, log: Path) -> None:
    """The kernel of another Debian release, installed into the root file system."""
    (root / "etc/apt/sources.list.d/kernel.list").write_text(
        f"deb {MIRROR} {guest.kernel_suite} main\n"
    )
    mounts = []
    try:
        for fs, where in (("proc", "proc"), ("sysfs", "sys"), ("devtmpfs", "dev")):
            subprocess.run(["mount", "-t", fs, fs, str(root / where)], check=True)
            mounts.append(root / where)
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        for argv in (["apt-get", "update", "-q"],
                     ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-t",
                      guest.kernel_suite, guest.kernel]):
            with log.open("ab") as out:
                done = subprocess.run(["chroot", str(root), *argv], stdout=out,
                                      stderr=subprocess.STDOUT, env=env, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"installing {guest.kernel} from {guest.kernel_suite} "
                                   f"failed; see {log}")
    finally:
        for where in reversed(mounts):
            subprocess.run(["umount", "-l", str(where)], check=False)
    (root / "etc/apt/sources.list.d/kernel.list").unlink()


def build(guest: Guest, *, force: bool = False) -> Image:
    """The base image of ``guest``, built if the cache has none for its current recipe."""
    image = Image(guest, CACHE_DIR / f"{guest.name}-{guest.key()}")
    if image.ready() and not force:
        _log(f"{guest.name}: cached image {image.directory}")
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
    _log(f"{guest.name}: debootstrap {guest.suite} (log {log})")
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(guest.packages)}",
            guest.suite,
            str(root),
            MIRROR,
        ],
        log,
    )
    if guest.kernel_suite:
        _install_kernel(root, guest, log)
    _configure(root, guest)
    boot = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if not boot or not initrds:
        raise RuntimeError(f"{guest.kernel} installed no kernel and initrd in {root}/boot")
    shutil.copyfile(boot[-1], work / "vmlinuz")
    shutil.copyfile(initrds[-1], work / "initrd.img")
    _log(f"{guest.name}: mkfs.ext4 -d ({guest.disk_gb} GiB, sparse)")
    _run(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(root), str(work / "base.img"),
          f"{guest.disk_gb}G"], log)
    shutil.rmtree(root)
    os.chmod(work / "base.img", 0o444)
    shutil.rmtree(image.directory, ignore_errors=True)
    work.rename(image.directory)
    # older images of this guest are stale: drop them
    for old in CACHE_DIR.glob(f"{guest.name}-*"):
        if old != image.directory and not old.name.endswith(".building"):
            shutil.rmtree(old, ignore_errors=True)
    _log(f"{guest.name}: image built in {time.monotonic() - started:.0f} s")
    return image
