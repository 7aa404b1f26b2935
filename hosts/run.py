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

Three profiles (``--profile``, :data:`PROFILES`) set what a run is for:

* ``full`` (``make test-hosts``): a fresh machine -- the base image, everything ``make``
  installs fetched from the network under emulation, the whole suite. Hours under TCG; run by
  hand before claiming real-host work.
* ``ci`` (``.ci/run``, on every landing): what only a real host proves, within CI's budget. The
  image is provisioned (:class:`image.Provision`: the checkout's apt packages, a wheelhouse and
  the jail environments, built natively on the host), the guest has no network device at all,
  so nothing can wait on a network, and its pip installs from the wheelhouse. There is no
  ``test`` step: the jail tests it keeps (a job per status, usage from v2's counters, a cgroup
  and uid per job, forked and spawned) run through the installed service, with the service
  checks (``hosts/checks/test_jobs.py``).
* ``containers``: the container and pod-identity tests on v2 under systemd, offline: the
  image is provisioned with podman too, and the container image built here (``make image``,
  cached) travels on the share; the tests load it instead of building their own.

Guard rails. Each step has a budget in the profile: ``steps.sh`` runs it under ``timeout``
and records ``timeout`` for one that trips it, and the steps after it still run. The whole
run has ``--timeout-min``; when that trips, the harness names the step that was running (the
guest writes it to ``current`` as each starts), how long it had run, and the end of its log.

Nothing is left running: QEMU is killed on every exit path, including SIGINT/SIGTERM, and the
run directory is removed unless ``--keep``. The guest's network is QEMU's user-mode NAT: it
reaches what the host reaches (the package registries) and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import image

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KVM_PROBE_S = 15.0  # a KVM guest starts systemd in ~3 s; here nested KVM hangs (docs/running/ci.md)
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
    # jaild as a container's main process and pods as tenants, on v2 under systemd
    "containers": "tests/integration/test_container.py tests/integration/test_pod_identity.py "
                  "tests/integration/test_pods_container.py",
    "none": "-",
}


STEPS = ("clone", "demo", "test", "install", "socket", "installed-job", "doctor", "service")


@dataclass(frozen=True)
class Profile:
    """What a guest run is for: its steps and suite, its image, its time (module doc)."""

    steps: tuple[str, ...]  # of STEPS (--steps overrides)
    suite: str  # a key of SUITES: what the `test` step runs
    provisioned: bool  # image.Provision'ed, and no network device: everything offline
    timeout_min: float  # the whole run, build to power-off (--timeout-min overrides)
    budgets_s: dict[str, int]  # a step's own limit, in the guest; absent: none
    # the container image (`make image`, built here) on the share, podman in the guest: the
    # container tests load that archive instead of building one (tests/conftest.py: ImageBuild)
    containers: bool = False
    # the `test` step: `make test` with the suite, or these make targets and then pytest
    target: str = "test"


PROFILES = {
    "full": Profile(steps=STEPS, suite="full", provisioned=False, timeout_min=300,
                    budgets_s={}, containers=True),
    # The container and pod-identity tests on v2 under systemd (issue 26), offline: the image
    # is provisioned with podman and the rest of `make image-packages`; `make setup
    # image-packages` and pytest run them (`make test` would also want the manifests' tools
    # venv, which is no part of these). Budgets: the step ran 1,8xx s here under TCG.
    "containers": Profile(steps=("clone", "test"), suite="containers", provisioned=True,
                          timeout_min=150, budgets_s={"clone": 120, "test": 6000},
                          containers=True, target="setup image-packages"),
    # No `test` step: the jail tests CI keeps run through the installed service, in the
    # service checks (hosts/checks/test_jobs.py). Budgets: at least 2.5x each step's time
    # measured under `stress-ng --cpu 1` (docs/running/ci.md) -- room for a machine 2.8x slower at
    # emulation -- and short enough that a step that hangs is named while the run still has
    # time for the steps after it.
    "ci": Profile(steps=tuple(s for s in STEPS if s != "test"), suite="none", provisioned=True,
                  timeout_min=50, budgets_s={
                      "clone": 120, "demo": 900, "install": 600, "socket": 120,
                      "installed-job": 300, "doctor": 300, "service": 1200,
                  }),
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
              cpu_model: str | None = None, network: bool = True) -> list[str]:
    cpu = ["-cpu", cpu_model or ("host" if accel == "kvm" else TCG_CPU)]
    # user-mode NAT: the guest reaches what the host reaches; without it, no device at all,
    # so a connect or a name lookup fails at once (ENETUNREACH) instead of waiting
    nic = ["-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0"] if network else []
    return [
        "qemu-system-x86_64",
        "-accel", accel, *cpu,
        "-smp", str(cpus), "-m", str(memory_mb),
        "-nodefaults", "-no-reboot", "-display", "none", "-monitor", "none",
        "-kernel", str(img.kernel), "-initrd", str(img.initrd),
        "-append", "console=ttyS0 root=/dev/vda rw panic=-1 systemd.show_status=1",
        "-drive", f"file={run / 'disk.qcow2'},if=virtio,format=qcow2,cache=unsafe",
        *nic,
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
    cpu_model: str | None = None, network: bool = True
) -> tuple[Guest, str]:
    """Boot the guest; with ``accel="auto"`` try KVM, and fall back to TCG if it hangs."""
    order = ["kvm", "tcg"] if accel == "auto" and kvm_usable() else [
        "tcg" if accel == "auto" else accel]
    for i, name in enumerate(order):
        (run / "console.log").unlink(missing_ok=True)
        guest = Guest(qemu_argv(img, run, accel=name, memory_mb=memory_mb, cpus=cpus,
                                cpu_model=cpu_model, network=network),
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
    shutil.copyfile(HERE / "guest/lib.sh", share / "lib.sh")
    shutil.copytree(HERE / "checks", share / "checks")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    suite = " ".join(args.tests) if args.tests else SUITES[args.suite]
    budgets = " ".join(f"{step}={s}" for step, s in args.profile.budgets_s.items())
    (share / "config.env").write_text(
        f"COMMIT={commit}\nSUITE={suite!r}\nSTEPS={' '.join(args.steps)!r}\n"
        f"OFFLINE={int(args.profile.provisioned)}\nBUDGETS={budgets!r}\n"
        f"TEST_TARGET={args.profile.target!r}\n"
    )
    if args.profile.containers:
        # the image the container tests run: this checkout's (its tracked files as they are
        # in the work tree), built or found in make image's cache, loaded by the tests
        subprocess.run([sys.executable, str(REPO / "image" / "build.py"), "--no-load"],
                       check=True, stdout=sys.stderr)
        shutil.copyfile(REPO / "build" / "jaild-image.oci.tar", share / "jaild-image.oci.tar")
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


def head_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


class Watch:
    """What the guest has reported so far, read from its share as it runs: each step's result
    (``results.tsv``) and the step running now (``current``, written as each step starts),
    with host times. It logs each news once."""

    def __init__(self, share: Path, name: str, budgets_s: dict[str, int]) -> None:
        self.share, self.name, self.budgets_s = share, name, budgets_s
        self.rows: list[tuple[str, str, str]] = []
        self.current: str | None = None
        self.current_since = 0.0
        self.first_step_at: float | None = None
        self.finished_at: float | None = None

    def poll(self, now: float) -> None:
        try:
            current = (self.share / "current").read_text().strip() or None
        except OSError:
            current = None
        rows = read_results(self.share)
        for step, status, seconds in rows[len(self.rows):]:
            log(f"{self.name}: {step:<28} {status:<7} {float(seconds):8.1f} s")
        self.rows = rows
        if current != self.current and current is not None:
            self.current, self.current_since = current, now
            if self.first_step_at is None:
                self.first_step_at = now
        if self.finished_at is None and self.done:
            self.finished_at = now

    @property
    def done(self) -> bool:
        return any(step == "finished" for step, _, _ in self.rows)

    @property
    def failed(self) -> list[str]:
        return [step for step, status, _ in self.rows if status != "pass"]

    def running(self) -> str | None:
        """The step that started and has not reported."""
        ended = {step for step, _, _ in self.rows}
        return self.current if self.current and self.current not in ended else None

    def overdue(self, now: float, timeout_min: float) -> list[str]:
        """What to say when the whole run's time is up: the step running and how long it ran."""
        step = self.running()
        if step is None:
            return [f"TIMEOUT after {timeout_min:g} min, between steps (none was running)"]
        budget = self.budgets_s.get(step)
        return [f"TIMEOUT after {timeout_min:g} min in step '{step}', which had run "
                f"{now - self.current_since:.0f} s"
                + (f" of its {budget} s budget" if budget else "")
                + "; the steps after it did not run"]


def build_image(name: str, args: argparse.Namespace, deadline: float) -> image.Image | None:
    """The guest's image for the run's profile; None (said why) if it overran ``deadline``."""
    provision = (image.Provision.of_commit(REPO, head_commit(),
                                           containers=args.profile.containers)
                 if args.profile.provisioned else None)
    try:
        return image.build(image.GUESTS[name], provision=provision, force=args.rebuild,
                           deadline=deadline)
    except image.Overdue as exc:
        log(f"{name}: TIMEOUT after {args.timeout_min:g} min in the image build: {exc}")
        return None


def build_only(name: str, args: argparse.Namespace) -> bool:
    started = time.monotonic()
    built = build_image(name, args, started + args.timeout_min * 60)
    log(f"{name}: image {'ready' if built else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return built is not None


def run_guest(name: str, args: argparse.Namespace) -> bool:
    started = time.monotonic()
    deadline = started + args.timeout_min * 60
    profile: Profile = args.profile
    built = build_image(name, args, deadline)
    if built is None:
        log(f"{name}: FAIL in {time.monotonic() - started:.0f} s")
        return False
    args.image = built
    image_s = time.monotonic() - started
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix=f"jaild-hosts-{name}-", dir=base))
    out = Path(args.out) / name
    guest: Guest | None = None
    try:
        prepare_run(run, args)
        booting = time.monotonic()
        guest, accel = boot(args.image, run, accel=args.accel, memory_mb=args.memory_mb,
                            cpus=args.cpus, cpu_model=args.cpu_model,
                            network=not profile.provisioned)
        (run / "share" / "accel").write_text(f"{accel}\n")
        log(f"{name}: booted with {accel} ({args.cpus} vCPUs, {args.memory_mb} MiB, "
            f"{'no network' if profile.provisioned else 'user-mode network'}); "
            f"logs in {run / 'share'}, console {run / 'console.log'}")
        watch = Watch(run / "share", name, profile.budgets_s)
        why_stopped: list[str] = []
        while guest.proc.poll() is None:
            time.sleep(2)
            now = time.monotonic()
            watch.poll(now)
            if now >= deadline:
                why_stopped = watch.overdue(now, args.timeout_min)
                break
            if watch.finished_at is not None and now - watch.finished_at > POWEROFF_S:
                log(f"{name}: the guest did not power off {POWEROFF_S:.0f} s after its steps")
                break
            if watch.first_step_at is None and now - booting > FIRST_STEP_S:
                why_stopped = [f"no step started within {FIRST_STEP_S:.0f} s of boot: the "
                               f"guest failed to come up (see {run / 'console.log'})"]
                break
        guest.stop()
        watch.poll(time.monotonic())
        boot_s = (watch.first_step_at or time.monotonic()) - booting
        total = time.monotonic() - started
        for line in why_stopped:
            log(f"{name}: {line}")
        if not why_stopped and not watch.done:
            log(f"{name}: the guest stopped before its steps finished (see console.log)")
        # CI shows this output only: name what failed, and what was running, here
        for step in [*watch.failed, *([watch.running()] if why_stopped else [])]:
            if step:
                for line in failure_excerpt(run / "share", step):
                    log(f"{name}: {line}")
        ok = watch.done and not watch.failed and not why_stopped
        summary = "PASS" if ok else "FAIL"
        log(f"{name}: image {image_s:.0f} s, boot to the first step {boot_s:.0f} s, steps "
            + ", ".join(f"{step} {float(sec):.0f} s" for step, _, sec in watch.rows
                        if step != "finished"))
        log(f"{name}: {summary} in {total:.0f} s with {accel}"
            + (f"; failed: {' '.join(watch.failed)}" if watch.failed else ""))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in (run / "share").iterdir():
            if f.name not in ("jaild.bundle", "checks", "guest.sh", "lib.sh",
                              "jaild-image.oci.tar") and f.is_file():
                shutil.copy(f, out / f.name)
        for f in ("console.log", "qemu.log"):
            if (run / f).exists():
                shutil.copy(run / f, out / f)
        with (out / "summary.tsv").open("w") as s:
            s.write(f"# guest {name}, profile {args.profile_name}, accel {accel}, commit in "
                    f"config.env, total {total:.0f} s, {summary}\n")
            s.write(f"image\t{'built' if image_s > 60 else 'cached'}\t{image_s:.0f}\n")
            s.write(f"boot\tpass\t{boot_s:.0f}\n")
            for row in watch.rows:
                s.write("\t".join(row) + "\n")
        log(f"{name}: logs copied to {out}")
        return ok
    finally:
        if guest is not None:
            guest.stop()
        if args.keep:
            log(f"{name}: kept {run}")
        else:
            shutil.rmtree(run, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guest", action="append", choices=sorted(image.GUESTS),
                   help="a guest to run (repeatable; default: debian12)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="full",
                   help="full: a fresh machine, the whole suite (default); ci: CI's bounded "
                   "run, offline from a provisioned image; containers: the container and "
                   "pod-identity tests, offline")
    p.add_argument("--suite", choices=sorted(SUITES),
                   help="what `make test` runs in the guest (default: the profile's)")
    p.add_argument("--target",
                   help="the make targets the test step runs before pytest runs the suite "
                        "(default: the profile's; `setup` runs offline in a provisioned guest)")
    p.add_argument("--tests", nargs="+", metavar="PATH",
                   help="test paths (pytest node ids) to run instead of --suite")
    p.add_argument("--steps", nargs="+", choices=STEPS,
                   help="the steps to run, in their fixed order (default: the profile's)")
    p.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--cpu-model", help=f"QEMU's -cpu (default: host under KVM, {TCG_CPU} under "
                   "TCG)")
    p.add_argument("--memory-mb", type=int, default=6144)
    p.add_argument("--timeout-min", type=float,
                   help="the whole run, image build included (default: the profile's)")
    p.add_argument("--out", default=str(REPO / "hosts" / "logs"))
    p.add_argument("--workdir", default="/var/tmp", help="where run directories are made")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--rebuild", action="store_true", help="rebuild the base image")
    p.add_argument("--build-only", action="store_true",
                   help="build (or find cached) the profile's image of each guest, and stop")
    # for working on a guest failure: another steps script, and a disk a run left (setup done)
    p.add_argument("--script", help=argparse.SUPPRESS)
    p.add_argument("--disk", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.profile_name = args.profile
    args.profile = PROFILES[args.profile]
    if args.target:
        args.profile = dataclasses.replace(args.profile, target=args.target)
    args.suite = args.suite or args.profile.suite
    args.steps = args.steps or list(args.profile.steps)
    args.timeout_min = args.timeout_min or args.profile.timeout_min
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
            ok = (build_only(name, args) if args.build_only else run_guest(name, args)) and ok
    except KeyboardInterrupt:
        log("interrupted: guest stopped, run directory removed")
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
