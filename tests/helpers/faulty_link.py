"""A network link to an endpoint on this machine that the test can break: a TCP proxy on 127.0.0.1
that passes bytes through, refuses connections, accepts them and never answers (a black hole), or
slows uploads to a set rate. The clients under test reach the store only through it, as they would
reach a store over a real network; nothing here knows HTTP.

Every connection it holds is closed by ``close``; its threads end by themselves (each waits at most
``_POLL_S`` between looks at the mode), so a test that forgets nothing leaves nothing running.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

_POLL_S = 0.05
_CHUNK = 65536


class FaultyLink:
    """``url``: where clients connect instead of ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode = "pass"  # pass | refuse | blackhole | slow
        self.rate = 0  # bytes per second sent upstream, in slow mode
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._epoch = 0  # bumped when connections must be dropped (refuse, heal after a black hole)
        host, port = self._listener.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        threading.Thread(target=self._accept, name="faulty-link", daemon=True).start()

    # -- what the test does ----------------------------------------------------------------------
    def refuse(self) -> None:
        """Every connection is cut, and every new one reset at once (the endpoint went down)."""
        self._switch("refuse", drop=True)

    def blackhole(self) -> None:
        """Connections are accepted, requests read and never answered (a wedged endpoint, a
        firewall that drops packets); those open stop carrying bytes too."""
        self._switch("blackhole", drop=False)

    def slow(self, bytes_per_s: int) -> None:
        """Uploads (bytes towards the store) pass at ``bytes_per_s``; answers at full speed."""
        self.rate = bytes_per_s
        self._switch("slow", drop=False)

    def heal(self) -> None:
        """Back to a working link; connections held in a black hole are cut (their requests are lost)."""
        self._switch("pass", drop=self.mode == "blackhole")

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._listener.close()
        self._drop()

    # -- the proxy ---------------------------------------------------------------------------------
    def _switch(self, mode: str, drop: bool) -> None:
        self.mode = mode
        if drop:
            self._drop()

    def _drop(self) -> None:
        with self._lock:
            self._epoch += 1
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _reset(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self.mode == "refuse":
                _reset(client)
                continue
            with self._lock:
                self._sockets.append(client)
                epoch = self._epoch
            threading.Thread(target=self._serve, args=(client, epoch), daemon=True).start()

    def _serve(self, client: socket.socket, epoch: int) -> None:
        upstream: socket.socket | None = None
        try:
            if self.mode == "blackhole":
                self._swallow(client, epoch)
                return
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets.append(upstream)
            back = threading.Thread(target=self._pump, args=(upstream, client, epoch, False), daemon=True)
            back.start()
            self._pump(client, upstream, epoch, True)
            back.join()
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()

    def _live(self, epoch: int) -> bool:
        return not self._closed and self._epoch == epoch

    def _swallow(self, client: socket.socket, epoch: int) -> None:
        client.settimeout(_POLL_S)
        while self._live(epoch):
            try:
                if not client.recv(_CHUNK):
                    return
            except TimeoutError:
                continue

    def _pump(self, src: socket.socket, dst: socket.socket, epoch: int, towards_store: bool) -> None:
        src.settimeout(_POLL_S)
        while self._live(epoch):
            if self.mode == "blackhole":  # the link went dark under an open connection
                self._swallow(src, epoch)
                return
            try:
                data = src.recv(_CHUNK if not (towards_store and self.mode == "slow") else 4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if towards_store and self.mode == "slow" and self.rate > 0:
                time.sleep(len(data) / self.rate)
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), as a refusing endpoint's host does, not an orderly close."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
