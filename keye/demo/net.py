"""Listening ports for ``keye demo`` and ``keye serve``: claimed (or checked) before the model loads, so a busy
port is one line naming it, said at once, and no address is announced for a server that cannot start."""

from __future__ import annotations

import errno
import socket

from keye.errors import KeyeConfigError


def _error(host: str, port: int, err: OSError) -> KeyeConfigError:
    if err.errno == errno.EADDRINUSE:
        return KeyeConfigError(
            f"port {port} on {host} is already in use (another keye demo or server?); stop that program or "
            f"pick another port with --port"
        )
    if err.errno == errno.EACCES:
        return KeyeConfigError(f"cannot listen on port {port} on {host}: permission denied (ports below 1024 "
                               "need root); pick another port with --port")
    return KeyeConfigError(f"cannot listen on port {port} on {host}: {err.strerror or err}")


def bind_port(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``SO_REUSEADDR`` set, as uvicorn sets it, so a port left in
    TIME_WAIT by a previous run is reusable while one another program listens on is not).

    Raises :class:`KeyeConfigError` naming the port when it is in use, not allowed, or the host cannot be
    resolved. The caller owns the socket (``keye serve`` hands it to uvicorn).
    """
    if not 0 <= int(port) <= 65535:
        raise KeyeConfigError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise KeyeConfigError(f"cannot listen on {host}:{port}: unknown host ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise _error(host, port, err) from None
    sock.set_inheritable(True)
    return sock


def check_port(host: str, port: int) -> None:
    """Raise :class:`KeyeConfigError` naming the port when ``host:port`` cannot be listened on now (a server
    that binds it itself, like Gradio, starts next)."""
    bind_port(host, port).close()


def port_error(host: str, port: int, err: OSError) -> KeyeConfigError:
    """The one-line :class:`KeyeConfigError` for a server that failed to listen on ``host:port`` with ``err``
    (the port taken between :func:`check_port` and the server's own bind)."""
    return _error(host, port, err)
