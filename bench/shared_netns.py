"""What ``network.namespace = "tenant"`` saves a jail, at the kernel: a forked child that
makes a network namespace of its own (``unshare(CLONE_NEWNET)``, as every jail did) against
one that enters a namespace made once (``setns``, as a jail of an opting-in policy does), and
a child that does neither (the fork and exit alone).

Run as root (the daemon's case; a zygote does the same in its own user namespace)::

    .venv/bin/python bench/shared_netns.py [--runs 300] [--rounds 5]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
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
