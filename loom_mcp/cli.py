"""Command line: `loom-mcp [--stdio | --http] [--home DIR]`, `loom-mcp doctor`, `loom-mcp --version`.

In stdio mode stdout is the MCP wire: nothing here prints to it; logs go to stderr. A server
that cannot start says why on stderr as one coded line ("loom-mcp: [CODE] ...", no traceback)
and exits 2 for a configuration problem (loom.toml, flags, the HTTP token) or 3 for a LOOM_HOME
that cannot be used (a damaged ledger, a read-only or full filesystem).
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
TOKEN_MIN_LENGTH = 16
TOKEN_MIN_DISTINCT = 8
# RFC 6750 b64token: what a client can put after "Bearer " unchanged (no spaces, no quotes).
_B64TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/")
TOKEN_RULE = (
    f"at least {TOKEN_MIN_LENGTH} characters, at least {TOKEN_MIN_DISTINCT} of them "
    "different, only letters, digits and - . _ ~ + / (then optional trailing =), no "
    "whitespace; make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
)

EXIT_CONFIG = 2  # loom.toml, flags, the HTTP token: the human's settings
EXIT_STATE = 3  # LOOM_HOME cannot be used: damaged ledger, read-only or full filesystem


def token_problem(token: str) -> str | None:
    """Why `token` is not an acceptable bearer token, or None when it is."""
    if any(c.isspace() for c in token):
        return "it contains whitespace"
    body = token.rstrip("=")
    if not body or any(c not in _B64TOKEN_CHARS for c in body):
        return "it has characters other than letters, digits and - . _ ~ + / (and trailing =)"
    if len(token) < TOKEN_MIN_LENGTH:
        return f"it has {len(token)} characters"
    if len(set(token)) < TOKEN_MIN_DISTINCT:
        return f"it has only {len(set(token))} different characters"
    return None


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
    parser.add_argument(
        "--log-level", default=os.environ.get("LOOM_LOG_LEVEL", "INFO"), choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stdio", action="store_true", help="serve MCP over stdio (the default)")
    mode.add_argument("--http", action="store_true", help="serve MCP over streamable HTTP at /mcp")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help=f"permit a non-loopback bind; requires a bearer token in ${TOKEN_ENV}",
    )
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
    check.add_argument(
        "--set",
        dest="task_globals",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a module-level name of the task (batch_size=2); repeatable",
    )
    add_install_parser(sub)
    return parser


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def refuse(exc: Exception, status: int) -> int:
    """A startup refusal: one coded line on stderr (stdout is the MCP wire), no traceback."""
    sys.stderr.write(f"loom-mcp: {exc}\n")
    sys.stderr.flush()
    return status


def exit_status_for(exc: Exception) -> int:
    from loom_mcp.errors import ErrorCode, LoomError

    if isinstance(exc, LoomError) and exc.code in (
        ErrorCode.CONFIG_INVALID,
        ErrorCode.BAD_INPUT,
        ErrorCode.NOT_ALLOWED,
    ):
        return EXIT_CONFIG
    return EXIT_STATE


def main(argv: list[str] | None = None) -> int:
    from loom_mcp.errors import LoomError

    try:
        return _main(argv)
    except LoomError as exc:
        return refuse(exc, exit_status_for(exc))


def _main(argv: list[str] | None = None) -> int:
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

    config = load_config(args.home)  # a LoomError ([CONFIG_INVALID]) is refused by main()

    if args.command == "check":
        from loom_mcp.check import run_check

        return run_check(
            config,
            args.task,
            args.candidate,
            args.baseline,
            args.shapes.split(",") if args.shapes else None,
            args.task_globals,
        )

    if args.http:
        return serve_http(config, args.host, args.port, args.allow_remote)

    from loom_mcp.server import build_server

    server = build_server(config)  # a ledger or LOOM_HOME it cannot use: refused by main()
    server.run("stdio")
    return 0


def serve_http(config, host: str, port: int, allow_remote: bool) -> int:
    log = logging.getLogger("loom_mcp")
    token = os.environ.get(TOKEN_ENV)
    if not is_loopback(host):
        if not allow_remote:
            log.error("refusing to bind %s: not a loopback address; pass --allow-remote and set $%s", host, TOKEN_ENV)
            return EXIT_CONFIG
        if not token:
            log.error("--allow-remote needs a bearer token in $%s: %s", TOKEN_ENV, TOKEN_RULE)
            return EXIT_CONFIG
    if token:  # a weak token is refused on loopback too: it is what guards the server then
        problem = token_problem(token)
        if problem:
            log.error("$%s is not an acceptable bearer token (%s); it must have %s", TOKEN_ENV, problem, TOKEN_RULE)
            return EXIT_CONFIG

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
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")],
                    }
                )
                await send({"type": "http.response.body", "body": b"missing or wrong bearer token\n"})
                return
        await self.app(scope, receive, send)


if __name__ == "__main__":
    sys.exit(main())
