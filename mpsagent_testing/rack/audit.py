"""Each rack agent's requests as the API server itself records them: its audit log (`node.AUDIT_LOG`, the metadata of
every request of the audited namespace's service accounts, one JSON line per stage), counted per user over a window
of time: writes (create, update, patch, delete), reads (get, list), watches started, and the watches each holds open
at the window's end. The server's request metrics (`apiserver_request_total`) have no user label."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from mpsagent_testing.cluster.node import AUDIT_LOG, recorded

WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})
READS = frozenset({"get", "list"})


class NoAuditLog(RuntimeError):
    """The node's API server keeps no audit log: it was started before the node had one."""


@dataclass(frozen=True)
class Request:
    """One request: who, what, when it was received (seconds since the epoch), and, for a watch, when it ended
    (None while it is open)."""

    user: str
    verb: str
    resource: str
    received: float
    ended: float | None


@dataclass
class Requests:
    """One user's requests in a window."""

    writes: int = 0
    reads: int = 0
    watches: int = 0
    """Watches started."""
    held: int = 0
    """Watches open at the window's end."""
    by_kind: Counter[str] = field(default_factory=Counter)
    """Each `verb resource` and how often."""

    @property
    def total(self) -> int:
        return self.writes + self.reads + self.watches


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def check_audited() -> None:
    """NoAuditLog when the running API server was started without the audit log (a node brought up by an older
    checkout): the rack cannot count its agents' requests."""
    apiserver = recorded().get("kube-apiserver")
    if apiserver is None or not any(arg.startswith("--audit-log-path=") for arg in apiserver.argv):
        raise NoAuditLog(
            "the node's API server keeps no audit log (it was started before the node had one): "
            "`scripts/e2e-cluster down`, then up again"
        )


class AuditLog:
    """The audit log, read on as it grows."""

    def __init__(self, path: Path = AUDIT_LOG) -> None:
        self._path = path
        self._offset = 0
        self._requests: dict[str, Request] = {}

    def read(self) -> None:
        """Take in the lines written since the last read (a last line still being written waits)."""
        if not self._path.is_file():
            return
        with self._path.open("rb") as log:
            log.seek(self._offset)
            text = log.read()
        complete = text[: text.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            user = event["user"]["username"]
            verb, stage = event["verb"], event["stage"]
            ended = _seconds(event["stageTimestamp"]) if stage == "ResponseComplete" and verb == "watch" else None
            before = self._requests.get(event["auditID"])
            if before is not None and ended is None:
                continue
            self._requests[event["auditID"]] = Request(
                user=user,
                verb=verb,
                resource=event.get("objectRef", {}).get("resource", event["requestURI"]),
                received=_seconds(event["requestReceivedTimestamp"]),
                ended=ended,
            )

    def window(self, start: float, end: float) -> dict[str, Requests]:
        """Each user's requests received in [start, end) (seconds since the epoch), and the watches each holds open
        at `end`."""
        self.read()
        counted: dict[str, Requests] = {}
        for request in self._requests.values():
            mine = counted.setdefault(request.user, Requests())
            if request.verb == "watch" and request.received < end and (request.ended is None or request.ended >= end):
                mine.held += 1
            if not start <= request.received < end:
                continue
            mine.by_kind[f"{request.verb} {request.resource}"] += 1
            if request.verb in WRITES:
                mine.writes += 1
            elif request.verb in READS:
                mine.reads += 1
            elif request.verb == "watch":
                mine.watches += 1
        return counted
