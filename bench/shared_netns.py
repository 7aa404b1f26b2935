"""What ``network.namespace = "tenant"`` saves a jail, at the kernel: a forked child that
makes a network namespace of its own (``unshare(CLONE_NEWNET)``, as every jail did) against
one that enters a namespace made once (``setns``, as a jail of an opting-in policy does), and
a child that does neither (the fork and exit alone).

Run as root (the daemon's case; a zygote does the same in its own user namespace)::

    .venv/bin/python bench/shared_netns.py [--runs 300] [--rounds 5] [--daemon]

With ``--daemon``, end to end instead: two private daemons, the shipped default policy in
zygote mode with no pool, as shipped (``"jail"``) and sharing (``bench/shared-netns.toml``),
trivial jobs from one client (one tenant) in alternating batches; a jail's CPU is what its
zygote's reaped children used (``cutime + cstime`` of the zygote: every jail it forked,
setup included, and nothing else; the kworker's teardown of a namespace is not in it).

Each round measures every kind back to back, ``runs`` forks each, in a helper process that
imports what a zygote imports (so its forks copy what a zygote's do). Two figures per kind,
per operation: the children's own CPU (``RUSAGE_CHILDREN``: exact, nothing of another
process in it) and the whole machine's (``/proc/stat``, the kernel threads' deferred work
included -- a network namespace is torn down by a kworker, after its last process exits --,
less what the rest of the host did per second just after, over the measurement's length:
noisy on a shared host). The saving is ``own`` less
``shared``; the median of the rounds is printed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
CLONE_NEWNET = 0x40000000
KINDS = {
    "fork": "a fork and an exit",
    "own": "the same, the child unsharing a network namespace of its own",
    "shared": "the same, the child entering one made once (setns)",
}


def _machine_cpu_s() -> float:
    sys.path[:0] = [BENCH]
    from measure import machine_cpu_s

    return machine_cpu_s()


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def helper(runs: int, rounds: int) -> None:
    """In the helper: the zygote's imports, then ``rounds`` x every kind x ``runs``."""
    from jaild.runtime import zygote

    for name in zygote._RUNTIME_MODULES:
        importlib.import_module(name)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fork = ctypes.PyDLL("libc.so.6", use_errno=True).fork
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise SystemExit(f"unshare: {os.strerror(ctypes.get_errno())}")
    shared = os.open("/proc/self/ns/net", os.O_RDONLY)
    libc.setns(own, CLONE_NEWNET)
    gc.freeze()
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            time.sleep(0.3)
            machine, children, began = _machine_cpu_s(), _children_cpu_s(), time.monotonic()
            for _ in range(runs):
                pid = fork()
                if pid == 0:
                    if kind == "own" and libc.unshare(CLONE_NEWNET) != 0:
                        os._exit(3)
                    if kind == "shared" and libc.setns(shared, CLONE_NEWNET) != 0:
                        os._exit(4)
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                if status != 0:
                    raise SystemExit(f"{kind}: the child failed ({status})")
            time.sleep(0.5)  # deferred work (network namespaces torn down) in kworkers
            child_s = _children_cpu_s() - children
            before_idle, elapsed = _machine_cpu_s(), time.monotonic() - began
            time.sleep(0.5)
            others = (_machine_cpu_s() - before_idle) / 0.5  # what the rest of the host does
            machine_s = before_idle - machine - others * elapsed
            results[kind].append((child_s / runs, machine_s / runs))
    print(json.dumps(results))


def _zygote_of(daemon_pid: int) -> int:
    """The zygote process below the daemon (its nsjail's child)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    for pid, parent in parents.items():
        if parents.get(parent) == daemon_pid:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"jaild.runtime.zygote" in f.read():
                    return pid
    raise SystemExit(f"no zygote below the daemon {daemon_pid}")


def _reaped_cpu_s(zygote: int) -> float:
    with open(f"/proc/{zygote}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def daemon_rows(rounds: int, jobs: int) -> dict[str, list[float]]:
    """ms of CPU per jail, per round, for each of the two policies (see the docstring)."""
    from pathlib import Path

    sys.path[:0] = [BENCH]
    from jaildrun import PrivateDaemon, Variant

    from jaild.client import Client

    variants = {
        "own": Variant("netns_jail", 'network.namespace = "jail"', "zygote", 0, 0),
        "shared": Variant("netns_tenant", 'network.namespace = "tenant"', "zygote", 0, 0,
                          base=Path(BENCH) / "shared-netns.toml"),
    }
    used: dict[str, list[float]] = {kind: [] for kind in variants}
    with PrivateDaemon(variants["own"]) as own, PrivateDaemon(variants["shared"]) as shared:
        daemons = {"own": own, "shared": shared}
        clients = {kind: Client(d.socket) for kind, d in daemons.items()}
        try:
            zygotes: dict[str, int] = {}
            for kind, client in clients.items():
                for _ in range(20):  # past the first jobs (spawned while the zygote starts)
                    client.run("1", policy=daemons[kind].policy)
                zygotes[kind] = _zygote_of(daemons[kind].pid)
            for _ in range(rounds):
                for kind, client in clients.items():
                    before = _reaped_cpu_s(zygotes[kind])
                    for _ in range(jobs):
                        r = client.run("1", policy=daemons[kind].policy)
                        if r.status != "ok":
                            raise SystemExit(f"{kind}: {r.status} {r.error}")
                    time.sleep(0.3)  # the last jail reaped
                    used[kind].append((_reaped_cpu_s(zygotes[kind]) - before) / jobs * 1e3)
        finally:
            for client in clients.values():
                client.close()
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--daemon", action="store_true", help="end to end, through jaild")
    args = parser.parse_args()
    if args.daemon:
        rows = daemon_rows(args.rounds, args.runs)
        for kind, values in rows.items():
            print(f"{kind}: ms of CPU per jail, median {statistics.median(values):.2f} "
                  f"({', '.join(f'{v:.1f}' for v in values)})")
        saved = statistics.median(rows["own"]) - statistics.median(rows["shared"])
        print(f"saved per jail by sharing: {saved:.2f} ms")
        return
    code = (f"import sys; sys.path[:0] = [{BENCH!r}, {os.path.dirname(BENCH)!r}]; "
            f"import shared_netns; shared_netns.helper({args.runs}, {args.rounds})")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit((done.stderr or done.stdout).strip()[-800:])
    results = json.loads(done.stdout.split("\n")[-2] if done.stdout.endswith("\n")
                         else done.stdout)
    median = {k: (statistics.median(c for c, _ in v) * 1e3,
                  statistics.median(m for _, m in v) * 1e3) for k, v in results.items()}
    print(f"ms of CPU per operation, median of {args.rounds} rounds of {args.runs}:")
    print("| kind | the child's own | the whole machine |")
    print("|---|---:|---:|")
    for kind, (child, machine) in median.items():
        print(f"| {KINDS[kind]} | {child:.3f} | {machine:.3f} |")
    own, shared = median["own"], median["shared"]
    print(f"saved per jail by sharing: {own[0] - shared[0]:.3f} ms (the child's own), "
          f"{own[1] - shared[1]:.3f} ms (the whole machine)")


if __name__ == "__main__":
    main()
