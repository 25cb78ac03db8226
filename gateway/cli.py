"""The ``mcp-gateway`` command: run, check-config, connect, status, audit verify, version."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial

import trio

from gateway import __version__, config
from gateway.errors import ConfigError

LOGGER = logging.getLogger("gateway")


def _load(path: str, *, check_commands: bool) -> config.GatewayConfig:
    data = config.read_file(path)
    return config.load(data, base_dir=os.path.dirname(os.path.abspath(path)),
                       check_commands=check_commands)


def _load_or_report(path: str, prefix: str = "") -> config.GatewayConfig | None:
    """Load and validate ``path``; print every problem to stderr and return None if invalid."""
    try:
        return _load(path, check_commands=True)
    except OSError as exc:
        print(f"{prefix}{path}: {exc.strerror or exc}", file=sys.stderr)
    except ConfigError as exc:
        for error in exc.errors:
            print(f"{prefix}{path}: {error}", file=sys.stderr)
    return None


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate like ``run`` does before it binds anything: every key, the boot guards for
    listeners off loopback (:mod:`gateway.guards`), backend commands, the TLS certificate
    and key loaded as the listeners would load them, and ``auth.tokens_file``."""
    cfg = _load_or_report(args.config)
    if cfg is None:
        return 1
    if cfg.listen.tls_cert is not None and cfg.listen.tls_key is not None:
        from gateway.transports import tls

        try:
            tls.server_context(cfg.listen.tls_cert, cfg.listen.tls_key)
        except tls.TlsError as exc:
            print(f"{args.config}: {exc}", file=sys.stderr)
            return 1
    problems = _tokens_file_problems(cfg) + _audit_problems(cfg)
    for problem in problems:
        print(f"{args.config}: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{args.config}: ok ({len(cfg.backends)} backends: {', '.join(cfg.backends) or 'none'})")
    return 0


def _tokens_file_problems(cfg: config.GatewayConfig) -> list[str]:
    """``auth.tokens_file`` read as start and reload read it (``ExecReload`` runs check-config
    before the SIGHUP: a file the reload would refuse fails ``systemctl reload`` itself).  Run
    as root, its owner is not checked: the service's user is not known here."""
    from gateway.auth.authenticator import load_tokens_file, tokens_path

    path = tokens_path(cfg)
    if path is None:
        return []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            pass  # reported by the load
    try:
        load_tokens_file(path, owner)
    except ConfigError as exc:
        return exc.errors
    return []


def _audit_problems(cfg: config.GatewayConfig) -> list[str]:
    """``[audit]`` as the start reads it: the journal's extra, and ``key_file`` when it exists
    (the start creates a missing one).  Run as root, its owner is not checked (as above)."""
    if not cfg.audit.enabled:
        return []
    from gateway.ops import audit

    problems = []
    if cfg.audit.journald:
        try:
            audit.journal_sender()
        except ConfigError as exc:
            problems.extend(exc.errors)
    path = cfg.audit.key_file
    if os.path.lexists(path):
        try:
            owner = os.lstat(path).st_uid if os.geteuid() == 0 else None
            audit.load_key(path, create=False, owner=owner)
        except ConfigError as exc:
            problems.extend(exc.errors)
        except OSError as exc:
            problems.append(f"audit.key_file: {path}: {exc}")
    return problems


def cmd_run(args: argparse.Namespace) -> int:
    from gateway import service
    from gateway.ops.logs import setup_logging

    cfg = _load_or_report(args.config, "mcp-gateway: ")
    if cfg is None:
        return 1
    setup_logging(args.log_level or cfg.gateway.log_level, cfg.gateway.log_target)
    failed = False
    try:
        trio.run(lambda: service.run(cfg, config_path=args.config, handle_signals=True,
                                     subreaper=True))
    except* service.StartupError as group:
        for exc in _leaves(group):
            LOGGER.critical("cannot start: %s", exc)
        failed = True
    return 1 if failed else 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def read_token_file(path: str) -> str:
    """The bearer token in ``path`` (its first line, stripped).

    Raises:
        OSError: unreadable; ValueError: empty, or not a single token.
    """
    with open(path, encoding="utf-8") as f:
        token = f.readline(8192).strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{path}: expected the token on its first line")
    return token


def _token_option(args: argparse.Namespace, command: str) -> tuple[bool, str | None]:
    """Whether ``--token-file`` could be read (else said on stderr), and its token (None
    without the option)."""
    if not args.token_file:
        return True, None
    try:
        return True, read_token_file(args.token_file)
    except (OSError, ValueError) as exc:
        print(f"mcp-gateway {command}: --token-file: {exc}", file=sys.stderr)
        return False, None


def cmd_connect(args: argparse.Namespace) -> int:
    from gateway.transports.bridge import bridge

    read, token = _token_option(args, "connect")
    if not read:
        return 1
    ssl_context = None
    if args.ca_file:
        import ssl

        try:
            ssl_context = ssl.create_default_context(cafile=args.ca_file)
        except (OSError, ssl.SSLError) as exc:
            print(f"mcp-gateway connect: --ca-file: {args.ca_file}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
    try:
        trio.run(partial(bridge, args.url, args.max_message_bytes, token=token,
                         ssl_context=ssl_context))
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"mcp-gateway connect: {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0


DEFAULT_CONFIG = "/etc/mcp-gateway/gateway.toml"  # where the Debian package puts it


def _admin_target(args: argparse.Namespace, command: str, off: str = ""
                  ) -> tuple[str, int, str | None] | None:
    """The admin listener's address in ``--config`` and the ``--token-file`` token, or None
    (said on stderr: no config, admin.listen off, the token file unreadable)."""
    from gateway.ops import statuscmd

    cfg = _load_or_report(args.config, f"mcp-gateway {command}: ")
    if cfg is None:
        return None
    if not cfg.admin.listen:
        print(f"mcp-gateway {command}: {args.config}: admin.listen is off{off}", file=sys.stderr)
        return None
    read, token = _token_option(args, command)
    if not read:
        return None
    return (*statuscmd.admin_address(cfg.admin.listen), token)


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from gateway.ops import statuscmd

    admin = _admin_target(args, "status", ": no /status to read")
    if admin is None:
        return statuscmd.EXIT_UNREACHABLE
    try:
        doc = statuscmd.fetch(*admin)
    except statuscmd.StatusUnavailable as exc:
        print(f"mcp-gateway status: {exc}", file=sys.stderr)
        return statuscmd.EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(statuscmd.render(doc)))
    return statuscmd.EXIT_REQUIRED_DOWN if statuscmd.required_down(doc) else 0


def cmd_authorize(args: argparse.Namespace) -> int:
    from gateway.ops import statuscmd

    admin = _admin_target(args, "authorize")
    if admin is None:
        return 1
    host, port, token = admin
    try:
        code, text = statuscmd.authorize(host, port, args.backend, token)
    except statuscmd.StatusUnavailable as exc:
        print(f"mcp-gateway authorize: {exc}", file=sys.stderr)
        return 1
    if code != 200:
        print(f"mcp-gateway authorize: {text}", file=sys.stderr)
        return 1
    print(text)
    return 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from gateway.ops import audit

    try:
        key = audit.load_key(args.key_file, create=False)
    except ConfigError as exc:
        print(f"mcp-gateway audit verify: {'; '.join(exc.errors)}", file=sys.stderr)
        return 2
    try:
        intact, message = audit.verify_files(key, args.files)
    except OSError as exc:
        print(f"mcp-gateway audit verify: {exc}", file=sys.stderr)
        return 2
    print(message if intact else f"broken: {message}", file=sys.stdout if intact else sys.stderr)
    return 0 if intact else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcp-gateway",
                                     description="Many MCP servers behind one endpoint.")
    parser.add_argument("--version", action="version", version=f"mcp-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="serve until SIGTERM/SIGINT (SIGHUP reloads the config)")
    p.add_argument("--config", "-c", required=True)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("check-config", help="validate a config file; exit 0 if it is valid")
    p.add_argument("config")
    p.set_defaults(func=cmd_check_config)
    p = sub.add_parser("connect", help="stdio bridge: ws://HOST:PORT/, http://HOST:PORT/mcp or "
                                       "unix:/path/to/mcp.sock")
    p.add_argument("url")
    p.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--token-file", help="a file holding the bearer token, sent as Authorization: "
                   "Bearer on the WebSocket upgrade or on every HTTP request")
    p.add_argument("--ca-file", help="verify an https:// or wss:// server with the CA certificates "
                   "(PEM) in this file instead of the system CAs (default: the system CAs, or "
                   "the file SSL_CERT_FILE names)")
    p.set_defaults(func=cmd_connect)
    p = sub.add_parser("status", help="the running daemon's /status as a table; exit 2 when a "
                                      "required backend is not RUNNING, 1 when unreachable")
    p.add_argument("--config", "-c", default=DEFAULT_CONFIG,
                   help=f"the daemon's config, for its admin listener (default {DEFAULT_CONFIG})")
    p.add_argument("--token-file", help="a file holding the admin bearer token (when "
                   "admin.token_sha256 is set: the config holds only its hash)")
    p.add_argument("--json", action="store_true", help="print the /status document as JSON")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("authorize", help="print the URL that authorizes the gateway at a "
                       "remote backend with oauth.grant = 'authorization_code' (open it in a "
                       "browser; the redirect comes back to listen.redirect_path)")
    p.add_argument("backend")
    p.add_argument("--config", "-c", default=DEFAULT_CONFIG,
                   help=f"the daemon's config, for its admin listener (default {DEFAULT_CONFIG})")
    p.add_argument("--token-file", help="a file holding the admin bearer token")
    p.set_defaults(func=cmd_authorize)
    p = sub.add_parser("audit", help="the audit log")
    audit_sub = p.add_subparsers(dest="audit_command", required=True)
    p = audit_sub.add_parser("verify", help="check the MAC chain of audit files (oldest first); "
                             "exit 0 when intact, 1 naming the first broken file:line, 2 when "
                             "the key or a file cannot be read")
    p.add_argument("--key-file", required=True,
                   help="the [audit] key_file the log was written with")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_audit_verify)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
