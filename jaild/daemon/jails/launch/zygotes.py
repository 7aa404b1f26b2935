"""Every zygote of a daemon: one per (policy, client uid), started on demand, stopped when idle.

Theory of operation
-------------------
A zygote's jails are forks of it, so they share what no fork renews: the address-space
layout, the stack canary and pointer guard, ``AT_RANDOM`` and the ``str`` hash seed.
Within one tenant (one client uid) that is by design; across tenants it would let one
user's job learn what hardens another's. So with ``daemon.zygote_scope = "uid"`` (the
default) a zygote serves the jobs of **one** client uid, and of one policy:

* the key of a job's zygote is ``(policy, client uid)``; a job whose uid is unknown
  (``JobSpec.tenant`` is None) never gets a zygote: it is spawned (a fresh exec);
* a uid's first job of a policy, with no zygote ready for it, is *spawned* (nsjail, a
  fresh interpreter: it shares nothing with anyone), and that uid's zygote starts in the
  background; later jobs fork from it. Waiting for the zygote instead would make the first
  job wait for the zygote's whole start (nsjail, the interpreter, the pre-imports -- what a
  spawned jail costs anyway) and then its fork, and fail the job if the zygote fails;
* the daemon's own uid (root) gets its zygotes at start-up (:meth:`ZygoteSet.start`): they
  prove each policy's zygote comes up, the policies' self-tests run in them, and root's
  jobs are forked from them at once;
* a client uid's zygote with no job for ``limits.zygote_idle_s`` is *retired* (the
  daemon's own are not: they stay as start-up made them, so root's jobs and the
  self-tests keep forking at once, whether or not a warm pool holds them): the hooks registered
  with :meth:`on_retire` run first (the warm pools discard that uid's waiting jails), then
  it is stopped once no jail of it is left. At most ``limits.max_zygotes`` zygotes of uids
  other than the daemon's own run at once: a new one first retires the least recently used
  one with no job running; if none can go, the job is spawned and no zygote starts.

With ``daemon.zygote_scope = "policy"`` (single-tenant hosts) there is one zygote per
policy, shared by every uid, started at start-up, never retired -- jaild's earlier shape.

Either way a zygote is one policy's, so a network namespace shared under
``network.namespace = "tenant"`` is too; and within a zygote it is one tenant's, since the
zygote keeps one per tenant key its jails' plans carry (``JailSetup.shared_net``, put there
by :class:`~jaild.daemon.jails.launch.forked.ZygoteLauncher` from ``JobSpec.tenant``;
:class:`jaild.runtime.zygote.SharedNets`).

The set never makes a jail wait on a zygote start: :meth:`for_job` answers at once with a
ready zygote or None (spawn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from jaild.daemon.core.peer import Tenant
from jaild.daemon.jails.launch.forked import Zygote
from jaild.errors import ZygoteError
from jaild.policy.schema import Policy

log = logging.getLogger("jaild.daemon.jails.launch.zygotes")

ZygoteKey = tuple[str, Tenant | None]
"""(policy name, client principal: its uid, or its pod); None in ``policy`` scope."""
MakeZygote = Callable[[Policy, Tenant | None], Zygote]
"""Makes the (not yet started) zygote of a policy for a principal (None: for everyone)."""
RetireHook = Callable[[str, Tenant], Awaitable[None]]
"""(policy name, principal): the zygote of that principal is about to be retired."""
SCOPES = ("uid", "policy")


class ZygoteSet:
    """The daemon's zygotes by (policy, uid); see the module docstring.

    Its background work (zygotes being started, the idle sweep) runs in one task group,
    entered at :meth:`run` and left at :meth:`close`.
    """

    def __init__(
        self,
        make: MakeZygote | None = None,
        *,
        scope: str = "uid",
        max_zygotes: int = 16,
        idle_s: float = 600.0,
        own_uid: int = 0,
        release: Callable[[Zygote], None] | None = None,
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"zygote scope must be one of {SCOPES}, not {scope!r}")
        self._make = make
        self._release = release  # hears of each zygote dropped (its host uid is free again)
        self.scope = scope
        self.max_zygotes = max_zygotes
        self.idle_s = idle_s
        self.own_uid = own_uid
        self.policies: dict[str, Policy] = {}  # the policies served by zygotes
        self._zygotes: dict[ZygoteKey, Zygote] = {}
        self._used: dict[ZygoteKey, float] = {}
        self._starting: set[ZygoteKey] = set()
        self._retire_hooks: list[RetireHook] = []
        self._work: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self._scope_task: asyncio.Task[None] | None = None

    # -- what it holds

    def key(self, policy: str, tenant: Tenant | None) -> ZygoteKey | None:
        """The key of the zygote for ``tenant``'s jobs of ``policy``; None: no zygote may
        serve them (a policy not in zygote mode, or an unknown uid in ``uid`` scope)."""
        if policy not in self.policies:
            return None
        if self.scope == "policy":
            return (policy, None)
        return None if tenant is None else (policy, tenant)

    def get(self, policy: str, tenant: Tenant | None) -> Zygote | None:
        """The zygote for ``tenant``'s jobs of ``policy`` (running or not), if there is one."""
        key = self.key(policy, tenant)
        return None if key is None else self._zygotes.get(key)

    def ready(self, policy: str, tenant: Tenant | None) -> bool:
        """Is the zygote for ``tenant``'s jobs of ``policy`` up?"""
        zygote = self.get(policy, tenant)
        return zygote is not None and zygote.alive

    def __iter__(self) -> Iterator[Zygote]:
        return iter(list(self._zygotes.values()))

    def __len__(self) -> int:
        return len(self._zygotes)

    def keys(self) -> list[ZygoteKey]:
        """The keys of the zygotes there are now (running or starting)."""
        return list(self._zygotes)

    def touch(self, policy: str, tenant: Tenant | None) -> None:
        """A job of ``tenant`` took a jail of ``policy`` its zygote made earlier (a pooled
        one): that is use of the zygote, which keeps it from being retired."""
        key = self.key(policy, tenant)
        if key is not None and key in self._zygotes:
            self._used[key] = time.monotonic()

    def on_retire(self, hook: RetireHook) -> None:
        """Run ``hook(policy, uid)`` before a uid's zygote is retired."""
        self._retire_hooks.append(hook)

    # -- start-up

    def serve(self, policy: Policy) -> None:
        """Serve ``policy``'s jails from zygotes."""
        self.policies[policy.name] = policy

    def _zygote(self, key: ZygoteKey) -> Zygote:
        zygote = self._zygotes.get(key)
        if zygote is None:
            assert self._make is not None, "a ZygoteSet without a factory serves no policy"
            zygote = self._zygotes[key] = self._make(self.policies[key[0]], key[1])
        return zygote

    async def start(self, policy: str) -> None:
        """Start-up: start (and wait for) the zygote of ``policy`` for the daemon's own uid
        (in ``policy`` scope, the policy's only one).

        Raises:
            ZygoteError, OSError: it did not come up (the policy is not served).
        """
        key = self.key(policy, self.own_uid)
        assert key is not None, policy
        self._used[key] = time.monotonic()
        try:
            await self._zygote(key).ensure_started()
        except BaseException:
            self._drop(key)
            raise

    def run(self) -> None:
        """Begin the background work (starts on demand, the idle sweep) until :meth:`close`."""
        self._scope_task = asyncio.get_running_loop().create_task(self._run(), name="zygotes")

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as work:
                self._work = work
                for key in list(self._starting):  # asked for before the work began
                    work.create_task(self._start_one(key), name=f"zygote {key}")
                if self.scope == "uid":
                    work.create_task(self._sweep())
                await self._closing.wait()
        except Exception:
            log.exception("zygotes: the background work crashed; no zygote starts on demand")
        finally:
            self._work = None
            self._closing.set()

    # -- jobs

    def for_job(self, policy: Policy, tenant: Tenant | None, *, pooled: bool) -> Zygote | None:
        """The ready zygote to fork ``tenant``'s jail of ``policy`` from, or None: spawn it
        (the zygote, if one may serve it, is then started in the background). A pooled
        jail (made ahead of its job) does not count as use."""
        key = self.key(policy.name, tenant)
        if key is None:
            return None
        if not pooled:
            self._used[key] = time.monotonic()
        zygote = self._zygotes.get(key)
        if zygote is not None and zygote.alive:
            return zygote
        self._start_later(key)
        return None

    def _start_later(self, key: ZygoteKey) -> None:
        if self._closing.is_set() or key in self._starting:
            return
        self._starting.add(key)
        if self._work is not None:
            self._work.create_task(self._start_one(key), name=f"zygote {key}")
        # else: :meth:`_run` starts it as soon as the background work begins

    async def _start_one(self, key: ZygoteKey) -> None:
        try:
            if key not in self._zygotes and self._tenant_count() >= self.max_zygotes:
                await self._retire_least_used(key)
                if self._tenant_count() >= self.max_zygotes:
                    log.info(
                        "zygotes: %d of client uids running (limits.max_zygotes); the jobs "
                        "of uid %s of policy %s are spawned",
                        self._tenant_count(),
                        key[1],
                        key[0],
                    )
                    return
            try:
                await self._zygote(key).ensure_started()
            except (ZygoteError, OSError) as exc:
                log.warning("zygote of policy %s for uid %s did not start: %s", *key, exc)
                self._drop(key)
        finally:
            self._starting.discard(key)

    # -- retiring

    async def _sweep(self) -> None:
        period = max(0.05, min(self.idle_s / 4, 5.0))
        while not await self._closed_within(period):
            now = time.monotonic()
            for key in list(self._zygotes):
                if (key in self._starting or key[1] == self.own_uid
                        or now - self._used.get(key, now) < self.idle_s):
                    continue  # the daemon's own zygotes (start-up's) stay
                await self._retire(key)

    def _tenant_count(self) -> int:
        """Zygotes of client uids other than the daemon's own (those are started at start-up,
        one per policy, and not counted against ``max_zygotes``)."""
        return sum(1 for _, uid in self._zygotes if uid is not None and uid != self.own_uid)

    async def _retire_least_used(self, wanted: ZygoteKey) -> None:
        candidates = sorted(
            (
                k
                for k in self._zygotes
                if k != wanted and k not in self._starting and k[1] != self.own_uid
            ),
            key=lambda k: self._used.get(k, 0.0),
        )
        for key in candidates:
            if await self._retire(key):
                return

    async def _retire(self, key: ZygoteKey) -> bool:
        """Retire the zygote of ``key`` if no jail of it runs a job: its uid's waiting jails
        go first (the hooks), then it stops once nothing of it is left. Did it stop?"""
        zygote = self._zygotes.get(key)
        if zygote is None:
            return True
        if key[1] is not None:
            for hook in self._retire_hooks:
                await hook(key[0], key[1])
        if zygote.jails:  # a running job (or a discarded jail not yet reaped): next sweep
            return False
        log.info("zygote of policy %s for uid %s: idle, stopped", *key)
        self._drop(key)
        return True

    def _drop(self, key: ZygoteKey) -> None:
        zygote = self._zygotes.pop(key, None)
        self._used.pop(key, None)
        if zygote is not None:
            zygote.stop()
            if self._release is not None:
                self._release(zygote)

    async def _closed_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closing.wait()
        return self._closing.is_set()

    # -- the end

    def pids(self) -> set[int]:
        """The nsjail pids of the running zygotes (the daemon's children)."""
        return {z.pid for z in self._zygotes.values() if z.pid is not None}

    async def close(self) -> None:
        """Stop the background work and wait for it (a zygote being started is stopped)."""
        self._closing.set()
        for key in list(self._starting):
            self._drop(key)
        if self._scope_task is not None:
            await self._scope_task
            self._scope_task = None

    def stop_all(self) -> None:
        """Stop every zygote (their jails die with them), and start no more; the background
        work then ends by itself (:meth:`close` waits for it)."""
        self._closing.set()
        for key in list(self._zygotes):
            self._drop(key)


__all__ = ["SCOPES", "MakeZygote", "ZygoteKey", "ZygoteSet"]
