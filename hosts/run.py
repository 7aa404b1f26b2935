#!/usr/bin/env python3
"""make test-hosts: jaild on real hosts -- Debian guests with systemd and cgroup v2, under QEMU.

Theory of operation
-------------------
For each guest (``--guest``, default every one in :data:`image.GUESTS`) this script

1. builds or reuses the guest's base image (:mod:`image`: debootstrap, cached by recipe);
2. makes a run directory holding a git bundle of the current commit, the guest-side steps
   (``hosts/guest/steps.sh``) and the service checks (``hosts/checks/``); the guest mounts
   it over 9p at ``/mnt/hosts`` and writes its logs and results back into it;
3. boots the guest on a throw-away qcow2 overlay, with KVM if a guest really runs under it
   (a KVM boot that has not started systemd within ``KVM_PROBE_S`` is abandoned) and TCG
   otherwise;
4. waits for the guest to power itself off (its ``jaild-hosts.service`` does, when the steps
   end) or for ``--timeout-min``, prints each step's result and time, copies the logs to
   ``--out``, and exits non-zero if any step failed or never reported.

Inside the guest, ``steps.sh`` acts as a new user would: clone the commit into a 0700
directory, ``make demo``, ``make test`` (or a part of the suite, ``--suite``), ``make
install``, ``systemctl enable --now jaild.socket``, a job through ``/run/jaild/jaild.sock`` with
the installed client, ``jaild doctor``, then the systemd checks (``hosts/checks``).

Nothing is left running: QEMU is killed on every exit path, including SIGINT/SIGTERM, and the
run directory is removed unless ``--keep``. The guest's network is QEMU's user-mode NAT: it
reaches what the host reaches (the package registries) and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import image

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KVM_PROBE_S = 30.0  # a KVM guest starts systemd in ~3 s
FIRST_STEP_S = 900.0  # boot to the first step's result (clone) under TCG: ~1 min
POWEROFF_S = 120.0
SUITES = {
    # what `make test` runs in the guest
    "full": "",
    # the suites that start jails, where v1 and v2 differ; the unit suite runs on the host
    "jails": "tests/integration tests/hostile",
    # what an older kernel's cgroup files change: every status, usage, isolation, fresh jails
    "kernel": "tests/integration/test_statuses.py tests/integration/test_usage.py "
              "tests/integration/test_isolation.py tests/integration/test_fresh_jails.py",
    "none": "-",
}


# Under TCG the guest's CPU is QEMU's "max" without its VEX extensions. QEMU 7.2 (Debian 12's)
# is the first to emulate AVX/AVX2, and gets some of it wrong: in a Debian 12 guest numpy 2.4's
# AVX2 argsort (x86-simd-sort) returned a wrong order for 10 int64s on every try, and a `data`
# job died of a general protection fault in the same code; with these extensions off, 12 of 12
# tries were right (2026-11-24). numpy's baseline, x86-64-v2, stays.
TCG_CPU = "max,avx=off,avx2=off,fma=off,f16c=off"


def log(message: str) -> None:
    print(f"[hosts] {message}", file=sys.stderr, flush=True)


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def qemu_argv(img: image.Image, run: Path, *, accel: str, memory_mb: int, cpus: int,
              cpu_model: str | None = None) -> list[str]:
    cpu = ["-cpu", cpu_model or ("host" if accel == "kvm" else TCG_CPU)]
    return [
        "qemu-system-x86_64",
        "-accel", accel, *cpu,
        "-smp", str(cpus), "-m", str(memory_mb),
        "-nodefaults", "-no-reboot", "-display", "none", "-monitor", "none",
        "-kernel", str(img.kernel), "-initrd", str(img.initrd),
        "-append", "console=ttyS0 root=/dev/vda rw panic=-1 systemd.show_status=1",
        "-drive", f"file={run / 'disk.qcow2'},if=virtio,format=qcow2,cache=unsafe",
        "-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
        "-virtfs", f"local,path={run / 'share'},mount_tag=hosts,security_model=none,id=hosts",
        "-serial", f"file:{run / 'console.log'}",
        "-device", "virtio-rng-pci",
    ]


class Guest:
    """One booted guest; :meth:`stop` kills QEMU (idempotent)."""

    def __init__(self, argv: list[str], console: Path) -> None:
        self.console = console
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=(console.parent / "qemu.log").open("wb"),
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def reached_userspace(self) -> bool:
        """Has the guest's init started? (Here, under nested KVM, the kernel prints its first
        line of real-mode setup, "Probing EDD", and then hangs: output alone proves nothing.)"""
        try:
            return b"systemd[1]" in self.console.read_bytes() or \
                b"Welcome to" in self.console.read_bytes()
        except OSError:
            return False


def boot(
    img: image.Image, run: Path, *, accel: str, memory_mb: int, cpus: int,
    cpu_model: str | None = None
) -> tuple[Guest, str]:
    """Boot the guest; with ``accel="auto"`` try KVM, and fall back to TCG if it hangs."""
    order = ["kvm", "tcg"] if accel == "auto" and kvm_usable() else [
        "tcg" if accel == "auto" else accel]
    for i, name in enumerate(order):
        (run / "console.log").unlink(missing_ok=True)
        guest = Guest(qemu_argv(img, run, accel=name, memory_mb=memory_mb, cpus=cpus,
                                cpu_model=cpu_model),
                      run / "console.log")
        if i == len(order) - 1:
            return guest, name
        deadline = time.monotonic() + KVM_PROBE_S
        while time.monotonic() < deadline and guest.proc.poll() is None and \
                not guest.reached_userspace():
            time.sleep(0.5)
        if guest.reached_userspace() and guest.proc.poll() is None:
            return guest, name
        log(f"{name}: the guest did not reach its init in {KVM_PROBE_S:.0f} s; falling back")
        guest.stop()
    raise AssertionError("unreachable")


def prepare_run(run: Path, args: argparse.Namespace) -> None:
    share = run / "share"
    share.mkdir(parents=True)
    subprocess.run(["git", "-C", str(REPO), "bundle", "create", str(share / "jaild.bundle"),
                    "HEAD"], check=True, capture_output=True)
    shutil.copyfile(args.script or HERE / "guest/steps.sh", share / "guest.sh")
    shutil.copytree(HERE / "checks", share / "checks")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    suite = " ".join(args.tests) if args.tests else SUITES[args.suite]
    (share / "config.env").write_text(
        f"COMMIT={commit}\nSUITE={suite!r}\nSTEPS={' '.join(args.steps)!r}\n"
    )
    # the accelerator is only known at boot: steps.sh reads it from here when it runs
    (share / "accel").write_text("unknown\n")
    (share / "results.tsv").write_text("")
    disk, fmt = (args.disk, "qcow2") if args.disk else (args.image.disk, "raw")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", fmt, "-b",
                    str(disk), str(run / "disk.qcow2")], check=True)


def read_results(share: Path) -> list[tuple[str, str, str]]:
    rows = []
    for line in (share / "results.tsv").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            rows.append((parts[0], parts[1], parts[2]))
    return rows


JUNIT = {"test": "junit.xml", "service": "junit-service.xml"}
EXCERPT_LINES = 40


def failure_excerpt(share: Path, step: str) -> list[str]:
    """What a failed step's logs say, for the harness's own output (CI keeps only that): the
    failed tests of its JUnit file, then the last lines of its log."""
    lines: list[str] = []
    junit = share / JUNIT.get(step, "")
    if step in JUNIT and junit.is_file():
        import xml.etree.ElementTree as ET

        try:
            for case in ET.parse(junit).getroot().iter("testcase"):
                bad = case.find("failure")
                if bad is None:
                    bad = case.find("error")
                if bad is not None:
                    why = (bad.get("message") or "").splitlines()[:1]
                    lines.append(f"FAILED {case.get('classname')}::{case.get('name')}"
                                 + (f": {why[0][:300]}" if why else ""))
        except (ET.ParseError, OSError) as exc:
            lines.append(f"(cannot read {junit.name}: {exc})")
    log_file = share / f"{step}.log"
    if log_file.is_file():
        tail = log_file.read_text(errors="replace").splitlines()[-EXCERPT_LINES:]
        lines += [f"{step}.log: {line}" for line in tail]
    return lines


def run_guest(name: str, args: argparse.Namespace) -> bool:
    guest_recipe = image.GUESTS[name]
    args.image = image.build(guest_recipe, force=args.rebuild)
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix=f"jaild-hosts-{name}-", dir=base))
    out = Path(args.out) / name
    guest: Guest | None = None
    started = time.monotonic()
    try:
        prepare_run(run, args)
        guest, accel = boot(args.image, run, accel=args.accel, memory_mb=args.memory_mb,
                            cpus=args.cpus, cpu_model=args.cpu_model)
        (run / "share" / "accel").write_text(f"{accel}\n")
        log(f"{name}: booted with {accel} ({args.cpus} vCPUs, {args.memory_mb} MiB); "
            f"logs in {run / 'share'}, console {run / 'console.log'}")
        deadline = started + args.timeout_min * 60
        booted = time.monotonic()
        reported = 0
        finished_at: float | None = None
        while guest.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(2)
            rows = read_results(run / "share")
            for step, status, seconds in rows[reported:]:
                log(f"{name}: {step:<28} {status:<5} {float(seconds):8.1f} s")
            reported = len(rows)
            if finished_at is None and any(step == "finished" for step, _, _ in rows):
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > POWEROFF_S:
                log(f"{name}: the guest did not power off {POWEROFF_S:.0f} s after its steps")
                break
            if not rows and time.monotonic() - booted > FIRST_STEP_S:
                log(f"{name}: no step started within {FIRST_STEP_S:.0f} s of boot: the guest "
                    f"failed to come up (see {run / 'console.log'})")
                break
        timed_out = guest.proc.poll() is None and finished_at is None
        guest.stop()
        rows = read_results(run / "share")
        for step, status, seconds in rows[reported:]:
            log(f"{name}: {step:<28} {status:<5} {float(seconds):8.1f} s")
        done = any(step == "finished" for step, _, _ in rows)
        failed = [step for step, status, _ in rows if status != "pass"]
        total = time.monotonic() - started
        if timed_out:
            log(f"{name}: TIMEOUT after {args.timeout_min} min (raise --timeout-min)")
        elif not done:
            log(f"{name}: the guest stopped before its steps finished (see console.log)")
        for step in failed:  # CI shows this output only: name what failed, here
            for line in failure_excerpt(run / "share", step):
                log(f"{name}: {line}")
        summary = "PASS" if done and not failed and not timed_out else "FAIL"
        log(f"{name}: {summary} in {total:.0f} s with {accel}"
            + (f"; failed: {' '.join(failed)}" if failed else ""))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in (run / "share").iterdir():
            if f.name not in ("jaild.bundle", "checks", "guest.sh") and f.is_file():
                shutil.copy(f, out / f.name)
        for f in ("console.log", "qemu.log"):
            if (run / f).exists():
                shutil.copy(run / f, out / f)
        with (out / "summary.tsv").open("w") as s:
            s.write(f"# guest {name}, accel {accel}, commit in config.env, total {total:.0f} s, "
                    f"{summary}\n")
            for row in rows:
                s.write("\t".join(row) + "\n")
        log(f"{name}: logs copied to {out}")
        return summary == "PASS"
    finally:
        if guest is not None:
            guest.stop()
        if args.keep:
            log(f"{name}: kept {run}")
        else:
            shutil.rmtree(run, ignore_errors=True)


STEPS = ("clone", "demo", "test", "install", "socket", "installed-job", "doctor", "service")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guest", action="append", choices=sorted(image.GUESTS),
                   help="a guest to run (repeatable; default: debian12)")
    p.add_argument("--suite", choices=sorted(SUITES), default="full",
                   help="what `make test` runs in the guest (default full)")
    p.add_argument("--tests", nargs="+", metavar="PATH",
                   help="test paths (pytest node ids) to run instead of --suite")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS,
                   help="the steps to run, in their fixed order (default: all)")
    p.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--cpu-model", help=f"QEMU's -cpu (default: host under KVM, {TCG_CPU} under "
                   "TCG)")
    p.add_argument("--memory-mb", type=int, default=6144)
    p.add_argument("--timeout-min", type=float, default=80)
    p.add_argument("--out", default=str(REPO / "hosts" / "logs"))
    p.add_argument("--workdir", default="/var/tmp", help="where run directories are made")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--rebuild", action="store_true", help="rebuild the base image")
    # for working on a guest failure: another steps script, and a disk a run left (setup done)
    p.add_argument("--script", help=argparse.SUPPRESS)
    p.add_argument("--disk", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        log("must run as root (debootstrap, and QEMU's 9p share writes as the guest's users)")
        return 2
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()
    if dirty:
        log("note: uncommitted changes are not tested; the guest clones HEAD")

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    ok = True
    try:
        for name in args.guest or ["debian12"]:
            ok = run_guest(name, args) and ok
    except KeyboardInterrupt:
        log("interrupted: guest stopped, run directory removed")
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
