"""A small fake Kubernetes API server for tests: the pods of a cluster, LIST and WATCH.

Enough of ``/api/v1/pods`` for :class:`jaild.daemon.identity.PodDirectory`: a LIST (with a
``spec.nodeName`` field selector) answered with the current resourceVersion, and a streaming
WATCH (chunked JSON lines) from a resourceVersion, with BOOKMARK events on demand, a 410
``ERROR`` event for a resourceVersion older than the kept history (:meth:`expire`), and
watches that can be ended cleanly or dropped (:meth:`close_watches`). Bearer-token checked
when ``token`` is set (401 otherwise); HTTPS when given a certificate (``tests/tls.py``).
It listens on loopback, or on ``host`` (a container bridge's address, for a daemon in a
container: ``tests/integration/test_pods_container.py``).

    with FakeKubeAPI(token="t0ken", tls=(cert, key)) as api:
        api.add_pod(make_pod("2c6b3a1e-8f7d-4c2a-9b1e-0a1b2c3d4e5f", "web-0"))
        ... PodDirectory(api.url, "node-a", token_file, ca_file) ...
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import socket
import ssl
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NODE = "node-a"


def make_pod(uid: str, name: str, namespace: str = "default", node: str = NODE,
             service_account: str = "default", phase: str = "Running",
             containers: tuple[str, ...] = (), slots: int = 0,
             slot_resource: str = "jaild.dev/slots") -> dict[str, Any]:
    """A pod object as the API returns it (the fields the directory reads, and a few more);
    ``containers``: the ids its status reports (``containerd://<id>``); ``slots``: its first
    container's request (= limit) of ``slot_resource``, as an agent's (0: none)."""
    specs: list[dict[str, Any]] = [{"name": f"c{i}", "image": "python:3.11"}
                                   for i in range(max(1, len(containers)))]
    if slots:
        specs[0]["resources"] = {"requests": {slot_resource: str(slots)},
                                 "limits": {slot_resource: str(slots)}}
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"uid": uid, "name": name, "namespace": namespace,
                     "labels": {"app": name}, "resourceVersion": ""},
        "spec": {"nodeName": node, "serviceAccountName": service_account,
                 "containers": specs},
        "status": {"phase": phase, "containerStatuses": [
            {"name": f"c{i}", "containerID": f"containerd://{cid}", "ready": True}
            for i, cid in enumerate(containers)]},
    }


class _Server(ThreadingHTTPServer):
    """Binds with ``IP_FREEBIND``: an address not (yet) on this host -- a container
    bridge's, which some network back ends make only with the first container -- is bound
    all the same, and answers once it is there."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND (linux/in.h)
        super().server_bind()


class FakeKubeAPI:
    """The fake API server, serving in threads until :meth:`stop` (or the ``with`` ends)."""

    def __init__(self, token: str | None = None,
                 tls: tuple[str, str] | None = None, host: str = "127.0.0.1") -> None:
        self.token = token  # the bearer token expected (None: no check); may be changed
        self._cond = threading.Condition()
        self._rv = 1000
        self._oldest = self._rv  # a watch from before this resourceVersion gets 410
        self._pods: dict[str, dict[str, Any]] = {}
        self._events: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, pod)
        self._bookmarks = 0
        self._gone = 0
        self._closes = 0
        self._abrupt = False
        self._stopped = False
        self.lists = 0
        self.watches = 0
        self.watch_versions: list[str] = []  # the resourceVersion each watch asked from
        self.unauthorized = 0
        self.active_watches = 0
        self.host = host
        self._server = _Server((host, 0), self._handler_class())
        self._server.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True, name="fake-kube-api")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def __enter__(self) -> FakeKubeAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # --- changing the cluster

    def _change(self, kind: str, pod: dict[str, Any]) -> int:
        with self._cond:
            self._rv += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self._rv)
            if kind == "DELETED":
                self._pods.pop(pod["metadata"]["uid"], None)
            else:
                self._pods[pod["metadata"]["uid"]] = pod
            self._events.append((self._rv, kind, pod))
            self._cond.notify_all()
            return self._rv

    def add_pod(self, pod: dict[str, Any]) -> int:
        """Create a pod; its resourceVersion."""
        return self._change("ADDED", pod)

    def modify(self, uid: str, **changes: Any) -> int:
        """Change a pod: ``phase=``, ``deletion_timestamp=``, or ``labels=``."""
        with self._cond:
            pod = copy.deepcopy(self._pods[uid])
        if "phase" in changes:
            pod["status"]["phase"] = changes["phase"]
        if "deletion_timestamp" in changes:
            pod["metadata"]["deletionTimestamp"] = changes["deletion_timestamp"]
        if "labels" in changes:
            pod["metadata"]["labels"] = changes["labels"]
        return self._change("MODIFIED", pod)

    def delete_pod(self, uid: str) -> int:
        with self._cond:
            pod = self._pods[uid]
        return self._change("DELETED", pod)

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._rv)

    # --- the watches

    def bookmark(self) -> None:
        """Every open watch sends a BOOKMARK with the current resourceVersion."""
        with self._cond:
            self._bookmarks += 1
            self._cond.notify_all()

    def expire(self) -> None:
        """Compact the history: open watches get a 410 ERROR event and end; a watch from an
        older resourceVersion gets one at once (a LIST, then a watch from it, is fine)."""
        with self._cond:
            self._oldest = self._rv + 1
            self._gone += 1
            self._cond.notify_all()

    def close_watches(self, abrupt: bool = False) -> None:
        """End the open watches: cleanly (the last chunk sent), or ``abrupt`` (the
        connection dropped mid-stream)."""
        with self._cond:
            self._closes += 1
            self._abrupt = abrupt
            self._cond.notify_all()

    # --- serving

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api._serve(self)

        return Handler

    def _reply(self, h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _status(self, h: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        self._reply(h, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "message": message, "reason": reason, "code": code})

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            with self._cond:
                self.unauthorized += 1
            self._status(h, 401, "Unauthorized", "Unauthorized")
            return
        if url.path != "/api/v1/pods":
            self._status(h, 404, "NotFound", f"no {url.path}")
            return
        node = None
        selector = query.get("fieldSelector", "")
        if selector:
            key, _, node = selector.partition("=")
            if key != "spec.nodeName":
                self._status(h, 400, "BadRequest", f"unsupported field selector {selector}")
                return
        if query.get("watch") in ("1", "true"):
            self._watch(h, node, query.get("resourceVersion", ""),
                        query.get("allowWatchBookmarks") == "true")
        else:
            self._list(h, node)

    def _on(self, pod: dict[str, Any], node: str | None) -> bool:
        return node is None or pod["spec"].get("nodeName") == node

    def _list(self, h: BaseHTTPRequestHandler, node: str | None) -> None:
        with self._cond:
            self.lists += 1
            items = [p for p in self._pods.values() if self._on(p, node)]
            body = {"kind": "PodList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}
        self._reply(h, 200, body)

    def _due(self, closes: int, gone: int, marks: int, since: int) -> bool:
        """Has something happened that an open watch must act on?"""
        return (self._stopped or self._closes != closes or self._gone != gone
                or self._bookmarks != marks or bool(self._events and self._events[-1][0] > since))

    def _watch(self, h: BaseHTTPRequestHandler, node: str | None, rv: str,
               bookmarks: bool) -> None:
        with self._cond:
            self.watches += 1
            self.watch_versions.append(rv)
            since = int(rv) if rv.isdigit() else self._rv
            marks, gone, closes = self._bookmarks, self._gone, self._closes
            expired = since < self._oldest - 1
            self.active_watches += 1
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        gone_event = {"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
            "reason": "Expired", "message": f"too old resource version: {since}"}}
        abrupt = False
        try:
            if expired:
                send(gone_event)
                return
            while True:
                with self._cond:
                    self._cond.wait_for(functools.partial(self._due, closes, gone, marks, since))
                    if self._stopped:
                        return
                    if self._closes != closes:
                        abrupt = self._abrupt
                        return
                    if self._gone != gone:
                        out: list[dict[str, Any]] = [gone_event]
                        gone = -1  # then end
                    else:
                        out = [{"type": kind, "object": pod} for r, kind, pod in self._events
                               if r > since and self._on(pod, node)]
                        since = self._rv
                        if self._bookmarks != marks:
                            marks = self._bookmarks
                            if bookmarks:
                                out.append({"type": "BOOKMARK", "object": {
                                    "kind": "Pod", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(self._rv)}}})
                for event in out:
                    send(event)
                if gone == -1:
                    return
        except OSError:
            abrupt = True  # the client went away
        finally:
            with self._cond:
                self.active_watches -= 1
            h.close_connection = True
            if abrupt:
                with contextlib.suppress(OSError):
                    h.connection.shutdown(socket.SHUT_RDWR)
            else:
                with contextlib.suppress(OSError):
                    h.wfile.write(b"0\r\n\r\n")
                    h.wfile.flush()
