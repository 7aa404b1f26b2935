"""jaild.daemon.identity: which pod a cgroup names (pure), and the node's pods as the
Kubernetes API tells them (PodDirectory against tests/k8s_fake.py's fake API server).

The peer's side (reading a connecting process's cgroup, real cgroups) is in
test_identity_peer.py."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaild.daemon.identity import (
    PodDirectory,
    PodInfo,
    PodRef,
    in_kubepods,
    normalize_root,
    pod_of_cgroup,
    pod_of_path,
    pod_slots,
)
from tests.conftest import guard, until
from tests.k8s_fake import NODE, FakeKubeAPI, make_pod
from tests.tls import test_ca

UID = "2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f"
UID_ = UID.replace("-", "_")
CID = "3f9a1c0d2e4b6a8c" * 4
CID2 = "0123456789abcdef" * 4


def ref(qos: str = "burstable", driver: str = "cgroupfs", cid: str = CID) -> PodRef:
    return PodRef(UID, cid, qos, driver)  # type: ignore[arg-type]


# --- paths -------------------------------------------------------------------------------

GOOD = [
    # cgroupfs driver (containerd, docker: a bare id; CRI-O: crio-<id>)
    (f"/kubepods/pod{UID}/{CID}", ref("guaranteed")),
    (f"/kubepods/burstable/pod{UID}/{CID}", ref()),
    (f"/kubepods/besteffort/pod{UID}/{CID}", ref("besteffort")),
    (f"/kubepods/burstable/pod{UID}/crio-{CID}", ref()),
    # systemd driver
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope",
     ref("guaranteed", "systemd")),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"crio-{CID}.scope", ref("burstable", "systemd")),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"docker-{CID}.scope", ref("besteffort", "systemd")),
    # containerd's systemd-style path made without systemd (one flat component)
    (f"/kubepods-pod{UID_}.slice:crio:{CID}", ref("guaranteed", "systemd")),
    # a sub-cgroup below the container (systemd in the container, a nested runtime)
    (f"/kubepods/burstable/pod{UID}/{CID}/init.scope", ref()),
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope/a/b",
     ref("guaranteed", "systemd")),
]

# The kubelet's root nested somewhere (a kubelet in a container, minikube, kind's
# --cgroup-root=/kubelet, containerd's flat systemd form without systemd): a pod only where
# that root is configured (access.kubelet_cgroup_roots), never by default.
NESTED = [
    (f"/docker/{CID2}/kubepods/burstable/pod{UID}/{CID}", f"/docker/{CID2}", ref()),
    (f"/system.slice/containerd.service/kubepods/besteffort/pod{UID}/{CID}",
     "/system.slice/containerd.service", ref("besteffort")),
    (f"/docker/{CID2}/kubepods.slice/kubepods-burstable.slice/"
     f"kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope", f"/docker/{CID2}",
     ref("burstable", "systemd")),
    (f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope",
     "/kubelet.slice", ref("besteffort", "systemd")),
    (f"/system.slice/containerd.service/kubepods-besteffort-pod{UID_}.slice:cri-containerd:{CID}",
     "/system.slice/containerd.service", ref("besteffort", "systemd")),
]

# A process that can make cgroups of its own (a systemd-delegated user@UID.service, a
# rootless container) names them as the kubelet would, below its own subtree: no pod, by
# default or with the real roots configured.
FORGED = [
    f"/user.slice/user-1000.slice/user@1000.service/kubepods/burstable/pod{UID}/{CID}",
    f"/user.slice/user-1000.slice/user@1000.service/app.slice/kubepods.slice/"
    f"kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
    f"/system.slice/podman-rootless.scope/kubepods/pod{UID}/{CID}",
    f"/user.slice/user-1000.slice/user@1000.service/kubepods-pod{UID_}.slice:crio:{CID}",
    # seen from a cgroup namespace whose root is elsewhere (the daemon refuses to start there)
    f"/../../kubepods/burstable/pod{UID}/{CID}",
]

BAD = [
    "/", "", "/user.slice/user-1000.slice/session-3.scope", "/system.slice/jaild.service",
    "kubepods/burstable/pod" + UID + "/" + CID,  # not absolute
    # a pod but no container (the pod's own cgroup, a QoS class)
    f"/kubepods/burstable/pod{UID}", "/kubepods/burstable", "/kubepods",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
    # malformed uids: short, long, upper case, underscores in cgroupfs, dashes in systemd
    f"/kubepods/burstable/pod{UID[:-1]}/{CID}", f"/kubepods/burstable/pod{UID}0/{CID}",
    f"/kubepods/burstable/pod{UID.upper()}/{CID}", f"/kubepods/burstable/pod{UID_}/{CID}",
    f"/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{CID}.scope",
    "/kubepods/burstable/pod2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5g/" + CID,  # not hex
    "/kubepods/burstable/pod2c6b3a1e8f7d-4c2a-9b1e-0a1b-2c3d4e5f/" + CID,  # dashes moved
    "/kubepods/burstable/pod८c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f/" + CID,  # a unicode digit
    f"/kubepods/burstable/pod{UID}\n/{CID}",
    # static pods' hashes are not API uids
    f"/kubepods/burstable/pod8daa50c3a64c9ff60bb9eab7b44b56fd/{CID}",
    # malformed container ids
    f"/kubepods/burstable/pod{UID}/{CID[:-1]}", f"/kubepods/burstable/pod{UID}/{CID}0",
    f"/kubepods/burstable/pod{UID}/{CID.upper()}", f"/kubepods/burstable/pod{UID}/docker-{CID}",
    f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}",
    f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope",  # conmon, not it
    f"/kubepods.slice/kubepods-pod{UID_}.slice/evil-{CID}.scope",
    f"/kubepods/burstable/pod{UID}/{CID} ",
    # a QoS class out of place, or the wrong slice for it
    f"/kubepods/guaranteed/pod{UID}/{CID}", f"/kubepods/burstable/besteffort/pod{UID}/{CID}",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{UID_}.slice/"
    f"crio-{CID}.scope",
    f"/kubepods.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope",
    f"/kubepods.slice/kubelet-kubepods-pod{UID_}.slice/crio-{CID}.scope",
    # path traversal and other forgeries below or between the kubelet's names
    f"/kubepods/burstable/../pod{UID}/{CID}", f"/kubepods/burstable/pod{UID}/../{CID}",
    f"/kubepods/burstable/pod{UID}/{CID}/..", f"/kubepods/burstable/pod{UID}/{CID}/../x",
    f"/kubepods/burstable/pod{UID}//{CID}", f"/kubepods/burstable/pod{UID}/{CID}/",
    f"/kubepods//burstable/pod{UID}/{CID}",
    # the first kubelet root decides: a pod below something that is not one is refused
    f"/kubepods/evil/kubepods/burstable/pod{UID}/{CID}",
    # too long
    f"/kubepods/burstable/pod{UID}/{CID * 2}", f"/kubepods/burstable/pod{UID * 2}/{CID}",
]


@pytest.mark.parametrize(("path", "expected"), GOOD)
def test_kubelet_names(path: str, expected: PodRef) -> None:
    assert pod_of_path(path) == expected
    assert pod_of_cgroup(f"4:memory:{path}\n") == expected


@pytest.mark.parametrize(("path", "root", "expected"), NESTED)
def test_a_nested_kubelet_root_names_pods_only_where_configured(
        path: str, root: str, expected: PodRef) -> None:
    assert pod_of_path(path) is None and pod_of_cgroup(f"4:memory:{path}\n") is None
    assert pod_of_path(path, ("/", root)) == expected
    assert pod_of_cgroup(f"4:memory:{path}\n", (root,)) == expected


@pytest.mark.parametrize("path", FORGED)
def test_a_kubelets_names_in_a_subtree_of_ones_own_name_no_pod(path: str) -> None:
    real = ("/", "/kubelet.slice", "/system.slice/containerd.service")
    assert pod_of_path(path) is None and pod_of_path(path, real) is None
    assert pod_of_cgroup(f"4:memory:{path}\n", real) is None
    assert in_kubepods(f"4:memory:{path}\n")  # so the caller refuses it, not a host process
    # the control: the same names at the kubelet's root are the pod
    tail = path[path.index("kubepods"):]
    assert pod_of_path("/" + tail) is not None


def test_roots_are_normalized_and_checked() -> None:
    assert normalize_root("/kubelet/") == "/kubelet" and normalize_root("/") == "/"
    assert normalize_root("//a//b") == "/a/b"
    for bad in ("kubelet", "/a/../b", "/a/./b"):
        with pytest.raises(ValueError):
            normalize_root(bad)


@pytest.mark.parametrize("path", BAD)
def test_not_a_pod(path: str) -> None:
    assert pod_of_path(path) is None
    assert pod_of_cgroup(f"4:memory:{path}\n") is None


def test_a_returned_ref_has_only_the_kubelets_characters() -> None:
    for path, _ in GOOD:
        r = pod_of_path(path)
        assert r is not None
        assert set(r.pod_uid) <= set("0123456789abcdef-") and len(r.pod_uid) == 36
        assert set(r.container_id) <= set("0123456789abcdef") and len(r.container_id) == 64


V1_CGROUPFS = f"""\
12:hugetlb:/kubepods/burstable/pod{UID}/{CID}
11:cpuset:/kubepods/burstable/pod{UID}/{CID}
10:pids:/kubepods/burstable/pod{UID}/{CID}
9:memory:/kubepods/burstable/pod{UID}/{CID}
8:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}
1:name=systemd:/kubepods/burstable/pod{UID}/{CID}
0::/
"""

V1_SYSTEMD = "".join(
    f"{n}:{c}:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
    f"crio-{CID}.scope\n"
    for n, c in ((13, "freezer"), (10, "hugetlb"), (9, "pids"), (6, "memory"),
                 (4, "cpu,cpuacct"), (1, "name=systemd"))
) + "11:files:/\n0::/\n"

V2 = f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n"


def test_proc_cgroup_texts() -> None:
    assert pod_of_cgroup(V1_CGROUPFS) == ref()
    assert pod_of_cgroup(V1_SYSTEMD) == ref("burstable", "systemd")
    assert pod_of_cgroup(V2) == ref("guaranteed", "systemd")
    assert pod_of_cgroup(V2.rstrip("\n")) == ref("guaranteed", "systemd")
    # a host process, a hybrid host's systemd service
    host = "9:memory:/system.slice/ssh.service\n1:name=systemd:/system.slice/ssh.service\n0::/\n"
    assert pod_of_cgroup(host) is None and not in_kubepods(host)
    assert pod_of_cgroup("") is None


def test_which_lines_count() -> None:
    # any one of memory, pids, name=systemd or v2's line names the pod; the others say nothing
    for line in (f"9:memory:/kubepods/burstable/pod{UID}/{CID}",
                 f"3:pids:/kubepods/burstable/pod{UID}/{CID}",
                 f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}",
                 f"2:cpu,memory:/kubepods/burstable/pod{UID}/{CID}",
                 f"0::/kubepods/burstable/pod{UID}/{CID}"):
        assert pod_of_cgroup(f"{line}\n5:devices:/\n") == ref(), line
    for line in (f"8:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}",
                 f"7:freezer:/kubepods/burstable/pod{UID}/{CID}",
                 f"1:name=other:/kubepods/burstable/pod{UID}/{CID}",
                 f"0:memory:/kubepods/burstable/pod{UID}/{CID}"):  # v2's line has no names
        text = f"{line}\n9:memory:/\n"
        assert pod_of_cgroup(text) is None, line
        assert in_kubepods(text)


def test_lines_must_agree() -> None:
    other = "a" * 64
    two_containers = f"9:memory:/kubepods/burstable/pod{UID}/{CID}\n" \
                     f"3:pids:/kubepods/burstable/pod{UID}/{other}\n"
    two_pods = f"9:memory:/kubepods/burstable/pod{UID}/{CID}\n" \
               f"3:pids:/kubepods/burstable/pod{UID[:-1]}0/{CID}\n"
    two_classes = f"9:memory:/kubepods/burstable/pod{UID}/{CID}\n" \
                  f"3:pids:/kubepods/besteffort/pod{UID}/{CID}\n"
    for text in (two_containers, two_pods, two_classes):
        assert pod_of_cgroup(text) is None
        assert in_kubepods(text)  # so the caller refuses it (not a host process)


def test_malformed_texts() -> None:
    line = f"/kubepods/burstable/pod{UID}/{CID}"
    for text in (
        f"9:memory:{line}\n9:memory:{line}\n",  # a hierarchy twice (a forged line)
        f"9:memory:{line}\nx:pids:/\n",  # not a hierarchy id
        f"9:memory:{line}\n3-pids-/\n",  # not three fields
        f"९:memory:{line}\n",  # a unicode digit
        f"9:memory:{line}\n" + "5:devices:/\n" * 0 + "1:name=systemd:" + "/x" * 40000 + "\n",
    ):
        assert pod_of_cgroup(text) is None, text[:80]
    # a path may hold colons (the flat systemd form): only the first two split
    flat = f"0::/system.slice/containerd.service/kubepods-pod{UID_}.slice:cri-containerd:{CID}\n"
    assert pod_of_cgroup(flat, ("/system.slice/containerd.service",)) == ref("guaranteed",
                                                                            "systemd")


# --- the pod directory -------------------------------------------------------------------

UID2 = "7d3e2f10-0b1c-4d5e-8f90-a1b2c3d4e5f6"
UID3 = "c0ffee00-1234-4abc-8def-0123456789ab"
TOKEN = "t0ken-abc"
WAIT = guard(10)  # a liveness guard: how long a change may take to arrive


def info(uid: str, name: str, sa: str = "default", phase: str = "Running") -> PodInfo:
    return PodInfo(uid, "default", name, sa, NODE, phase)


@pytest.fixture(params=["https", "http"])
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FakeKubeAPI]:
    tls = None
    if request.param == "https":
        _ca, cert, key = test_ca(tmp_path, names=("localhost",), ips=("127.0.0.1",))
        tls = (cert, key)
    with FakeKubeAPI(token=TOKEN, tls=tls) as fake:
        yield fake


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def directory(api: FakeKubeAPI, token_file: Path, tmp_path: Path) -> PodDirectory:
    ca = str(tmp_path / "ca.pem") if api.scheme == "https" else None
    return PodDirectory(api.url, NODE, str(token_file), ca, backoff_s=(0.01, 0.2))


@pytest.fixture
def pods(api: FakeKubeAPI, token_file: Path, tmp_path: Path) -> Iterator[PodDirectory]:
    d = directory(api, token_file, tmp_path)
    yield d
    d.stop()
    assert not d.running


def started(d: PodDirectory) -> PodDirectory:
    d.start()
    assert d.wait_ready(WAIT), d.last_error
    return d


def test_a_pods_containers_are_the_ones_its_status_reports(
        api: FakeKubeAPI, pods: PodDirectory) -> None:
    api.add_pod(make_pod(UID, "web-0", containers=(CID,)))
    started(pods)
    assert pods.has_container(UID, CID)  # containerd://<id> in containerStatuses
    assert not pods.has_container(UID, CID2)  # another container of no pod's
    assert not pods.has_container(UID2, CID)  # a pod not known
    bare = make_pod(UID2, "starting")  # its container not made yet: waited for, then no
    api.add_pod(bare)
    until(lambda: pods.get(UID2) is not None, "the added pod", WAIT)
    assert not pods.has_container(UID2, CID2, wait_s=0.05)


def test_list_then_watch(api: FakeKubeAPI, pods: PodDirectory) -> None:
    api.add_pod(make_pod(UID, "web-0", service_account="web"))
    api.add_pod(make_pod(UID3, "elsewhere", node="node-b"))  # another node's pod: not ours
    started(pods)
    assert api.lists == 1
    assert pods.get(UID) == info(UID, "web-0", "web")
    assert pods.get(UID3) is None and not pods.deleted(UID3)
    assert pods.last_error is None
    until(lambda: api.watches == 1 and pods.live, "the watch", WAIT)
    assert api.watch_versions == [api.resource_version]
    # added, then modified, then deleted, each seen through the watch
    api.add_pod(make_pod(UID2, "worker", service_account="batch"))
    until(lambda: pods.get(UID2) is not None, "the added pod", WAIT)
    assert pods.get(UID2) == info(UID2, "worker", "batch")
    api.modify(UID2, phase="Pending")  # (a change the directory keeps)
    until(lambda: pods.get(UID2) == info(UID2, "worker", "batch", "Pending"), "modified", WAIT)
    api.delete_pod(UID2)
    until(lambda: pods.deleted(UID2), "the deletion", WAIT)
    assert pods.get(UID2) is None
    assert pods.get(UID) is not None and not pods.deleted(UID)
    assert api.lists == 1 and api.watches == 1  # no re-list, no reconnection on the way


def test_terminating_and_finished_pods_count_as_deleted(api: FakeKubeAPI,
                                                        pods: PodDirectory) -> None:
    api.add_pod(make_pod(UID, "a"))
    api.add_pod(make_pod(UID2, "b"))
    api.add_pod(make_pod(UID3, "c", phase="Succeeded"))  # finished before we listed
    started(pods)
    assert pods.deleted(UID3) and pods.get(UID3) is None
    api.modify(UID, deletion_timestamp="2025-01-01T00:00:00Z")  # terminating: refused now
    api.modify(UID2, phase="Failed")
    until(lambda: pods.deleted(UID) and pods.deleted(UID2), "terminating, failed", WAIT)
    assert pods.get(UID) is None and pods.get(UID2) is None
    # deletion is final: a later change to the same uid does not bring it back
    api.modify(UID, labels={"x": "y"})
    api.add_pod(make_pod(UID2, "b"))
    bookmark_rv = api.resource_version
    api.bookmark()
    until(lambda: api.watch_versions and pods.resource_version == bookmark_rv, "the events", WAIT)
    assert pods.get(UID) is None and pods.get(UID2) is None


def test_get_waits_for_a_pod_the_watch_brings(api: FakeKubeAPI, pods: PodDirectory) -> None:
    started(pods)
    assert pods.get(UID) is None  # no wait: not there
    adder = threading.Timer(0.05, lambda: api.add_pod(make_pod(UID, "late")))
    adder.start()
    try:
        assert pods.get(UID, wait_s=WAIT) == info(UID, "late")
    finally:
        adder.cancel()
    # a deleted pod is refused at once, however long the caller would wait
    api.delete_pod(UID)
    until(lambda: pods.deleted(UID), "the deletion", WAIT)
    assert pods.get(UID, wait_s=3600) is None


def test_bookmark_moves_the_resource_version(api: FakeKubeAPI, pods: PodDirectory) -> None:
    started(pods)
    until(lambda: pods.live, "the watch", WAIT)
    api.add_pod(make_pod(UID3, "elsewhere", node="node-b"))  # moves the version, unseen
    moved = api.resource_version
    api.bookmark()
    until(lambda: pods.resource_version == moved, "the bookmark", WAIT)
    api.close_watches()  # cleanly: the watch resumes from the bookmark's version
    until(lambda: api.watches == 2, "the second watch", WAIT)
    assert api.watch_versions[-1] == moved
    assert api.lists == 1
    assert pods.last_error is None  # a watch the server ends is no error


def test_gone_lists_again(api: FakeKubeAPI, pods: PodDirectory) -> None:
    api.add_pod(make_pod(UID, "a"))
    started(pods)
    until(lambda: pods.live, "the watch", WAIT)
    api.expire()  # the open watch gets a 410 ERROR event
    until(lambda: api.lists == 2, "the re-list", WAIT)
    until(lambda: api.watches == 2, "the watch after it", WAIT)
    assert api.watch_versions[-1] == api.resource_version
    # deleted while the directory could not watch, and the history lost meanwhile: only
    # the re-list can tell, by the pod it no longer lists
    api.token = "locked-out"
    api.close_watches(abrupt=True)
    until(lambda: api.unauthorized >= 1, "a refused reconnection", WAIT)
    api.delete_pod(UID)
    api.expire()
    assert not pods.deleted(UID)
    api.token = TOKEN
    until(lambda: pods.deleted(UID), "the deletion seen by the re-list", WAIT)
    assert api.lists == 3 and pods.get(UID) is None


def test_a_dropped_watch_reconnects(api: FakeKubeAPI, pods: PodDirectory) -> None:
    started(pods)
    until(lambda: pods.live, "the watch", WAIT)
    api.close_watches(abrupt=True)
    until(lambda: api.watches >= 2 and pods.live, "the reconnection", WAIT)
    api.add_pod(make_pod(UID, "after"))
    until(lambda: pods.get(UID) is not None, "a pod added after reconnecting", WAIT)
    assert api.lists == 1  # resumed from its version, no re-list


def test_a_wrong_token_is_retried_and_reported(api: FakeKubeAPI, pods: PodDirectory,
                                               token_file: Path) -> None:
    api.add_pod(make_pod(UID, "a"))
    token_file.write_text("wrong")
    pods.start()
    until(lambda: api.unauthorized >= 3, "retries", WAIT)
    assert not pods.ready
    assert pods.last_error == "KubeAPIError: HTTP 401: Unauthorized"
    assert pods.running
    token_file.write_text(TOKEN)  # rotated: read again at the next connection
    assert pods.wait_ready(WAIT)
    until(lambda: pods.live, "the watch", WAIT)
    assert pods.last_error is None
    assert pods.get(UID) == info(UID, "a")


def test_an_unreachable_server_is_retried(tmp_path: Path, token_file: Path) -> None:
    with FakeKubeAPI() as gone:
        url = gone.url
    d = PodDirectory(url, NODE, str(token_file), backoff_s=(0.01, 0.05))
    d.start()
    try:
        until(lambda: d.last_error is not None, "an error", WAIT)
        assert "ConnectionRefusedError" in d.last_error  # type: ignore[operator]
        assert d.running and not d.ready
    finally:
        d.stop()
    assert not d.running


def test_tls_needs_the_clusters_ca(tmp_path: Path, token_file: Path) -> None:
    _ca, cert, key = test_ca(tmp_path, names=("localhost",), ips=("127.0.0.1",))
    other = tmp_path / "other"
    other.mkdir()
    wrong_ca, _, _ = test_ca(other, names=("localhost",), ips=("127.0.0.1",))
    with FakeKubeAPI(token=TOKEN, tls=(cert, key)) as api:
        d = PodDirectory(api.url, NODE, str(token_file), wrong_ca, backoff_s=(0.01, 0.05))
        d.start()
        try:
            until(lambda: d.last_error is not None, "an error", WAIT)
            assert "CERTIFICATE_VERIFY_FAILED" in d.last_error  # type: ignore[operator]
            assert api.lists == 0 and not d.ready
        finally:
            d.stop()


def test_stop_ends_the_thread(api: FakeKubeAPI, pods: PodDirectory) -> None:
    started(pods)
    until(lambda: pods.live and api.active_watches == 1, "the watch", WAIT)
    pods.stop()
    assert not pods.running  # stop() wakes the blocked read; it does not wait for the server
    assert pods.get(UID, wait_s=3600) is None  # a stopped directory does not wait


def test_in_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    d = PodDirectory.in_cluster("node-7")
    assert d.api_url == "https://10.96.0.1:443" and d.node_name == "node-7"
    assert d.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert d.ca_file == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert PodDirectory.in_cluster("n").api_url == "https://[fd00::1]:443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(Exception, match="not in a cluster"):
        PodDirectory.in_cluster("n")
    with pytest.raises(ValueError):
        PodDirectory("ftp://x", "n")


def test_malformed_pods_are_ignored(api: FakeKubeAPI, pods: PodDirectory) -> None:
    bad = make_pod("not-a-uid", "bad")
    api.add_pod(bad)
    odd = make_pod(UID2, "odd")
    odd["metadata"]["namespace"] = 7
    api.add_pod(odd)
    api.add_pod(make_pod(UID, "good"))
    started(pods)
    assert [p.name for p in pods.pods()] == ["good"]


# --- how many jail slots a pod requests ---------------------------------------------------

SLOTS = "jaild.dev/slots"


def container(requests: dict[str, object] | None = None, limits: dict[str, object] | None = None,
              restart: str | None = None) -> dict[str, object]:
    c: dict[str, object] = {"name": "c", "resources": {}}
    if requests is not None:
        c["resources"] = {"requests": requests}
    if limits is not None:
        c["resources"] = {**c["resources"], "limits": limits}  # type: ignore[dict-item]
    if restart is not None:
        c["restartPolicy"] = restart
    return c


@pytest.mark.parametrize(("spec", "slots"), [
    ({"containers": [{"name": "c"}]}, 0),  # no resources at all
    ({"containers": [container({"cpu": "1", "memory": "1Gi"})]}, 0),  # others only
    ({"containers": [container({SLOTS: "2"}, {SLOTS: "2"})]}, 2),  # requests = limits
    ({"containers": [container(limits={SLOTS: "3"})]}, 3),  # the limit alone: the request
    ({"containers": [container({SLOTS: "1"}), container({SLOTS: "2"}), {"name": "x"}]}, 3),
    ({"containers": [container({"example.com/slots": "5"})]}, 0),  # another resource
    ({"containers": [container({SLOTS: "1k"})]}, 1000),  # as the API may write it back
    ({"containers": [container({SLOTS: "2e1"})]}, 20),
    ({"containers": [container({SLOTS: 4})]}, 4),
    # an init container runs alone, before the others: the larger of the two counts
    ({"containers": [container({SLOTS: "1"})], "initContainers": [container({SLOTS: "3"})]}, 3),
    ({"containers": [container({SLOTS: "2"})], "initContainers": [container({SLOTS: "1"})]}, 2),
    # a sidecar (restartPolicy Always) runs beside them: it adds
    ({"containers": [container({SLOTS: "2"})],
      "initContainers": [container({SLOTS: "1"}, restart="Always"),
                         container({SLOTS: "2"})]}, 3),
])
def test_a_pods_slots_are_what_the_scheduler_counts(spec: dict[str, object], slots: int) -> None:
    assert pod_slots(spec, SLOTS) == slots
    assert pod_slots(spec, "") == 0  # access.slot_resource = "": not read


@pytest.mark.parametrize("quantity", ["500m", "1.5", "-1", "two", ""])
def test_a_slot_request_that_is_not_a_whole_number_is_malformed(quantity: str) -> None:
    with pytest.raises(ValueError, match="not a whole quantity"):
        pod_slots({"containers": [container({SLOTS: quantity})]}, SLOTS)


def test_the_directory_reads_each_pods_slots(api: FakeKubeAPI, token_file: Path,
                                             tmp_path: Path) -> None:
    api.add_pod(make_pod(UID, "agent", slots=2))
    api.add_pod(make_pod(UID2, "plain"))
    bad = make_pod(UID3, "bad", slots=1)
    bad["spec"]["containers"][0]["resources"]["requests"][SLOTS] = "500m"
    api.add_pod(bad)
    ca = str(tmp_path / "ca.pem") if api.scheme == "https" else None
    reading = PodDirectory(api.url, NODE, str(token_file), ca, slot_resource=SLOTS)
    ignoring = PodDirectory(api.url, NODE, str(token_file), ca)  # slot_resource "": not read
    try:
        started(reading)
        started(ignoring)
        assert reading.get(UID) == dataclasses.replace(info(UID, "agent"), slots=2)
        assert reading.get(UID2) == info(UID2, "plain")  # requests none: 0
        assert reading.get(UID3) is None  # a request the API would refuse: malformed
        assert ignoring.get(UID) == info(UID, "agent")  # the control: the same pod, unread
        assert ignoring.get(UID3) is not None
    finally:
        reading.stop()
        ignoring.stop()


# --- where the kubelet's hierarchy starts -------------------------------------------------

def test_a_private_cgroup_namespace_is_refused_a_nested_or_initial_one_is_not() -> None:
    from jaild.daemon.identity import PROC_CGROUP_INIT_INO, cgroup_namespace_problem

    assert cgroup_namespace_problem(PROC_CGROUP_INIT_INO, "0::/\n") is None  # the host's
    # a container's own namespace: the daemon at its root, others at /../..
    assert "cgroup namespace of its own" in (cgroup_namespace_problem(5, "0::/\n") or "")
    assert cgroup_namespace_problem(5, "4:memory:/../x\n1:name=systemd:/\n")
    # a node that is itself a container (kind): placed below the kubelet's names
    assert cgroup_namespace_problem(
        5, f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice/"
           f"cri-containerd-{CID}.scope\n") is None


def test_roots_are_found_and_one_another_user_could_write_is_not(tmp_path: Path) -> None:
    """``detect_roots``: the kubelet's hierarchy at the top or nested; a top owned by another
    user, or writable by others, is refused (a process could make a pod's names there)."""
    from jaild.daemon.identity import check_roots, detect_roots

    base = tmp_path / "cg"
    (base / "kubepods" / "burstable").mkdir(parents=True)
    (base / "kubelet.slice" / "kubelet-kubepods.slice").mkdir(parents=True)
    (base / "user.slice" / "user-1000.slice" / "kubepods").mkdir(parents=True)
    for d in (base, base / "kubepods", base / "kubelet.slice",
              base / "kubelet.slice" / "kubelet-kubepods.slice", base / "user.slice"):
        os.chmod(d, 0o755)
    os.chown(base / "user.slice" / "user-1000.slice" / "kubepods", 1000, 1000)
    found, refused = detect_roots([str(base)])
    assert found == ["/", "/kubelet.slice"], (found, refused)
    assert any("owned by uid 1000" in why for why in refused), refused
    assert check_roots(("/", "/kubelet.slice"), [str(base)]) is None
    os.chmod(base / "kubepods", 0o777)
    assert "writable by its group or others" in (check_roots(("/",), [str(base)]) or "")
    assert detect_roots([str(base)])[0] == ["/kubelet.slice"]
