"""One gRPC server on one unix socket file in the kubelet's directories, the same for both plugins: served
owner-only (a stale socket at the path removed first, anything else there refused), closed with a grace for the
running requests, and its file removed unless it is no longer the one served."""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path

import anyio
from grpclib.server import Server

from mpsagent.base.errors import HostError
from mpsagent.base.host import FileIdentity, file_identity
from mpsagent.base.logs import get_logger
from mpsagent.kubelet.wire import Servable, bounded_server, start_owner_only

log = get_logger(__name__)

CLOSE_GRACE_S = 1.0
"""How long a closing server's running requests get to end."""


class ServedSocket:
    """One grpclib server on one unix socket file, which it owns: it removes the file when it closes, unless the
    file is no longer the one it created."""

    def __init__(
        self,
        path: Path,
        servables: Sequence[Servable],
        *,
        what: str,
        receive_limit: int,
        directory_hint: str,
        make_directory: bool = False,
    ) -> None:
        """`what`: the service, as messages name it; `receive_limit`: the largest request it takes (and its
        connections' flow-control window); `directory_hint`: what names the directory, for the message when the
        socket cannot be served; `make_directory`: create the socket's directory when it is missing (the DRA
        driver's own directory), rather than refuse (a directory the kubelet makes: missing, it is the wrong one)."""
        self.path = path
        self.what = what
        self._servables = servables
        self._receive_limit = receive_limit
        self._directory_hint = directory_hint
        self._make_directory = make_directory
        self._server: Server | None = None
        self._identity: FileIdentity | None = None

    @property
    def gone(self) -> bool:
        """Not served: the file is not the socket this serves (removed, or replaced), or serving it again failed."""
        return self._server is None or file_identity(self.path, follow_symlinks=False) != self._identity

    async def serve(self) -> None:
        """Serve on the socket file (removing a stale socket there first). Serving again closes the server it
        replaces first, with its connections (a client connects again through the new file): that server's file is
        gone, and closing it must not remove the new one. Raises HostError when it cannot."""
        old, self._server = self._server, None
        if old is not None:
            await _close(old)
        server = bounded_server(self._servables, self._receive_limit)
        try:
            if self._make_directory:
                self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            try:
                if not stat.S_ISSOCK(self.path.lstat().st_mode):
                    raise HostError(
                        f"cannot serve the {self.what} socket {self.path}: something else than a socket is there; "
                        "remove it"
                    )
                self.path.unlink()
                log.info("stale socket removed", socket=str(self.path))
            except FileNotFoundError:
                pass
            await start_owner_only(server, self.path)
        except OSError as exc:
            raise HostError(
                f"cannot serve the {self.what} socket {self.path} ({exc.strerror or exc}); the agent must be able to "
                f"write the kubelet's directory ({self._directory_hint})"
            ) from exc
        self._server, self._identity = server, file_identity(self.path, follow_symlinks=False)
        log.info("serving", socket=str(self.path), service=self.what)

    async def close(self) -> None:
        """Stop serving (the running requests get CLOSE_GRACE_S to end), and remove the socket file if it is still
        the one served. Shielded: it also finishes when cancelled."""
        server, self._server = self._server, None
        if server is None:
            return
        with anyio.CancelScope(shield=True):
            await _close(server)
        if file_identity(self.path, follow_symlinks=False) == self._identity:
            try:
                self.path.unlink()
            except OSError as exc:
                log.warning("socket not removed", socket=str(self.path), reason=str(exc))


async def _close(server: Server) -> None:
    server.close()
    with anyio.move_on_after(CLOSE_GRACE_S, shield=True):
        await server.wait_closed()
