"""Entry point of the in-jail runtime (``python3 -I -B -c <bootstrap>`` inside nsjail).

Sequence (the jail link's states, see :mod:`jaild.protocol.connection`):

1. fd 0 is the tool channel: move it to a close-on-exec descriptor and put
   /dev/null on fd 0, so user code can neither read frames from stdin nor pass
   the channel to a subprocess.
2. Receive ``Harden``; lock down (:func:`jaild.runtime.harden.harden`). On any
   failure, report it on stderr and exit non-zero: no user code runs. A policy without
   a network has the job's network attempts refused in words (:mod:`jaild.runtime.network`).
3. Send ``JailReady``; receive ``RunCode``.
4. Write the uploaded files into the working directory, note what is there, run the
   code with ``tools`` in its namespace, list what the run created or changed (and
   read the files asked for); send ``CodeFinished``.
5. A session's jail (``RunCode.keep``) waits for its next ``RunCode`` and runs it in
   the same namespace and event loop. Otherwise: flush stdout/stderr and ``_exit`` --
   threads the code left behind do not keep the jail alive.

The runtime imports only the standard library, msgpack, pyseccomp, prctl and
``jaild.protocol`` / ``jaild.errors`` (a test enforces it).
"""

from __future__ import annotations

import builtins
import os
import platform
import socket
import sys
from typing import Any

from jaild.errors import HardeningFailed, ToolError, UploadError
from jaild.protocol import PROTOCOL_VERSION, Connection, Role
from jaild.protocol.messages import (
    MAX_PAYLOAD_BYTES,
    CodeFinished,
    ErrorInfo,
    Harden,
    JailReady,
    JobDescription,
    RunCode,
    decode,
    encode,
)
from jaild.runtime import execute, files, network
from jaild.runtime.channel import Channel
from jaild.runtime.harden import harden
from jaild.runtime.tools import Tools

EXIT_HARDENING_FAILED = 71
EXIT_PROTOCOL = 72
JAIL_MAX_FRAME = MAX_PAYLOAD_BYTES + (1 << 20)


def _take_channel() -> socket.socket:
    channel_fd = os.dup(0)  # close-on-exec by default
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return socket.socket(fileno=channel_fd)


_NOTHING = {"files": [], "data": {}, "skipped": [], "skipped_more": 0}


def _occupied(directory: str) -> bool:
    """Is there anything in ``directory``?"""
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except OSError:
        return True  # let the walk say what is wrong


def _warm_files(files: Any, workdir: str, limits: Any) -> None:
    """A pooled jail's throwaway trip through a job's file handling and its ``RunCode``:
    the pages this code writes (reference counts, caches) are copied from the zygote now,
    not on the job's clock. Leaves the working directory empty."""
    name = ".jaild-warm-up"
    run = decode(
        encode(
            RunCode(job=JobDescription(code="", filename="<warm-up>", files={name: b"w"},
                                       download=("*",)),
                    tool_payload_bytes=64, result_bytes=64)
        ),
        "daemon->jail",
    )
    assert isinstance(run, RunCode)
    before = files.snapshot(workdir, limits)
    files.write_uploads(workdir, run.job.files, limits)
    encode(CodeFinished(ok=True, files=files.collect(workdir, before, run.job.download, limits,
                                                      True).to_wire()))
    os.unlink(os.path.join(workdir, name))


def _snapshot_or_restore(channel: Any, run: RunCode, namespace: dict[str, Any],
                         workdir: str, limits: Any) -> dict[str, Any]:
    """A session's ``RunCode`` that runs no code: take its snapshot (the result) or restore
    one into this fresh jail (see :mod:`jaild.runtime.snapshot`). Returns the namespace the
    session goes on with."""
    from jaild.errors import SnapshotError
    from jaild.runtime import snapshot

    result = None
    error = None
    try:
        if run.restore is not None:
            namespace = snapshot.restore(run.restore, namespace, workdir, limits)
        else:
            result = snapshot.take(namespace, workdir, limits, run.result_bytes)
    except SnapshotError as exc:
        error = ErrorInfo(type="SnapshotError", message=str(exc)[:4096])
    except BaseException as exc:  # code of the session's own (a __reduce__) may raise anything
        error = ErrorInfo(type="SnapshotError",
                          message=f"{type(exc).__name__}: {str(exc)[:4000]}")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    channel.send(CodeFinished(ok=error is None, result=result, error=error))
    return namespace


def main(warm_up: bool = False) -> None:
    """Run the jail's one job. ``warm_up``: the jail was made ahead of its job (the zygote
    says so), so it has time to run a throwaway job first (see execute.warm_up)."""
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sock = _take_channel()
    channel = Channel(sock, Connection(Role.JAIL, JAIL_MAX_FRAME))
    first = channel.receive()
    if not isinstance(first, Harden):
        os._exit(EXIT_PROTOCOL)
    try:
        seccomp_digest = harden(first.seccomp)
    except HardeningFailed as exc:
        sys.stderr.write(f"jaild runtime: refusing to run user code: {exc}\n")
        sys.stderr.flush()
        os._exit(EXIT_HARDENING_FAILED)
    if first.network is not None:
        network.install(first.network)
    channel.send(JailReady(protocol=PROTOCOL_VERSION, python=platform.python_version(),
                           seccomp_digest=seccomp_digest))
    if warm_up:  # a pooled jail, waiting for its job: fault the code path in now
        outcome = execute.warm_up(1 << 16)
        encode(CodeFinished(ok=outcome.ok, result=outcome.result, error=outcome.error))
    workdir = os.getcwd()  # the jail's /tmp: uploads go there, downloads come from there
    limits = files.FileLimits.from_wire(first.file_limits)

    if warm_up:  # ... and that of the files and of decoding the job (see _warm_files)
        _warm_files(files, workdir, limits)

    namespace: dict[str, Any] | None = None
    session = execute.SessionLoop()
    while True:
        run = channel.receive()
        if not isinstance(run, RunCode):
            os._exit(EXIT_PROTOCOL)
        job = run.job
        if namespace is None:
            tools = Tools(job.tools, channel, run.tool_payload_bytes)
            namespace = execute.main_namespace({  # the __main__ module's: see main_namespace
                "__builtins__": builtins,
                "tools": tools,
                "ToolError": ToolError,
                # codemode-lite's names for discovery
                "_discover": tools._discover,
                "_schema": tools._schema,
                "_search": tools._search,
            })
        network.take_refused()  # not this run's: the warm-up's, a session's leftover threads'
        if run.snapshot or run.restore is not None:
            namespace = _snapshot_or_restore(channel, run, namespace, workdir, limits)
            continue
        try:
            if job.files:
                files.write_uploads(workdir, job.files, limits)
        except UploadError as exc:
            outcome = execute.Outcome(
                ok=False, error=ErrorInfo(type="UploadError", message=str(exc)[:4096])
            )
            collected = None
        else:
            # the common case, nothing there (a fresh jail): one syscall, not a walk
            before = files.snapshot(workdir, limits) if _occupied(workdir) else files.Snapshot({})
            outcome = execute.run(
                job.code,
                job.filename,
                namespace,
                run.result_bytes,
                session if run.keep else None,
            )
            collected = None
            if _occupied(workdir):
                collected = files.collect(
                    workdir, before, job.download, limits, job.download_changed
                ).to_wire()
                if collected == _NOTHING:
                    collected = None
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        channel.send(
            CodeFinished(
                ok=outcome.ok,
                result=outcome.result,
                error=outcome.error,
                files=collected,
                network_refused=network.take_refused(),
            )
        )
        if not run.keep:
            os._exit(0)
