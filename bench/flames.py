"""Optional profiling (``--profile``): py-spy samples the daemon and its Python descendants
while jobs run, and the collapsed stacks are summed into top-function tables.

Only threads holding the GIL are sampled (``--gil``): py-spy cannot tell idle threads in
the jails' pid namespaces from busy ones, and waiting pooled jails would swamp the rest.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from measure import BenchError

RATE_HZ = 1000
ENTRY_POINTS = ("(jaild/cli.py)", "(jaild/__main__.py)")


@dataclass
class Flame:
    """Where samples fell: by function and line alone (self), by jaild function with its
    callees (total, entry points left out), and by kind of process."""

    samples: int
    top_self: list[tuple[str, int]] = field(default_factory=list)
    top_total: list[tuple[str, int]] = field(default_factory=list)
    by_process: list[tuple[str, int]] = field(default_factory=list)


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise BenchError("py-spy is not installed (.venv/bin/pip install py-spy; make bench does)")
    return found


FRAME = re.compile(r'process \d+:"[^"]*"|[^;]+')
"""A frame of a collapsed stack; process frames (``process PID:"cmdline"``) may hold ``;``."""
LINE = re.compile(r" \(([^()]*):\d+\)$")


def _process_kind(chain: list[str]) -> str:
    """daemon, nsjail, zygote, jail (a process forked from the zygote), or argv[0]'s name."""
    if len(chain) == 1:
        return "daemon"
    commands = [frame.split(":", 1)[1].strip('"') for frame in chain]
    programs = [Path(c.split(" ", 1)[0]).name for c in commands]
    zygotes = [
        i for i, (c, p) in enumerate(zip(commands, programs, strict=True))
        if "zygote" in c and p != "nsjail"
    ]
    if zygotes:
        return "zygote" if zygotes[0] == len(chain) - 1 else "jail forked from the zygote"
    return programs[-1]


def summarize(collapsed: str, top: int = 15) -> Flame:
    """Sum py-spy's raw (collapsed) stacks, ``frame;frame;... count`` per line: by
    function and line (self), by jaild function (total), and by kind of process."""
    self_counts: Counter[str] = Counter()
    total_counts: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = FRAME.findall(stack)
        chain = [f for f in frames if f.startswith("process ")]
        code = frames[len(chain):]
        if chain:
            processes[_process_kind(chain)] += count
        if code:
            self_counts[code[-1]] += count
            for function in {LINE.sub(r" (\1)", f) for f in code}:
                if "(jaild/" in function and not function.endswith(ENTRY_POINTS):
                    total_counts[function] += count
    return Flame(
        samples,
        self_counts.most_common(top),
        total_counts.most_common(top),
        processes.most_common(top),
    )


@contextmanager
def recording(pid: int, out: Path) -> Iterator[None]:
    """Sample ``pid`` and its Python subprocesses for the duration of the block into ``out``."""
    log = out.with_suffix(".log")
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [py_spy(), "record", "--pid", str(pid), "--format", "raw", "--output", str(out),
             "--rate", str(RATE_HZ), "--subprocesses", "--gil", "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=stderr,
        )
    time.sleep(1.0)  # py-spy attaches before the jobs start
    if proc.poll() is not None:
        raise BenchError(f"py-spy exited: {log.read_text(errors='replace')[-500:]}")
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if not out.exists():
        raise BenchError("py-spy wrote no profile")
