"""``shardwise explore``: a web page that drives a real sharded training run.

    shardwise explore [--port 8765] [--ranks 2] [--open] [--host 127.0.0.1]

The server (aiohttp: an HTTP server and WebSockets in one maintained package, on asyncio,
which also runs the rank processes' pipes) serves the page and one WebSocket per page. Pages
send commands (control.py); every change of the run goes to every page. It listens on
localhost unless ``--host`` says otherwise, and stops its rank processes when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import webbrowser
from importlib import resources

from .control import Explorer
from .settings import MAX_RANKS, Settings

try:
    from aiohttp import WSMsgType, web
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise SystemExit("shardwise explore needs aiohttp: pip install 'shardwise[explore]'") from exc

PAGE_FILES = {"/": ("page.html", "text/html"), "/page.js": ("page.js", "text/javascript")}


class Pages:
    """The open pages' WebSockets; ``broadcast`` sends one message to all of them."""

    def __init__(self) -> None:
        self.sockets: set[web.WebSocketResponse] = set()

    async def broadcast(self, message: dict) -> None:
        text = json.dumps(message, separators=(",", ":"))
        for ws in list(self.sockets):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(text)


def app(explorer: Explorer, pages: Pages) -> web.Application:
    """The routes: the page, its script, and /ws (commands in, the run's changes out)."""

    async def page(request: web.Request) -> web.Response:
        name, kind = PAGE_FILES[request.path]
        text = resources.files(__package__).joinpath(name).read_text()
        return web.Response(text=text, content_type=kind)

    async def websocket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=20)
        await ws.prepare(request)
        pages.sockets.add(ws)
        try:
            await ws.send_str(json.dumps(explorer.state()))
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    cmd = json.loads(msg.data)
                    problem = await explorer.command(cmd) if isinstance(cmd, dict) else "a command is a JSON object"
                except json.JSONDecodeError:
                    problem = "a command is a JSON object"
                if problem:
                    await ws.send_str(json.dumps({"type": "message", "text": problem}))
        finally:
            pages.sockets.discard(ws)
        return ws

    application = web.Application()
    for path in PAGE_FILES:
        application.router.add_get(path, page)
    application.router.add_get("/ws", websocket)
    return application


async def serve(host: str, port: int, settings: Settings, open_browser: bool) -> None:
    pages = Pages()
    explorer = Explorer(settings, pages.broadcast)
    runner = web.AppRunner(app(explorer, pages), handle_signals=False)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise SystemExit(f"shardwise explore: cannot listen on {host}:{port} ({exc.strerror}): choose another --port") from None
    site = web.SockSite(runner, sock)
    await site.start()
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    print(f"shardwise explore: {url}  ({settings.ranks} rank processes; Ctrl-C stops them and the server)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await explorer.reset(settings)
        if open_browser:
            webbrowser.open(url)
        await stop.wait()
    finally:
        await explorer.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="shardwise explore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    ap.add_argument("--ranks", type=int, default=2, help=f"rank processes of the run, 1-{MAX_RANKS} (the page can change it at Reset)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    ap.add_argument("--open", action="store_true", help="open the page in a browser")
    args = ap.parse_args(argv)
    try:
        settings = Settings(ranks=args.ranks)
    except ValueError as exc:
        ap.error(str(exc))
    asyncio.run(serve(args.host, args.port, settings, args.open))


if __name__ == "__main__":
    main()
