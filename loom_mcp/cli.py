"""Command line: `loom-mcp [--stdio | --http] [--home DIR]`, `loom-mcp doctor`, `loom-mcp --version`.

In stdio mode stdout is the MCP wire: nothing here prints to it; logs go to stderr.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import sys
from pathlib import Path

from loom_mcp import __version__
from loom_mcp.install import add_install_parser, run_install

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
TOKEN_ENV = "LOOM_HTTP_TOKEN"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loom-mcp",
        description="MCP server that profiles, validates, benchmarks and gates GPU kernel changes.",
    )
    parser.add_argument("--version", action="version", version=f"loom-mcp {__version__}")
    parser.add_argument("--home", type=Path, help="state directory (ledger, artifacts); env LOOM_HOME")
    parser.add_argument("--log-level", default=os.environ.get("LOOM_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stdio", action="store_true", help="serve MCP over stdio (the default)")
    mode.add_argument("--http", action="store_true", help="serve MCP over streamable HTTP at /mcp")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    parser.add_argument("--allow-remote", action="store_true",
                        help=f"permit a non-loopback bind; requires a bearer token in ${TOKEN_ENV}")
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser("doctor", help="report devices, toolchains, profilers and what will not work")
    doctor.add_argument("--json", action="store_true", help="machine-readable report")
    demo = sub.add_parser("demo", help="drive the whole loop through the MCP protocol on a built-in task")
    demo.add_argument("--workdir", type=Path, help="where to create the demo repository (default: a temp dir)")
    check = sub.add_parser("check", help="validate and benchmark a candidate locally; prints JSON (no MCP)")
    check.add_argument("--task", required=True)
    check.add_argument("--candidate", required=True)
    check.add_argument("--baseline")
    check.add_argument("--shapes", help="comma-separated shape names")
    add_install_parser(sub)
    return parser


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.home:
        os.environ["LOOM_HOME"] = str(args.home)

    if args.command == "install":
        return run_install(args)

    if args.command == "doctor":
        from loom_mcp.doctor import run_doctor

        return run_doctor(args.home, as_json=args.json)

    if args.command == "demo":
        from loom_mcp.demo import run_demo

        return run_demo(args.workdir)

    from loom_mcp.config import load_config
    from loom_mcp.errors import LoomError

    try:
        config = load_config(args.home)
    except LoomError as exc:
        logging.getLogger("loom_mcp").error("%s", exc)
        return 2

    if args.command == "check":
        from loom_mcp.check import run_check

        return run_check(config, args.task, args.candidate, args.baseline,
                         args.shapes.split(",") if args.shapes else None)

    if args.http:
        return serve_http(config, args.host, args.port, args.allow_remote)

    from loom_mcp.server import build_server

    build_server(config).run("stdio")
    return 0


def serve_http(config, host: str, port: int, allow_remote: bool) -> int:
    log = logging.getLogger("loom_mcp")
    token = os.environ.get(TOKEN_ENV)
    if not is_loopback(host):
        if not allow_remote:
            log.error("refusing to bind %s: not a loopback address; pass --allow-remote and set $%s",
                      host, TOKEN_ENV)
            return 2
        if not token or len(token) < 16:
            log.error("--allow-remote needs a bearer token of at least 16 characters in $%s", TOKEN_ENV)
            return 2

    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings

    from loom_mcp.server import build_server

    server = build_server(config)
    security = None
    if not is_loopback(host):
        # The bearer token is what protects a remote bind; Host checks would only block real clients.
        security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    app = server.streamable_http_app(host=host, transport_security=security)
    asgi = BearerAuth(app, token) if token else app
    log.info("serving MCP on http://%s:%d/mcp%s", host, port, " (bearer token required)" if token else "")
    uvicorn.run(asgi, host=host, port=port, log_level="warning")
    return 0


class BearerAuth:
    """ASGI wrapper: every HTTP request must carry `Authorization: Bearer <token>`."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": b"missing or wrong bearer token\n"})
                return
        await self.app(scope, receive, send)


if __name__ == "__main__":
    sys.exit(main())
