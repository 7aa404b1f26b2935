"""This machine's floors, measured in the same run as jaild: what any design with jaild's
hops pays here before doing anything of its own.

1. **A hop between processes**: one byte over a socketpair and back, the two processes on
   one CPU, then each on its own CPU, back to back -- the cost of a cross-CPU wake-up (on a
   VM an idle vCPU is halted: waking it is an IPI the hypervisor delivers).
2. **A warm job's shape** with no work in it: a client, a "daemon" and a "jail" (three
   processes, asyncio protocols in the first two, msgpack frames), the client's request
   going to the jail and the answer back through the daemon -- jaild's four hops --, paced
   as the warm row is.
3. **What idling costs the next piece of Python**: one decode of a ``RunJob`` frame, back to
   back, then each after the pause the warm row has between jobs. The ratio is how much
   slower any code runs when the CPU under it has just been idle (cold caches and TLB; on a
   VM, the host may have run someone else on that core meanwhile).
4. **A tool call's shape** with no work in it: the same three processes, a call from the
   "jail" (a blocking socket, as jaild's runtime has) through the "daemon" to the "client"
   and its answer back the same way -- a tool call's four hops.
5. **What the kernel charges for each stage of a fresh jail** (:data:`STAGES`), in CPU for
   the whole machine (``/proc/stat``, kernel threads' deferred work included) per
   operation, each made by a helper process the size of a zygote (the runtime's modules
   imported, forking as the zygote does): a fork and an exit; the same into a fresh pid
   namespace, unsharing mount, ipc, uts, cgroup and network namespaces; the network
   namespace alone; a job's cgroups made, a process moved in, removed; the seccomp filters
   of the default policy loaded; and one copy-on-write fault (per page written after a
   fork).

Nothing of jaild runs in 1, 2 and 4; 3 decodes with jaild's protocol package; 5's seccomp
row loads the filters jaild builds for the default policy.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import msgpack
from measure import BenchError, Latency

from jaild.protocol.messages import JobDescription, RunJob, decode, encode

WARMUP = 10


@contextmanager
def on_cpus(cpus: str) -> Iterator[None]:
    """This process (its calling thread, and threads it starts meanwhile) on ``cpus`` (a
    comma-separated list, as ``taskset -c`` takes) for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pingpong(runs: int, pause_s: float, *, same_cpu: bool) -> Latency:
    """A byte's round trip between two processes over a socketpair: both on the first CPU
    this process may use, or the second on another CPU."""
    cpus = _cpus()
    if not same_cpu and len(cpus) < 2:
        raise BenchError("one CPU only: there is no other CPU to cross to")
    here, there = cpus[0], cpus[0] if same_cpu else cpus[1]
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo, pinned
        try:
            a.close()
            os.sched_setaffinity(0, {there})
            while data := b.recv(64):
                b.send(data)
        finally:
            os._exit(0)
    b.close()
    samples = []
    try:
        with on_cpus(str(here)):
            for i in range(WARMUP + runs):
                if pause_s:
                    time.sleep(pause_s)
                started = time.perf_counter()
                a.send(b"x")
                a.recv(64)
                if i >= WARMUP:
                    samples.append(time.perf_counter() - started)
    finally:
        a.close()
        os.waitpid(pid, 0)
    where = "one CPU" if same_cpu else "two CPUs"
    return Latency(samples, note=f"{where}, {pause_s * 1e3:.0f} ms between" if pause_s
                   else f"{where}, back to back")


# ---------------------------------------------------------------------------- a job's shape


def _frame(message: object) -> bytes:
    body: bytes = msgpack.packb(message)
    return struct.pack(">I", len(body)) + body


class _Framer(asyncio.Protocol):
    """Length-prefixed msgpack frames, each handed to ``on_message`` as it completes."""

    def __init__(self, on_message: Callable[[asyncio.Transport, object], None]) -> None:
        self._buffer = bytearray()
        self._on_message = on_message
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 4:
            size = struct.unpack_from(">I", self._buffer)[0]
            if len(self._buffer) < 4 + size:
                return
            message = msgpack.unpackb(bytes(self._buffer[4:4 + size]))
            del self._buffer[:4 + size]
            assert self.transport is not None
            self._on_message(self.transport, message)


def _jail(sock: socket.socket) -> None:
    """The "jail": reads a frame, answers one (blocking, as jaild's runtime does)."""
    stream = sock.makefile("rb")
    while header := stream.read(4):
        msgpack.unpackb(stream.read(struct.unpack(">I", header)[0]))
        sock.sendall(_frame({"type": "CodeFinished", "ok": True, "result": msgpack.packb(2)}))


async def _daemon(path: str, jail: socket.socket, ready: int) -> None:
    """The "daemon": a client's request to the jail, the jail's answer to the client."""
    loop = asyncio.get_running_loop()
    clients: list[asyncio.Transport] = []

    def from_jail(_: asyncio.Transport, message: object) -> None:
        assert isinstance(message, dict)
        clients[0].write(_frame({"type": "JobFinished", "record": {"status": "ok"},
                                 "result": message["result"]}))

    to_jail, _ = await loop.create_unix_connection(lambda: _Framer(from_jail), sock=jail)

    def from_client(transport: asyncio.Transport, message: object) -> None:
        if transport not in clients:
            clients.append(transport)
        assert isinstance(message, dict)
        to_jail.write(_frame({"type": "RunCode", "job": message["job"]}))

    server = await loop.create_unix_server(lambda: _Framer(from_client), path)
    os.write(ready, b"x")
    async with server:
        await asyncio.Event().wait()


def warm_shape(runs: int, pause_s: float) -> Latency:
    """A job's four hops and nothing else: client -> daemon -> jail -> daemon -> client."""
    with tempfile.TemporaryDirectory(prefix="jaild-bench-shape-") as tmp:
        path = os.path.join(tmp, "daemon.sock")
        daemon_end, jail_end = socket.socketpair()
        jail_pid = os.fork()
        if jail_pid == 0:
            try:
                daemon_end.close()
                _jail(jail_end)
            finally:
                os._exit(0)
        jail_end.close()
        ready_r, ready_w = os.pipe()
        daemon_pid = os.fork()
        if daemon_pid == 0:
            try:
                os.close(ready_r)
                asyncio.run(_daemon(path, daemon_end, ready_w))
            finally:
                os._exit(0)
        daemon_end.close()
        os.close(ready_w)
        try:
            if os.read(ready_r, 1) != b"x":
                raise BenchError("the floor's daemon did not start")
            return Latency(asyncio.run(_shape_client(path, runs, pause_s)),
                           note=f"{pause_s * 1e3:.0f} ms between jobs" if pause_s else "")
        finally:
            os.close(ready_r)
            for pid in (daemon_pid, jail_pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, 9)
                os.waitpid(pid, 0)


async def _shape_client(path: str, runs: int, pause_s: float) -> list[float]:
    loop = asyncio.get_running_loop()
    answer: list[asyncio.Future[object]] = []

    def on_message(_: asyncio.Transport, message: object) -> None:
        answer[0].set_result(message)

    transport, _ = await loop.create_unix_connection(lambda: _Framer(on_message), path)
    samples = []
    try:
        for i in range(WARMUP + runs):
            if pause_s:
                await asyncio.sleep(pause_s)
            answer[:] = [loop.create_future()]
            started = time.perf_counter()
            transport.write(_frame({"type": "RunJob", "job": {"code": "result = 1 + 1\nresult"},
                                    "policy": "default"}))
            await answer[0]
            if i >= WARMUP:
                samples.append(time.perf_counter() - started)
    finally:
        transport.close()
    return samples


# ---------------------------------------------------------------------------- idling


def after_idle(runs: int, pause_s: float) -> Latency:
    """One decode of a ``RunJob`` frame (jaild's protocol package), after ``pause_s`` of
    sleep each time (0: back to back)."""
    payload = encode(RunJob(ref=1, job=JobDescription(code="result = 1 + 1\nresult"),
                            policy="default"))
    samples = []
    for i in range(WARMUP + runs):
        if pause_s:
            time.sleep(pause_s)
        started = time.perf_counter()
        decode(payload, "client->daemon")
        if i >= WARMUP:
            samples.append(time.perf_counter() - started)
    return Latency(samples, note=f"after {pause_s * 1e3:.0f} ms idle" if pause_s
                   else "back to back")


# ---------------------------------------------------------------------------- a tool call


def _tool_daemon(path: str, jail: socket.socket, ready: int) -> None:
    """The "daemon" of a tool call: the jail's call to the client, the answer back. Says
    ``x`` on ``ready`` once it listens, and ``c`` once it has accepted the client (the
    client's own ``x`` says only that its connect returned: the accept may come later)."""

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        clients: list[asyncio.Transport] = []
        started = loop.create_future()

        def from_client(transport: asyncio.Transport, message: object) -> None:
            assert isinstance(message, dict)
            to_jail.write(_frame({"type": "ToolResult", "call_id": message["call_id"],
                                  "result": message["result"]}))

        def connected() -> _Framer:
            framer = _Framer(from_client)
            if not started.done():
                started.set_result(framer)
                os.write(ready, b"c")
            return framer

        def from_jail(_: asyncio.Transport, message: object) -> None:
            assert isinstance(message, dict)
            framer = started.result()
            assert framer.transport is not None
            framer.transport.write(_frame({"type": "CallTool", "call_id": message["call_id"],
                                           "name": message["name"], "args": message["args"]}))

        to_jail, _ = await loop.create_unix_connection(lambda: _Framer(from_jail), sock=jail)
        server = await loop.create_unix_server(connected, path)
        os.write(ready, b"x")
        async with server:
            await asyncio.Event().wait()
        del clients

    asyncio.run(serve())


def _tool_client(path: str, ready: int) -> None:
    """The "client": answers each call with its argument (an echo handler)."""

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        def on_call(transport: asyncio.Transport, message: object) -> None:
            assert isinstance(message, dict)
            transport.write(_frame({"type": "ToolReply", "call_id": message["call_id"],
                                    "result": message["args"]}))

        await loop.create_unix_connection(lambda: _Framer(on_call), path)
        os.write(ready, b"x")
        await asyncio.Event().wait()

    asyncio.run(serve())


def tool_shape(runs: int) -> Latency:
    """A tool call's four hops and nothing else: jail -> daemon -> client -> daemon -> jail,
    back to back (as a job's sequential calls are), timed in the "jail"."""
    with tempfile.TemporaryDirectory(prefix="jaild-bench-tool-") as tmp:
        path = os.path.join(tmp, "daemon.sock")
        daemon_end, jail_end = socket.socketpair()
        pids = []
        ready_r, ready_w = os.pipe()
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    jail_end.close()
                    os.close(ready_r)
                    _tool_daemon(path, daemon_end, ready_w)
                finally:
                    os._exit(0)
            pids.append(pid)
            daemon_end.close()
            if os.read(ready_r, 1) != b"x":
                raise BenchError("the tool floor's daemon did not start")
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(ready_r)
                    _tool_client(path, ready_w)
                finally:
                    os._exit(0)
            pids.append(pid)
            # the client connected (its x) and the daemon accepted it (its c), in either
            # order: only then may the first call go, or it reaches a daemon with no client
            said = os.read(ready_r, 1) + os.read(ready_r, 1)
            if sorted(said) != sorted(b"xc"):
                raise BenchError("the tool floor's client did not start or was not accepted")
            stream = jail_end.makefile("rb")
            samples = []
            for i in range(WARMUP + runs):
                started = time.perf_counter()
                jail_end.sendall(_frame({"type": "CallTool", "call_id": i, "name": "echo",
                                         "args": [i]}))
                header = stream.read(4)
                msgpack.unpackb(stream.read(struct.unpack(">I", header)[0]))
                if i >= WARMUP:
                    samples.append(time.perf_counter() - started)
            return Latency(samples, note="back to back")
        finally:
            jail_end.close()
            os.close(ready_r)
            os.close(ready_w)
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, 9)
                os.waitpid(pid, 0)


# ---------------------------------------------------------------------------- a jail's stages

STAGES: dict[str, str] = {
    "fork_exit": "a fork of a zygote-sized interpreter, and its exit",
    "namespaces": "the same, into a fresh pid namespace, unsharing mount, ipc, uts, cgroup "
                  "and network namespaces (a jail's set)",
    "netns": "the same, unsharing the network namespace alone",
    "cgroup": "the same, the child moved into a job's fresh cgroups, which are then removed",
    "cgroup_clone3": "the same, the child forked straight into a job's fresh cgroup "
                     "(clone3 CLONE_INTO_CGROUP: cgroup v2 only), which is then removed",
    "seccomp": "the same, the child loading the default policy's seccomp filters",
    "seccomp_split": "the same, the child loading its part of the default policy's filters "
                     "split (its parent, as a zygote, loaded the rest once)",
    "cow": "one copy-on-write fault: a page written after a fork (per page)",
}
"""The stage floors' keys and what each costs, in the report's order: CPU per operation, for
the whole machine (a stage's own cost is its row less ``fork_exit``)."""

V2_ONLY = frozenset({"cgroup_clone3"})
"""Stages a cgroup v1 host cannot measure."""

STAGE_RUNS = 300
COW_PAGES = 4000
_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
_CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000


def measure_stage(key: str, runs: int = STAGE_RUNS) -> float:
    """CPU seconds per operation of stage ``key`` (:data:`STAGES`), measured in a helper
    process that imports what a zygote imports (so forks copy what a zygote's do)."""
    bench = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path[:0] = [{bench!r}, {os.path.dirname(bench)!r}]; "
            f"import floors; floors._stage_child({key!r}, {runs})")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode != 0:
        raise BenchError(f"stage {key}: {(done.stderr or done.stdout).strip()[-400:]}")
    return float(done.stdout.split()[-1])


def _stage_child(key: str, runs: int) -> None:
    """In the helper: the zygote's imports, then ``runs`` operations; prints CPU per one."""
    import ctypes
    import gc
    import importlib

    from jaild.runtime import zygote

    for name in zygote._RUNTIME_MODULES:
        importlib.import_module(name)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fork = ctypes.PyDLL("libc.so.6", use_errno=True).fork
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    gc.freeze()
    if key == "cow":
        print(_cow(fork))
        return
    child_does: Callable[[], None] = lambda: None  # noqa: E731
    flags, new_pid_ns = 0, False
    if key == "namespaces":
        flags = _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP | _CLONE_NEWNET
        new_pid_ns = True
    elif key == "netns":
        flags = _CLONE_NEWNET
    elif key in ("seccomp", "seccomp_split"):
        child_does = _seccomp_loader(split=key == "seccomp_split")
    cgroups = _StageCgroups() if key in ("cgroup", "cgroup_clone3") else None
    cloner = None
    if key == "cgroup_clone3":
        from jaild.runtime import clone3

        made = clone3.prepare()
        if isinstance(made, str):
            raise SystemExit(f"stage {key}: {made}")
        cloner = made
    time.sleep(0.2)
    from measure import machine_cpu_s

    started = machine_cpu_s()
    try:
        for i in range(runs):
            if new_pid_ns:
                libc.setns(own_pidns, _CLONE_NEWPID)
                libc.unshare(_CLONE_NEWPID)
            gate_r, gate_w = os.pipe()
            if cloner is not None and cgroups is not None:
                target = os.open(cgroups.make(i), os.O_PATH | os.O_DIRECTORY)
                pid = cloner.fork(target)
                if pid:
                    os.close(target)
            else:
                pid = fork()
            if pid == 0:
                os.close(gate_w)
                os.read(gate_r, 1)
                if flags and libc.unshare(flags) != 0:
                    os._exit(3)
                child_does()
                os._exit(0)
            os.close(gate_r)
            if cgroups is not None and cloner is None:
                cgroups.adopt(i, pid)
            os.close(gate_w)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                raise SystemExit(f"stage {key}: the child failed ({status})")
            if cgroups is not None:
                cgroups.remove(i)
        libc.setns(own_pidns, _CLONE_NEWPID)
        time.sleep(0.5)  # deferred work (network namespaces, cgroups) is done in kworkers
        used = machine_cpu_s() - started - 0.5 * _idle_noise()
    finally:
        if cgroups is not None:
            cgroups.close()
    print(used / runs)


def _idle_noise() -> float:
    """The machine's busy CPU per second while this helper sleeps (what others do)."""
    from measure import machine_cpu_s

    before = machine_cpu_s()
    time.sleep(0.5)
    return (machine_cpu_s() - before) / 0.5


def _cow(fork: Callable[[], int]) -> float:
    import mmap

    buffer = mmap.mmap(-1, COW_PAGES * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(COW_PAGES):
        buffer[i * 4096] = 1
    best = float("inf")
    for _ in range(5):
        r, w = os.pipe()
        pid = fork()
        if pid == 0:
            os.close(r)
            started = time.thread_time()
            for i in range(COW_PAGES):
                buffer[i * 4096] = 2
            written = time.thread_time() - started
            started = time.thread_time()
            for i in range(COW_PAGES):
                buffer[i * 4096] = 3  # the loop alone, the pages now its own
            loop = time.thread_time() - started
            os.write(w, f"{(written - loop) / COW_PAGES}".encode())
            os._exit(0)
        os.close(w)
        best = min(best, float(os.read(r, 64) or "inf"))
        os.close(r)
        os.waitpid(pid, 0)
    return best


def _seccomp_loader(split: bool = False) -> Callable[[], None]:
    """What a jail does to load its filters: the default policy's whole, or (``split``) its
    part only, this process -- the zygote -- having loaded the rest (it runs under them
    from here on, as a zygote does)."""
    from jaild.policy.schema import load_policy_dir
    from jaild.policy.seccomp import build_spec
    from jaild.runtime import seccomp

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    policy = load_policy_dir(os.path.join(repo, "policies"))["default"]
    spec = build_spec(policy.seccomp_choice, network=policy.network.mode != "none")
    seccomp.prepare(spec, split=split)  # looks up the seccomp(2) call once, as the zygote does
    assert seccomp._prepared is not None
    programs = seccomp._prepared.programs
    import prctl

    def load() -> None:
        prctl.set_no_new_privs(1)
        for program in programs:
            seccomp._install(program)

    return load


class _StageCgroups:
    """A job's cgroups as jaild makes them on this host's hierarchy -- v1: memory (with its
    limits and OOM eventfd), pids and cpuacct; v2: one directory with memory and pids
    limits -- under a subtree of this helper's own (v1) or at the top (v2)."""

    def __init__(self) -> None:
        from jaild.daemon.jails.cgroups import detect

        layout = detect(f"bench-stage-{os.getpid()}")
        self.v2 = layout.version == 2
        if self.v2:
            self.roots = [os.path.join("/sys/fs/cgroup", layout.subtree)]
            os.mkdir(self.roots[0])
            with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
                enabled = f.read().split()
            wanted = [c for c in ("memory", "pids") if c in enabled]
            with open(os.path.join(self.roots[0], "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in wanted))
        else:
            self.roots = [os.path.join(layout.v1_base(c), layout.subtree)
                          for c in ("memory", "pids", "cpuacct")
                          if os.path.isdir(layout.v1_base(c))]
            for root in self.roots:
                os.mkdir(root)

    def make(self, i: int) -> str:
        """v2: job ``i``'s cgroup, made with its limits and nothing in it yet."""
        job = os.path.join(self.roots[0], f"j{i}")
        os.mkdir(job)
        _write_file(os.path.join(job, "memory.max"), str(256 << 20))
        _write_file(os.path.join(job, "pids.max"), "64")
        return job

    def adopt(self, i: int, pid: int) -> None:
        for root in self.roots:
            job = os.path.join(root, f"j{i}")
            os.mkdir(job)
            if self.v2:
                _write_file(os.path.join(job, "memory.max"), str(256 << 20))
                _write_file(os.path.join(job, "pids.max"), "64")
            elif "memory" in root:
                _write_file(os.path.join(job, "memory.limit_in_bytes"), str(256 << 20))
            elif "pids" in root:
                _write_file(os.path.join(job, "pids.max"), "64")
            _write_file(os.path.join(job, "cgroup.procs"), str(pid))

    def remove(self, i: int) -> None:
        for root in self.roots:
            os.rmdir(os.path.join(root, f"j{i}"))

    def close(self) -> None:
        for root in self.roots:
            with suppress(OSError):
                os.rmdir(root)


def _write_file(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


FLOORS: dict[str, str] = {
    "pingpong_same": "a byte's round trip between two processes, one CPU",
    "pingpong_apart": "a byte's round trip between two processes, two CPUs",
    "pingpong_paced": "a byte's round trip between two processes, two CPUs, paced",
    "shape": "a warm job's four hops, nothing else (client, daemon, jail; asyncio), paced",
    "decode_hot": "one `RunJob` decode (jaild.protocol), back to back",
    "decode_idle": "one `RunJob` decode (jaild.protocol), after the pause between warm jobs",
    "tool_shape": "a tool call's four hops, nothing else (jail, daemon, client), back to back",
}
"""The floors' keys and what each measures, in the report's order."""


def measure(key: str, runs: int, pause_s: float) -> Latency:
    """The floor ``key`` of :data:`FLOORS`."""
    if key == "pingpong_same":
        return pingpong(runs, 0.0, same_cpu=True)
    if key == "pingpong_apart":
        return pingpong(runs, 0.0, same_cpu=False)
    if key == "pingpong_paced":
        return pingpong(runs, pause_s, same_cpu=False)
    if key == "shape":
        return warm_shape(runs, pause_s)
    if key == "decode_hot":
        return after_idle(runs, 0.0)
    if key == "decode_idle":
        return after_idle(runs, pause_s)
    if key == "tool_shape":
        return tool_shape(runs * 10)
    raise KeyError(key)
