"""The rack's way to the node's API server as its administrator, without kubectl: JSON requests over one kept TLS
connection per thread (hundreds of pods and claims and a lease renewed every 10 s per node would cost the small
machine a TLS handshake each otherwise), and `Informer`, a list and watch that keeps a collection's objects and
tells a callback of each change, in a thread of its own."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from mpsagent_testing.cluster.layout import API_PORT, STATE

Object = dict[str, Any]
REQUEST_TIMEOUT_S = 30.0
WATCH_SESSION_S = 240
"""A watch is asked to end after this long (`timeoutSeconds`) and made again from where it was."""
WATCH_SILENT_S = WATCH_SESSION_S + 30
"""A watch connection that says nothing this long is broken."""


class ApiError(RuntimeError):
    """The API server answered a request with an error; `status` is its HTTP status."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status


def _context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(STATE / "pki" / "ca.crt"))


def _token() -> str:
    return (STATE / "admin.token").read_text().strip()


def _connection(timeout: float) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection("127.0.0.1", API_PORT, context=_context(), timeout=timeout)


class Api:
    """Requests as the node's administrator, each thread over a connection of its own, kept between requests."""

    def __init__(self) -> None:
        self._token = _token()
        self._local = threading.local()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}

    def request(self, method: str, path: str, body: object = None, *, content_type: str = "application/json") -> Any:
        """The decoded answer; ApiError for an error answer. A kept connection the server closed meanwhile is
        opened again once."""
        data = None if body is None else json.dumps(body).encode()
        headers = self.headers()
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = self._local.connection = _connection(REQUEST_TIMEOUT_S)
            try:
                connection.request(method, path, body=data, headers=headers)
                response = connection.getresponse()
                answer = response.read()
                break
            except (http.client.HTTPException, OSError):
                connection.close()
                self._local.connection = None
                if attempt == 2:
                    raise
        if response.status >= 400:
            message = answer.decode(errors="replace")
            with contextlib.suppress(ValueError):
                message = json.loads(answer).get("message", message)
            raise ApiError(method, path, response.status, message)
        return json.loads(answer) if answer else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def create(self, path: str, body: Object) -> Object:
        created: Object = self.request("POST", path, body)
        return created

    def patch(self, path: str, body: Object) -> Object:
        """A merge patch."""
        patched: Object = self.request("PATCH", path, body, content_type="application/merge-patch+json")
        return patched

    def delete(self, path: str, body: Object | None = None, *, missing_ok: bool = True) -> None:
        try:
            self.request("DELETE", path, body)
        except ApiError as exc:
            if not (missing_ok and exc.status == 404):
                raise


Callback = Callable[[str, Object], None]


class Informer:
    """The objects of one collection (`path`, with an optional `query` such as a field selector) as the server has
    them, listed and then watched in a thread of its own; `changed(kind, object)` is called for each change
    (`ADDED`, `MODIFIED`, `DELETED`) in the watch thread, after `objects` holds it."""

    def __init__(self, api: Api, path: str, query: str = "", *, changed: Callback | None = None) -> None:
        self._api = api
        self._path = path
        self._query = query
        self._changed = changed or (lambda kind, item: None)
        self._lock = threading.Lock()
        self._objects: dict[str, Object] = {}
        self._stopping = threading.Event()
        self._watch: http.client.HTTPSConnection | None = None
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        """What ended the watch thread, when something did."""

    def start(self) -> Informer:
        version = self._list()
        self._thread = threading.Thread(target=self._run, args=(version,), name=f"watch {self._path}", daemon=True)
        self._thread.start()
        return self

    def objects(self) -> dict[str, Object]:
        """A copy of the objects by name (`namespace/name` for namespaced ones)."""
        with self._lock:
            return dict(self._objects)

    def stop(self) -> None:
        self._stopping.set()
        watch = self._watch
        if watch is not None and watch.sock is not None:
            with contextlib.suppress(OSError):
                watch.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(10)

    def _list(self) -> str:
        listed = self._api.get(f"{self._path}?{self._query}")
        with self._lock:
            before = self._objects
            self._objects = {_key(item): item for item in listed["items"]}
        for key in before.keys() - self._objects.keys():
            self._changed("DELETED", before[key])
        for item in listed["items"]:
            if before.get(_key(item)) != item:
                self._changed("ADDED" if _key(item) not in before else "MODIFIED", item)
        version: str = listed["metadata"]["resourceVersion"]
        return version

    def _run(self, version: str) -> None:
        try:
            while not self._stopping.is_set():
                version = self._follow(version)
        except BaseException as exc:
            if not self._stopping.is_set():
                self.failure = exc
                raise

    def _follow(self, version: str) -> str:
        """One watch from `version`; the version to watch from next (listed again when the server says it is too
        old)."""
        query = f"{self._query}&" if self._query else ""
        path = f"{self._path}?{query}watch=1&allowWatchBookmarks=true&resourceVersion={version}"
        connection = self._watch = _connection(WATCH_SILENT_S)
        try:
            connection.request("GET", f"{path}&timeoutSeconds={WATCH_SESSION_S}", headers=self._api.headers())
            response = connection.getresponse()
            if response.status != 200:
                raise ApiError("WATCH", path, response.status, response.read().decode(errors="replace"))
            for line in response:
                event = json.loads(line)
                kind, item = event["type"], event["object"]
                if kind == "ERROR":
                    if item.get("code") == 410:
                        return self._list()
                    raise ApiError("WATCH", path, item.get("code", 0), item.get("message", ""))
                version = item["metadata"]["resourceVersion"]
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    if kind == "DELETED":
                        self._objects.pop(_key(item), None)
                    else:
                        self._objects[_key(item)] = item
                self._changed(kind, item)
        except (OSError, http.client.HTTPException):
            if self._stopping.is_set():
                return version
            raise
        finally:
            connection.close()
        return version


def _key(item: Object) -> str:
    metadata = item["metadata"]
    return f"{metadata['namespace']}/{metadata['name']}" if metadata.get("namespace") else str(metadata["name"])
