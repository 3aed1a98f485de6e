"""Running the server: bind the address first (so problems are one line), then hand the socket to uvicorn."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from collections.abc import Sequence

from minigpt.errors import MinigptError
from minigpt.serve.config import ServeConfig
from minigpt.serve.models import ServedModel

__all__ = ["bind", "run_server"]


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a MinigptError saying why not (port taken, unknown host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise MinigptError(f"cannot listen on {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart at once
    try:
        sock.bind(address)
        sock.listen(2048)  # clients that connect before uvicorn takes over wait in the backlog
    except OSError as e:
        sock.close()
        hint = ": another program is using it, choose another --port" if e.errno == errno.EADDRINUSE else ""
        raise MinigptError(f"cannot listen on {host}:{port} ({e.strerror}){hint}") from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def require_extra() -> None:
    """FastAPI and uvicorn (the `serve` extra) are installed, or a one-line error says how to install them."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MinigptError(
            "minigpt serve needs FastAPI and uvicorn: pip install 'minigpt[serve]' "
            "(pip install -e '.[serve]' in a checkout)"
        ) from None


def run_server(models: Sequence[ServedModel], cfg: ServeConfig) -> None:
    """Serve until Ctrl-C (or SIGTERM) on `cfg`'s address; the address is printed on stderr once it is bound."""
    import uvicorn

    from minigpt.serve.app import create_app

    host, api_key = cfg.host, cfg.api_key or None  # an empty MINIGPT_API_KEY asks for no key
    sock = bind(host, cfg.port)
    app = create_app(models, cfg.limits, api_key)
    for m in models:
        print(
            f"model {m.id!r}: {m.run} ({m.engine.name} engine, {m.engine.device}, {m.engine.dtype})",
            file=sys.stderr,
        )
    if not _is_loopback(host) and api_key is None:
        print(
            f"warning: listening on {host} without --api-key: anyone who can reach this port can use it",
            file=sys.stderr,
        )
    url = _url(sock)
    print(f"serving on {url}/ (OpenAI API at {url}/v1; Ctrl-C stops)", file=sys.stderr, flush=True)
    # a stream still open at Ctrl-C gets a few seconds to finish before its connection is closed
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3))
    server.run(sockets=[sock])
    if not server.started:
        raise MinigptError("the server did not start (see the log above)")
