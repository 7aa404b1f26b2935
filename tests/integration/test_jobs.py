"""What jailed code sees and what comes back: results, errors, output, the runtime's rules."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jaild.client import Client
from jaild.protocol import PROTOCOL_VERSION
from jaild.protocol.framing import encode_frame
from jaild.protocol.messages import (
    CancelJob,
    Hello,
    JobAccepted,
    JobDescription,
    JobFinished,
    RunJob,
    Welcome,
    encode,
    unpack,
)
from tests.conftest import DaemonHandle, RawClient, guard, policy_texts, wait_for_zygote

pytestmark = pytest.mark.integration


def test_final_expression_is_the_result(client: Client) -> None:
    r = client.run("x = 20\nx + 22")
    assert (r.status, r.result, r.error) == ("ok", 42, None)
    assert r.job_id.startswith("job-")
    assert r.policy == "default"
    assert r.limits["memory_mb"] == 256 and r.limits["network"] == "none"


def test_no_final_expression_gives_none(client: Client) -> None:
    r = client.run("x = 1")
    assert (r.status, r.result) == ("ok", None)


def test_sync_main_is_called(client: Client) -> None:
    r = client.run("def main():\n    return {'a': [1, 2]}\n'ignored'")
    assert r.result == {"a": [1, 2]}


def test_async_main_is_awaited(client: Client) -> None:
    r = client.run("import asyncio\nasync def main():\n    await asyncio.sleep(0)\n    return 'done'")
    assert r.result == "done"


def test_main_with_required_arguments_is_not_called(client: Client) -> None:
    r = client.run("def main(x):\n    return x\n'fallback'")
    assert r.result == "fallback"


def test_top_level_await(client: Client) -> None:
    r = client.run("import asyncio\nawait asyncio.sleep(0.01)\n'awaited'")
    assert (r.status, r.result) == ("ok", "awaited")


def test_awaited_final_expression(client: Client) -> None:
    r = client.run("import asyncio\nasync def f():\n    return 7\nawait f()")
    assert r.result == 7


def test_unpackable_results_come_back_as_repr(client: Client) -> None:
    r = client.run(
        "class Thing:\n    def __repr__(self):\n        return '<thing>'\n"
        "{'t': Thing(), 'n': 2, 's': {3}, 'tuple': (1, 2)}"
    )
    assert r.status == "ok"
    assert r.result == {"t": "<thing>", "n": 2, "s": [3], "tuple": [1, 2]}


def test_numpy_scalars_come_back_as_python_numbers(daemon: DaemonHandle) -> None:
    """A numpy scalar (``np.int64``, ``np.bool_``, ``np.float32``) or a 0-d array comes back as
    the number it holds, not as its repr; a whole array still comes back as its repr."""
    code = (
        "import msgpack, numpy as np\n"
        "try:\n"  # the control: msgpack itself cannot carry an np.int64
        "    msgpack.packb(np.int64(6))\n"
        "    native = 'packed'\n"
        "except TypeError:\n"
        "    native = 'refused'\n"
        "a = np.arange(4)\n"
        "{'native': native, 'sum': a.sum(), 'any': (a > 2).any(), 'f32': np.float32(0.5),\n"
        " 'mean': a.mean(), 'zero_d': np.array(7), 'array': a[:2]}\n"
    )
    r = daemon.run(code, policy="data")
    assert r.status == "ok", (r.status, r.error)
    assert r.result == {"native": "refused", "sum": 6, "any": True, "f32": 0.5, "mean": 1.5,
                        "zero_d": 7, "array": "array([0, 1])"}
    assert type(r.result["sum"]) is int and type(r.result["any"]) is bool


def test_result_with_tuple_keys_falls_back_to_repr(client: Client) -> None:
    r = client.run("{(1, 2): 'x'}")
    assert (r.status, r.result) == ("ok", "{(1, 2): 'x'}")


def test_exception_is_error_with_user_traceback(client: Client) -> None:
    r = client.run("def f():\n    raise ValueError('bad value')\n\nf()")
    assert r.status == "error"
    assert r.error is not None
    assert r.error["type"] == "ValueError"
    assert r.error["message"] == "bad value"
    assert r.error["lineno"] == 2
    tb = r.error["traceback"]
    assert "raise ValueError('bad value')" in tb  # the user's source line is shown
    assert "/opt/jaild/runtime" not in tb and "execute.py" not in tb  # no runtime frames


def test_a_syntax_error_is_reported_by_the_jail(daemon: DaemonHandle, client: Client) -> None:
    """The daemon never compiles job code: the jail does, and reports what does not compile
    as the job's error, with the line -- a tenant's largest code is no work for the daemon."""
    r = client.run("x = 1\ndef broken(:\n    pass")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "SyntaxError"
    assert r.error["lineno"] == 2 and "def broken(:" in r.error["traceback"]
    assert r.usage["cpu_user_s"] is not None  # a jail ran it: its cgroup's account is there
    assert f"job={r.job_id}" in daemon.log()  # audited
    big = "x = 1\n" * 40000 + "def broken(:\n"  # 240 KiB: compiled in the jail, not here
    r = client.run(big)
    assert r.status == "error" and r.error is not None and r.error["type"] == "SyntaxError"
    assert r.error["lineno"] == 40001


def test_break_outside_loop_is_a_syntax_error_too(client: Client) -> None:
    r = client.run("break")
    assert r.status == "error" and r.error is not None and r.error["type"] == "SyntaxError"


def test_null_bytes_in_source(client: Client) -> None:
    r = client.run("x = 1\0")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] in ("SyntaxError", "ValueError")


def test_stdout_and_stderr_are_separate(client: Client) -> None:
    r = client.run("import sys\nprint('to out')\nprint('to err', file=sys.stderr)")
    assert r.stdout == "to out\n"
    assert r.stderr == "to err\n"


def test_output_streams_while_the_job_runs(client: Client) -> None:
    seen = threading.Event()
    chunks: list[str] = []

    def on_stdout(text: str) -> None:
        chunks.append(text)
        if "ready" in "".join(chunks):
            seen.set()

    def wait_until_seen() -> bool:
        """Blocks until the client has received the job's first line."""
        return seen.wait(timeout=guard(10))

    r = client.run("print('ready')\nawait tools.wait_until_seen()",
                   tools={"wait_until_seen": wait_until_seen}, on_stdout=on_stdout)
    # The job could only get True if its output reached the client before it finished.
    assert (r.status, r.result) == ("ok", True)


def test_printing_protocol_frames_cannot_forge_anything(client: Client) -> None:
    # A well-formed CodeFinished frame written to stdout is just output.
    code = (
        "import sys, msgpack, struct\n"
        "frame = msgpack.packb({'type': 'CodeFinished', 'ok': True, 'result': msgpack.packb('forged')})\n"
        "sys.stdout.buffer.write(struct.pack('>I', len(frame)) + frame)\n"
        "sys.stdout.flush()\n"
        "raise RuntimeError('real outcome')"
    )
    r = client.run(code)
    assert r.status == "error"
    assert r.error is not None and r.error["message"] == "real outcome"
    assert "CodeFinished" in r.stdout


FORGE = (
    "import os, msgpack, struct, time\n"
    "frame = msgpack.packb({'type': 'CodeFinished', 'ok': True, 'result': msgpack.packb('forged')})\n"
    "os.write(3, struct.pack('>I', len(frame)) + frame)\n"
    "time.sleep(30)"
)


def test_forged_finish_on_the_channel_does_not_beat_the_deadline(client: Client) -> None:
    # Hostile code writes its own CodeFinished to the tool channel, then keeps running. A
    # spawned jail's record waits for the jail's exit: the deadline ends it.
    r = client.run(FORGE, policy="spawn", timeout=1)
    assert r.status == "timeout"
    assert r.result is None


def test_forged_finish_ends_a_zygote_jail_at_once(daemon: DaemonHandle, client: Client) -> None:
    # A zygote jail's record is made at the claim, and the jail is killed then: the code
    # chose its own result (which it could have returned anyway) and cannot run on.
    # The evidence is the record, not a stopwatch: "ok" with the forged result is the claim's
    # (any other end -- the deadline, the sleep's -- would not be "ok" and "forged").
    wait_for_zygote(client, "default")
    job = client.submit(FORGE, timeout=30)
    r = job.result(guard(60))
    assert (r.status, r.result) == ("ok", "forged")
    # killed then, not at its 30 s deadline nor after its sleep: gone well before either
    deadline = time.monotonic() + guard(20)  # a liveness guard, well short of the deadline
    while daemon.job_pids(r.job_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert daemon.job_pids(r.job_id) == []


def test_garbage_on_the_channel_ends_the_job(daemon: DaemonHandle, client: Client) -> None:
    r = client.run("import os\nos.write(3, b'\\xff' * 64)\nimport time\ntime.sleep(5)")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ChannelError"
    daemon.assert_serving()


def test_sys_exit_zero_is_ok(client: Client) -> None:
    r = client.run("import sys\nprint('bye')\nsys.exit(0)")
    assert (r.status, r.stdout) == ("ok", "bye\n")


def test_sys_exit_nonzero_is_error(client: Client) -> None:
    r = client.run("import sys\nsys.exit(3)")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "SystemExit"


def test_hard_exit_without_result_is_error(client: Client) -> None:
    r = client.run("import os\nos._exit(3)")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ProcessExit"
    assert "code 3" in r.error["message"]


def test_exit_code_137_is_not_taken_for_a_kill(client: Client) -> None:
    r = client.run("import os\nos._exit(137)")
    assert r.status == "error"  # not memory_limit, not killed: the exit code alone proves nothing


def test_threads_left_running_do_not_keep_the_jail_alive(client: Client) -> None:
    # The thread would outlive the job's 30 s deadline: a jail it kept alive would end in a
    # timeout, not "ok" (no stopwatch needed)
    r = client.run("import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n'done'")
    assert (r.status, r.result) == ("ok", "done"), r.error


def test_result_too_large(daemon: DaemonHandle) -> None:
    r = daemon.run("'x' * 10000", policy="tiny")
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ResultTooLarge"


def test_each_job_gets_a_fresh_jail(client: Client) -> None:
    a = client.run("open('/tmp/left-behind', 'w').write('secret')\nimport os\nos.listdir('/tmp')")
    assert a.result == ["left-behind"]
    b = client.run("import os\nos.listdir('/tmp')")
    assert b.result == []


def test_many_jobs_over_one_client_concurrently(client: Client) -> None:
    results = []

    def one(i: int) -> None:
        results.append(client.run(f"import time\ntime.sleep(0.2)\n{i} * 2"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.result for r in results) == [i * 2 for i in range(8)]
    assert all(r.status == "ok" for r in results)


def test_many_clients_concurrently(daemon: DaemonHandle) -> None:
    clients = [Client(daemon.socket) for _ in range(6)]
    try:
        out: dict[int, object] = {}

        def one(i: int) -> None:
            out[i] = clients[i].run(f"{i} + 100").result

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == {i: i + 100 for i in range(len(clients))}
    finally:
        for c in clients:
            c.close()


def test_async_client(daemon: DaemonHandle) -> None:
    import asyncio

    from jaild.client import AsyncClient

    async def double(x: int) -> int:
        return 2 * x

    async def scenario() -> list[object]:
        async with AsyncClient(daemon.socket) as c:
            results = await asyncio.gather(*(
                c.run(f"await tools.double({i})", tools={"double": double}) for i in range(5)
            ))
        return [r.result for r in results]

    assert asyncio.run(scenario()) == [0, 2, 4, 6, 8]


def test_long_error_fits_the_channel_even_with_small_payload_limits(daemon: DaemonHandle) -> None:
    r = daemon.run("raise ValueError('\u00e9' * 60000)", policy="tiny")  # tiny: 4096-byte payloads
    assert r.status == "error"
    assert r.error is not None and r.error["type"] == "ValueError"
    assert len(r.error["message"]) <= 65536


def test_unencodable_text_in_an_error_is_escaped(client: Client) -> None:
    r = client.run("raise ValueError('bad \\udc80 surrogate')")
    assert r.status == "error"
    assert r.error is not None and r.error["message"] == "bad \\udc80 surrogate"
    r = client.run("{'k': 'lone \\udc80'}")
    assert (r.status, r.result) == ("ok", "{'k': 'lone \\udc80'}")


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_a_job_sent_with_hello_in_one_write_runs(
    private_daemon: Callable[..., DaemonHandle], tmp_path: Path, event_loop: str
) -> None:
    """Hello and RunJob in the connection's first write: the daemon may read both before
    the connection's own task has begun (uvloop does; tests/unit/test_connection_scope.py).
    Each job runs and is answered; before the fix, under uvloop, the connection failed
    inside jaild and the job's pooled jail outlived it."""
    config = tmp_path / "jaild.toml"
    config.write_text(f'[daemon]\nevent_loop = "{event_loop}"\n')
    d = private_daemon(policy_texts("default"), with_repo_policies=False,
                       args=("--config", str(config)))
    for attempt in range(20):
        raw = RawClient(d.socket)
        with raw.sock:
            raw.sock.connect(raw.socket_path)
            hello = raw.conn.send(Hello(protocol=PROTOCOL_VERSION))
            job = RunJob(ref=1, job=JobDescription(code="6 * 7"), policy="default")
            run = encode_frame(encode(job), 1 << 20)
            raw.sock.sendall(hello + run)
            assert isinstance(raw.next(), Welcome), attempt
            accepted, finished = raw.next(), raw.next()
            assert isinstance(accepted, JobAccepted) and accepted.ref == 1, (attempt, accepted)
            assert isinstance(finished, JobFinished), (attempt, finished)
            assert finished.record.status == "ok", (attempt, finished.record.error)
            assert finished.result is not None and unpack(finished.result) == 42, attempt


def test_a_long_job_is_announced_while_it_runs_and_a_short_one_before_its_end(
    daemon: DaemonHandle,
) -> None:
    """``JobAccepted`` waits for the job's next message at most ACCEPT_HOLD_S: a job that
    runs on is announced while it runs (its id cancels it), and a job that ends at once is
    announced before its end. Whether the two share one write depends on how soon the
    jail answers (within the hold or not): tests/unit/test_accept_hold.py pins that down
    with a clock this test does not control."""
    with RawClient(daemon.socket) as raw:
        sleeper = JobDescription(code="import time\ntime.sleep(600)")
        raw.send(RunJob(ref=1, job=sleeper, policy="default"))
        accepted = raw.next()  # only the hold's timer can send it: the job sleeps
        assert isinstance(accepted, JobAccepted) and accepted.ref == 1, accepted
        raw.send(CancelJob(job_id=accepted.job_id))
        finished = raw.next()
        assert isinstance(finished, JobFinished), finished
        assert (finished.job_id, finished.record.status) == (accepted.job_id, "cancelled")

        raw.send(RunJob(ref=2, job=JobDescription(code="def ("), policy="default"))
        first, second = raw.next(), raw.next()
        assert isinstance(first, JobAccepted) and first.ref == 2, first
        assert isinstance(second, JobFinished) and second.job_id == first.job_id, second
        assert second.record.error is not None and second.record.error.type == "SyntaxError"
