"""Configuration: a tree of frozen msgspec Structs decoded from TOML.  Data only, no I/O.

``load(data, base_dir=…)`` returns a :class:`GatewayConfig` or raises
:class:`~gateway.errors.ConfigError` listing *every* problem with its key path
(``backends.time.restart.backoff_max: expected float, got str``): each section and each
backend is validated on its own so one typo does not hide the next.  Relative backend paths
(``command`` with a slash, ``cwd``) are resolved against ``base_dir`` (the config file's folder);
a backend without ``cwd`` runs in ``base_dir``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import stat
from collections.abc import Callable
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec

from gateway import guards, limits
from gateway.errors import ConfigError

SECONDS = 1.0
MIB = 1024 * 1024


# Each section repeats ``frozen=True``: msgspec inherits it, mypy's dataclass_transform does not.
class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class GatewaySection(Base, frozen=True):
    name: str = "mcp-gateway"
    separator: str = "__"
    max_message_bytes: int = 4 * MIB
    page_size: int = 100
    max_inflight_per_connection: int = 64
    outbound_queue: int = 512  # messages queued toward one client before it is cut off
    outbound_bytes: int = 16 * MIB  # bytes queued toward one client before it is cut off
    # a client that takes no byte of its answers for this long while its reader is stopped
    # (backpressure) is cut off: it would otherwise hold its connection forever
    write_stall_timeout: float = 30 * SECONDS
    buffered_bytes_total: int = 256 * MIB  # all queued client/backend messages, daemon-wide
    max_json_depth: int = 128  # deeper JSON is refused before it is decoded
    # what the gateway keeps between runs (a remote's refresh token: oauth/BACKEND.json, 0600)
    state_dir: str = "/var/lib/mcp-gateway"
    # client connections at once (WebSocket, HTTP, unix); None: 4096, or fewer when the
    # open-files limit does not leave room for so many (gateway.limits.fit_connections)
    max_connections: int | None = None
    restart_wait: float = 10 * SECONDS  # how long a call waits for a restarting backend
    # SIGTERM: /readyz answers 503 at once but everything is served as before for drain_delay
    # seconds (a load balancer's health check takes the replica out of rotation meanwhile);
    # then the drain: new requests refused (retryable), calls in flight get drain_grace.
    drain_delay: float = 5 * SECONDS
    drain_grace: float = 20 * SECONDS  # SIGTERM: how long in-flight calls may finish
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_target: Literal["auto", "stderr", "journal"] = "auto"
    # Era bridging (gateway.core.bridge): the replica id leads every requestState ("" = the host
    # name's first label), signed with the key in state_key_file ("" = a random key per start;
    # generated when the file is absent); a parked flow not resumed in state_ttl seconds ends.
    replica_id: str = ""
    state_key_file: str = ""
    state_ttl: float = 300 * SECONDS
    # A parked flow on a `shared` backend's child that keeps another caller's input request
    # from being attributed there is ended once parked this long (README "Era bridging").
    shared_park_limit: float = 30 * SECONDS
    # calls parked at once waiting for a modern client's retry (a consent prompt, a legacy
    # child's request): each holds its call's state between two POSTs; beyond it -32006
    max_parked_flows: int = 4096


class ListenSection(Base, frozen=True):
    websocket: str | None = "127.0.0.1:8765"  # "" switches it off
    allowed_origins: list[str] = []
    # Host names (WebSocket upgrade, /mcp) besides loopback + the bound address
    allowed_hosts: list[str] = []
    unix: str | None = None
    unix_mode: str = "0660"
    http: str | None = "127.0.0.1:8766"  # Streamable HTTP at /mcp; "" switches it off
    http_session_idle_timeout: float = 600 * SECONDS  # an HTTP session with nothing in flight ends
    http_max_sessions: int = 1024  # HTTP sessions at once; initialize beyond it gets 503
    # Off loopback: TLS on the client listeners, or a TLS-terminating
    # proxy in front (behind_proxy) reached by clients at public_url (https://…/mcp).
    tls_cert: str | None = None
    tls_key: str | None = None
    behind_proxy: bool = False
    public_url: str | None = None
    # where an authorization server sends the operator back (grant = "authorization_code"),
    # under public_url's origin (else this listener's address)
    redirect_path: str = "/oauth/callback"


class AdminSection(Base, frozen=True):
    listen: str | None = "127.0.0.1:9477"  # "" switches it off
    allow_non_loopback: bool = False  # /status shows child stderr: loopback unless explicit
    # Host names for /status, /metrics besides loopback + bound address
    allowed_hosts: list[str] = []
    token_sha256: str | None = None  # hex SHA-256 of the bearer token /status needs off loopback
    tool_latency_series: int = 100  # tools per backend with their own latency histogram


class RestartSection(Base, frozen=True):
    backoff_initial: float = 0.1
    backoff_max: float = 30.0
    max_restarts: int = 5
    window: float = 60.0


class HealthSection(Base, frozen=True):
    interval: float = 15.0  # 0 disables the ping probe
    timeout: float = 5.0
    failures: int = 3


Capability = Literal["roots", "sampling", "elicitation"]


class ItemFilter(Base, frozen=True):
    """Globs on a backend's own item names (URIs for resources): listed and callable only when
    ``include`` matches (empty: everything) and ``exclude`` does not."""

    include: list[str] = []
    exclude: list[str] = []


#: A remote backend's header value: the literal text, ``{ env = "VAR" }`` or
#: ``{ file = "/path", prefix = "Bearer " }`` (read when a link opens and on reload).
HeaderValue = str | dict[str, str]


class ClientAuth(Base, frozen=True):
    """How the gateway authenticates itself to an authorization server's token endpoint (the
    keys ``[backends.NAME.oauth]`` and ``[backends.NAME.token_exchange]`` share)."""

    client_id: str = ""
    # { file = "/path" } or { env = "VAR" }; a literal string is refused (not in the config text)
    client_secret: str | dict[str, str] | None = None
    auth_method: Literal["client_secret_basic", "client_secret_post",
                         "private_key_jwt"] = "client_secret_basic"
    private_key: str | dict[str, str] | None = None  # private_key_jwt: PEM, by reference too
    key_id: str = ""  # private_key_jwt: the assertion's kid header ("": none)
    algorithm: Literal["RS256", "ES256"] = "RS256"
    ca_file: str | None = None  # https token/metadata endpoints: their CA (else the system's)


class RemoteOAuth(ClientAuth, frozen=True):
    """``[backends.NAME.oauth]``: the gateway's own access token for a remote (OAuth 2.1
    client credentials), fetched from ``token_url`` or the one the remote's metadata names."""

    # authorization_code: an operator authorizes once (`mcp-gateway authorize`); see README
    grant: Literal["client_credentials", "authorization_code"] = "client_credentials"
    token_url: str = ""  # "": discovered (protected-resource, then authorization server metadata)
    audience: str = ""  # the assertion's aud ("": the server's issuer, else token_url)
    scope: str = ""
    resource: str = ""  # RFC 8707 resource indicator ("": the one its metadata gives, else url)
    # authorization_code: this client's Client ID Metadata Document URL, used where the
    # authorization server supports them ("": the configured client_id, else RFC 7591)
    client_metadata_url: str = ""
    offline_access: bool = True  # ask for offline_access where the server lists it


class TokenExchange(ClientAuth, frozen=True):
    """``[backends.NAME.token_exchange]``: each OAuth principal's upstream token, had by RFC 8693
    token exchange of the caller's inbound access token at ``token_url``."""

    token_url: str = ""
    audience: str = ""  # RFC 8693 audience of the token asked for ("": none)
    resource: str = ""  # RFC 8707 resource indicator ("": none; one of the two is required)
    scope: str = ""
    assertion_audience: str = ""  # private_key_jwt: the assertion's aud ("": token_url)


class BackendConfig(Base, frozen=True):
    command: str = ""  # a program to spawn (stdio), or
    url: str = ""  # a remote Streamable HTTP server (http://HOST:PORT/mcp or https://…)
    ca_file: str | None = None  # https: the CA bundle to verify the remote with (else the system's)
    headers: dict[str, HeaderValue] = {}  # sent on every request to the remote
    oauth: RemoteOAuth | None = None  # a remote's own access token (client credentials)
    # each OAuth principal's own upstream token, by RFC 8693 token exchange of its inbound one
    token_exchange: TokenExchange | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str | None = None
    prefix: str | None = None  # None: the backend's name; "": names unchanged
    request_timeout: float = 60.0
    max_call_duration: float = 900.0  # hard maximum, even while prompts pause request_timeout
    start_timeout: float = 10.0
    cancel_grace: float = 10.0  # a cancelled call unanswered this long: see README "Attribution"
    restart: RestartSection = RestartSection()
    health: HealthSection = HealthSection()
    required: bool = False
    sharing: Literal["shared", "affine", "per-session", "per-principal"] = "shared"
    # per-principal stdio: each principal's child environment ("/dir/{principal}.env")
    env_files: str | None = None
    # a remote's upstream identity: the backend's own, or each principal's (own session each)
    credentials: Literal["shared", "per-principal"] = "shared"
    token_files: str | None = None  # per-principal credentials: "/dir/{principal}.token"
    # how the child is opened: initialize (legacy) or server/discover (2026-07-28); see README
    protocol_mode: Literal["legacy_only", "prefer_legacy", "prefer_modern",
                           "modern_only"] = "prefer_legacy"
    instances: int = 1
    max_inflight: int = 32  # calls at one child at once; more wait in a queue per connection
    # a remote's connections per instance at once (None: limits.REMOTE_CONNECTIONS), each an
    # fd of the reserve; 4 of them are not calls' (gateway.backend.http splits them)
    max_connections: int | None = None
    max_sessions: int = 16  # per-session / per-principal: cap on children
    idle_timeout: float = 300.0  # per-session / per-principal: stop an idle child after this long
    queue_size: int = 64  # affine: calls waiting for an instance
    queue_timeout: float = 30.0
    roots: list[str] = []  # answered to the child's roots/list in shared/affine mode
    declare: list[Capability] = msgspec.field(
        default_factory=lambda: ["roots", "sampling", "elicitation"]
    )
    sensitive: list[str] = []  # tool names (backend's own) that need an explicit policy rule
    # what the gateway exposes of this backend at all, whatever the policy (backend's own names)
    tools: ItemFilter = msgspec.field(default_factory=lambda: ItemFilter())
    prompts: ItemFilter = msgspec.field(default_factory=lambda: ItemFilter())
    resources: ItemFilter = msgspec.field(default_factory=lambda: ItemFilter())
    stderr_lines_per_second: float = 100.0  # stderr lines logged per second (0: no limit)
    stderr_burst: int = 500  # lines logged at once before the rate applies

    @property
    def per_principal(self) -> bool:
        """One instance per authenticated principal (``sharing`` or a remote's
        ``credentials``)."""
        return self.sharing == "per-principal" or self.credentials == "per-principal"

    @property
    def owned_sharing(self) -> str:
        """The sharing mode as far as instances go (per-principal credentials imply it)."""
        return "per-principal" if self.per_principal else self.sharing


class PolicyRule(Base, frozen=True):
    match: str  # glob on the namespaced tool / prompt name, or on the resource URI
    action: Literal["allow", "ask", "deny"]
    kind: Literal["tool", "prompt", "resource"] = "tool"
    principal: str | None = None  # glob on the caller's principal name
    group: str | None = None  # the caller is in this group
    transport: Literal["http", "ws", "unix"] | None = None
    # OAuth scopes the caller's token must carry (else 403 insufficient_scope)
    scopes: list[str] = []


class BearerToken(Base, frozen=True):
    principal: str
    token_sha256: str  # hex SHA-256 of the token
    groups: list[str] = []


class OAuthSection(Base, frozen=True):
    issuer: str
    jwks_uri: str
    audience: str  # this gateway's resource URI (RFC 8707), e.g. https://gateway.example.com/mcp
    principal_claim: str = "sub"
    groups_claim: str | None = None
    scopes_supported: list[str] = []  # advertised in the protected resource metadata
    jwks_refresh_min_interval: float = 30.0  # an unknown kid refetches the JWKS at most this often
    leeway: float = 30.0  # clock skew allowed on exp / nbf


class PrincipalLimit(Base, frozen=True):
    principal: str  # glob on the principal name
    max_inflight: int | None = None
    calls_per_second: float | None = None
    # held at once by the principal (unset: gateway.limits.DEFAULT_CAPS, 64 / 256 / 64 / 16)
    max_sessions: int | None = None  # legacy HTTP sessions
    max_connections: int | None = None  # client connections (WebSocket, HTTP, unix)
    max_listens: int | None = None  # open subscriptions/listen requests
    max_parked_flows: int | None = None  # bridged calls waiting for the client's retry

    @property
    def caps(self) -> tuple[tuple[str, int], ...]:
        """The caps this entry sets, by name."""
        return tuple((key, value) for key in CAP_KEYS if (value := getattr(self, key)) is not None)


#: The per-principal caps an ``[[auth.limits]]`` entry may set (those of gateway.limits).
CAP_KEYS = tuple(limits.DEFAULT_CAPS)


class AuthSection(Base, frozen=True):
    """Authentication is *configured* when at least one authenticator is given (bearer tokens,
    a tokens file, or OAuth): then every client listener but the unix socket requires it."""

    bearer: list[BearerToken] = []
    tokens_file: str | None = None  # lines: principal:sha256hex[:group,group]
    oauth: OAuthSection | None = None
    limits: list[PrincipalLimit] = []

    @property
    def configured(self) -> bool:
        return bool(self.bearer or self.tokens_file or self.oauth is not None)


class PolicySection(Base, frozen=True):
    default: Literal["allow", "ask", "deny"] = "allow"
    rules: list[PolicyRule] = []
    elicitation_timeout: float = 60.0


#: ``[audit] redact_keys`` by default: argument members whose values are never written.
REDACT_KEYS = ("password", "passwd", "secret", "token", "authorization", "api_key", "apikey",
               "cookie")


class AuditSection(Base, frozen=True):
    """The audit log: one HMAC-chained JSON line per tools/call, prompts/get, resources/read."""

    path: str = ""  # the file ("" = none); rotated to path.1 … path.KEEP
    journald: bool = False  # also to the journal, as structured fields (the systemd extra)
    key_file: str = ""  # the HMAC key (hex, >= 16 bytes; mode 0600, owned by root or the gateway)
    max_bytes: int = 100 * MIB  # rotate before a line would take the file past this (0: never)
    keep: int = 10
    fsync: Literal["always", "interval", "never"] = "interval"
    fsync_interval: float = 1.0 * SECONDS
    queue: int = 10000  # records waiting for the writer
    on_full: Literal["block", "drop"] = "block"
    log_arguments: list[str] = []  # globs on tool names whose arguments are written (redacted)
    redact_keys: list[str] = msgspec.field(default_factory=lambda: list(REDACT_KEYS))

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.journald


class TelemetrySection(Base, frozen=True):
    """OpenTelemetry traces (the ``otel`` extra, imported only when ``enabled``).  A key left
    unset falls back to the standard ``OTEL_*`` environment variable, then the SDK's default."""

    enabled: bool = False
    # where spans go: an http(s) URL (http/protobuf: the full traces URL, …/v1/traces)
    endpoint: str | None = None
    protocol: Literal["http/protobuf", "grpc"] | None = None
    headers_file: str | None = None  # lines "name: value" sent with every export (credentials)
    sample_ratio: float | None = None  # of new traces; a trusted parent's decision is followed
    # whose incoming trace context (a request's _meta, /mcp's traceparent header) becomes the
    # parent: an untrusted one is only linked, so a client cannot force sampling
    trust_parent: Literal["never", "authenticated", "always"] = "never"
    max_queue: int | None = None  # spans waiting for export (None: OTEL_BSP_MAX_QUEUE_SIZE, 2048)


class GatewayConfig(Base, frozen=True):
    gateway: GatewaySection = GatewaySection()
    listen: ListenSection = ListenSection()
    admin: AdminSection = AdminSection()
    policy: PolicySection = PolicySection()
    auth: AuthSection = AuthSection()
    audit: AuditSection = AuditSection()
    telemetry: TelemetrySection = TelemetrySection()
    backends: dict[str, BackendConfig] = {}
    base_dir: str = "."  # not a TOML key: filled in by load()

    def prefix_of(self, name: str) -> str:
        prefix = self.backends[name].prefix
        return name if prefix is None else prefix


_BACKEND_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_-]{0,31}$")  # "_…" is reserved for labels
#: An ``allowed_hosts`` entry: a host name or an address (IPv6 in brackets), optionally :PORT.
_HOST_ENTRY = re.compile(r"[a-zA-Z0-9._-]+(:[0-9]{1,5})?|\[[0-9a-fA-F:.]+\](:[0-9]{1,5})?")
_SECTIONS = {
    "gateway": GatewaySection,
    "listen": ListenSection,
    "admin": AdminSection,
    "policy": PolicySection,
    "auth": AuthSection,
    "audit": AuditSection,
    "telemetry": TelemetrySection,
}


def _humanize(exc: msgspec.ValidationError, path: str) -> str:
    text = str(exc)
    where = ""
    m = re.search(r" - at `\$(.*)`$", text)
    if m:
        text = text[: m.start()]
        where = m.group(1)
        where = where.replace("[...]", ".*")  # msgspec does not name the key of a bad dict value
        where = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", where)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", text)
    if unknown:
        return f"{path}{where}.{unknown.group(1)}: unknown key"
    text = re.sub(r"`([^`]*)`", r"\1", text)
    full = path + where
    return f"{full}: {text[0].lower()}{text[1:]}" if full else text


def parse_host_port(value: str) -> tuple[str, int]:
    """``"127.0.0.1:8765"`` / ``"[::1]:8765"`` → host, port.  Raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, p


#: Host names a loopback listener always answers to (DNS rebinding cannot produce these).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(value: str) -> str:
    """The name part of a ``Host`` header or an ``allowed_hosts`` entry, lowercased, without
    port, brackets or trailing dot: ``"[::1]:9477"`` → ``"::1"``, ``"LocalHost.:80"`` →
    ``"localhost"``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        value = value[1:end] if end > 0 else value
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def host_allowed(value: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` header (None: absent) names this server: a loopback name or
    one of ``allowed`` (names as :func:`host_name` returns them).  The port is not compared:
    DNS rebinding changes the name, not the port."""
    return value is not None and (host := host_name(value)) != "" and (
        host in LOOPBACK_NAMES or host in allowed)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resource_url(cfg: GatewayConfig) -> str | None:
    """The URL clients reach ``/mcp`` at, when the operator named it (``listen.public_url``):
    the OAuth protected resource (RFC 9728 ``resource``, RFC 8707 audience).  None: not set."""
    return cfg.listen.public_url or None


def client_allowed_hosts(cfg: GatewayConfig) -> list[str]:
    """``Host`` names the client listeners answer besides loopback and the bound address:
    ``listen.allowed_hosts`` and the host of ``listen.public_url``."""
    public = guards.public_origin(cfg.listen.public_url)
    return [*cfg.listen.allowed_hosts, *([public[0]] if public else [])]


def client_allowed_origins(cfg: GatewayConfig) -> list[str]:
    """``Origin`` values the client listeners accept: ``listen.allowed_origins`` and the origin
    of ``listen.public_url`` (a browser client served from the gateway's own name)."""
    public = guards.public_origin(cfg.listen.public_url)
    return [*cfg.listen.allowed_origins, *([public[1]] if public else [])]


def client_exposure_problems(cfg: GatewayConfig) -> list[str]:
    """What a client listener (websocket, http) off loopback still lacks under ``cfg``
    (:func:`gateway.guards.client_exposure_problems`); empty: allowed."""
    listen = cfg.listen
    return guards.client_exposure_problems(
        auth_configured=cfg.auth.configured,
        tls=(listen.tls_cert is not None and listen.tls_key is not None) or listen.behind_proxy,
        serves_resources=any("*" not in b.resources.exclude for b in cfg.backends.values()),
        read_rule=any(r.kind == "resource" and r.action == "allow" for r in cfg.policy.rules))


MAX_CONFIG_BYTES = 16 * MIB


def read_regular(path: str, max_bytes: int, *, flags: int = 0,
                 problem: Callable[[os.stat_result], str | None] | None = None) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes``, checked by ``problem``
    (why its fstat refuses it; None: fine) before it is read.  O_NONBLOCK: a FIFO put there opens
    at once and is refused, where a plain open() would wait for a writer forever (a SIGHUP
    reload stuck in it held up SIGTERM); a device such as /dev/zero is refused, not read.

    Raises:
        OSError: unreadable.
        ValueError: why it is refused (not a regular file, ``problem``'s answer, too large).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
    try:
        st = os.fstat(fd)
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode)
               else problem(st) if problem is not None else None)
        if why is not None:
            raise ValueError(why)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return data


def read_file(path: str) -> bytes:
    """The bytes of the config file at ``path`` (:func:`read_regular`, at most
    :data:`MAX_CONFIG_BYTES`).

    Raises:
        OSError: unreadable.
        ConfigError: not a regular file, or too large.
    """
    try:
        return read_regular(path, MAX_CONFIG_BYTES)
    except ValueError as exc:
        raise ConfigError([f"{path}: {exc}"]) from None


def load(data: bytes | str, *, base_dir: str = ".", check_commands: bool = False) -> GatewayConfig:
    """Decode and validate a TOML config.

    Args:
        data: the TOML text.
        base_dir: folder relative backend paths are resolved against.
        check_commands: also require every backend command to resolve to an executable.

    Raises:
        ConfigError: with every problem found, each prefixed by its key path.
    """
    if isinstance(data, str):
        data = data.encode()
    try:
        tree = msgspec.toml.decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError([f"not valid TOML: {exc}"]) from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise ConfigError(["not valid TOML: arrays or tables nested too deeply"]) from None
    errors: list[str] = []
    sections: dict[str, Any] = {}
    for key in tree:
        if key not in _SECTIONS and key != "backends":
            errors.append(f"{key}: unknown section (expected one of gateway, listen, admin, "
                          "policy, auth, audit, telemetry, backends)")
    for key, typ in _SECTIONS.items():
        try:
            sections[key] = msgspec.convert(tree.get(key, {}), typ)
        except msgspec.ValidationError as exc:
            errors.append(_humanize(exc, key))
    backends: dict[str, BackendConfig] = {}
    raw_backends = tree.get("backends", {})
    if not isinstance(raw_backends, dict):
        errors.append("backends: expected a table of [backends.NAME] tables")
        raw_backends = {}
    for name, raw in raw_backends.items():
        if not _BACKEND_NAME.fullmatch(name):
            errors.append(f"backends.{name}: backend names must match "
                          "[a-zA-Z0-9][a-zA-Z0-9_-]{0,31}")
            continue
        try:
            backend = msgspec.convert(raw, BackendConfig)
        except msgspec.ValidationError as exc:
            errors.append(_humanize(exc, f"backends.{name}"))
            continue
        backends[name] = _resolve_paths(backend, base_dir)
    if errors:
        raise ConfigError(errors)
    # TOML has no null: an empty string switches a listener off.
    listen, admin = sections["listen"], sections["admin"]
    sections["listen"] = msgspec.structs.replace(
        listen, websocket=listen.websocket or None, unix=listen.unix or None,
        http=listen.http or None,
    )
    sections["admin"] = msgspec.structs.replace(admin, listen=admin.listen or None)
    cfg = GatewayConfig(**sections, backends=backends, base_dir=os.path.abspath(base_dir))
    errors.extend(semantic_errors(cfg, check_commands=check_commands))
    if errors:
        raise ConfigError(errors)
    return cfg


def _resolve_paths(backend: BackendConfig, base_dir: str) -> BackendConfig:
    cwd = os.path.normpath(os.path.join(base_dir, backend.cwd or "."))
    command = backend.command
    if "/" in command and not os.path.isabs(command):
        command = os.path.normpath(os.path.join(base_dir, command))
    ca_file = backend.ca_file
    if ca_file:
        ca_file = os.path.normpath(os.path.join(base_dir, ca_file))
    headers = {name: _file_ref(value, base_dir) for name, value in backend.headers.items()}
    env_files, token_files = (os.path.normpath(os.path.join(base_dir, t)) if t else t
                              for t in (backend.env_files, backend.token_files))
    return msgspec.structs.replace(backend, cwd=cwd, command=command, ca_file=ca_file,
                                   headers=headers, oauth=_resolve_oauth(backend.oauth, base_dir),
                                   env_files=env_files, token_files=token_files,
                                   token_exchange=_resolve_oauth(backend.token_exchange,
                                                                 base_dir))


_Auth = TypeVar("_Auth", RemoteOAuth, TokenExchange)


def _resolve_oauth(oauth: _Auth | None, base_dir: str) -> _Auth | None:
    if oauth is None:
        return None
    ca_file = os.path.normpath(os.path.join(base_dir, oauth.ca_file)) if oauth.ca_file else None
    return msgspec.structs.replace(oauth, client_secret=_file_ref(oauth.client_secret, base_dir),
                                   private_key=_file_ref(oauth.private_key, base_dir),
                                   ca_file=ca_file)


_Ref = TypeVar("_Ref", HeaderValue, HeaderValue | None)


def _file_ref(value: _Ref, base_dir: str) -> _Ref:
    """``value`` (a literal, ``{ env = … }`` or ``{ file = … }``) with a ``file`` under
    ``base_dir``."""
    if isinstance(value, dict) and value.get("file"):
        return {**value, "file": os.path.normpath(os.path.join(base_dir, value["file"]))}
    return value


#: A header name (an HTTP token) a remote backend may be sent.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
#: Headers the gateway sets itself on every request to a remote.
RESERVED_HEADERS = frozenset({"host", "content-length", "content-type", "accept", "connection",
                              "transfer-encoding", "mcp-session-id", "mcp-protocol-version",
                              "last-event-id", "te", "upgrade", "keep-alive"})
#: Headers a 2026-07-28 request carries, set from its body (``mcp-method``, ``mcp-name``,
#: ``mcp-param-*``).
MODERN_HEADER_PREFIXES = ("mcp-method", "mcp-name", "mcp-param-")


def header_value_ok(value: str) -> bool:
    """Whether ``value`` may be sent as an HTTP header value: printable ASCII and tabs."""
    return all(" " <= c <= "~" or c == "\t" for c in value)


def remote_errors(p: str, b: BackendConfig) -> list[str]:
    """A remote backend's ``url``, ``ca_file``, ``headers`` and ``max_connections`` (key-path
    errors); none of them for a ``command`` one."""
    errors: list[str] = []
    if bool(b.command) == bool(b.url):
        errors.append(f"{p}: set exactly one of command (a program to spawn) and url (a remote "
                      "Streamable HTTP server)")
    if not b.url:
        for key in ("ca_file", "headers", "oauth", "token_exchange"):
            if getattr(b, key):
                errors.append(f"{p}.{key}: only for a remote backend (url)")
        if b.max_connections is not None:
            errors.append(f"{p}.max_connections: only for a remote backend (url)")
        return errors
    low, high = limits.REMOTE_CONNECTIONS_MIN, limits.REMOTE_CONNECTIONS_MAX
    if b.max_connections is not None and not low <= b.max_connections <= high:
        errors.append(f"{p}.max_connections: must be between {low} (one call's answer stream "
                      f"beside the GET stream, the DELETE and 2 for notifications) and {high}")
    for key in ("args", "env"):
        if getattr(b, key):
            errors.append(f"{p}.{key}: only for a backend with a command (this one has a url)")
    scheme, sep, rest = b.url.partition("://")
    authority = rest.split("/", 1)[0]
    if scheme not in ("http", "https") or not sep or not authority or "@" in authority:
        errors.append(f"{p}.url: expected http://HOST:PORT/PATH or https://HOST/PATH without "
                      f"credentials, got {b.url!r}")
    elif any(c.isspace() or ord(c) < 0x21 or ord(c) > 0x7e for c in b.url):
        errors.append(f"{p}.url: must be printable ASCII without spaces")
    else:
        try:
            parts = urlsplit(b.url)
            parts.port  # noqa: B018 - parsing it is the check
        except ValueError as exc:
            errors.append(f"{p}.url: {exc}")
        else:
            if not parts.hostname:  # as gateway.backend.httpclient.parse_url requires
                errors.append(f"{p}.url: no host name or address in {b.url!r}")
    if b.ca_file is not None and scheme != "https":
        errors.append(f"{p}.ca_file: only for an https:// url")
    for name, value in b.headers.items():
        k = f"{p}.headers.{name}"
        if not _HEADER_NAME.fullmatch(name):
            errors.append(f"{k}: not a valid header name")
        elif name.lower() in RESERVED_HEADERS or name.lower().startswith(MODERN_HEADER_PREFIXES):
            errors.append(f"{k}: set by the gateway itself")
        if isinstance(value, str):
            if not header_value_ok(value):
                errors.append(f"{k}: must be printable ASCII (no CR, LF or NUL)")
        elif set(value) == {"env"} or (set(value) <= {"file", "prefix"} and "file" in value):
            if not value.get("env", value.get("file")):
                errors.append(f"{k}: {'env' if 'env' in value else 'file'} must not be empty")
            if not header_value_ok(value.get("prefix", "")):
                errors.append(f"{k}.prefix: must be printable ASCII (no CR, LF or NUL)")
        else:
            errors.append(f'{k}: expected a string, {{ env = "VAR" }} or '
                          f'{{ file = "/path", prefix = "Bearer " }}, got keys {sorted(value)}')
    if b.oauth is not None:
        errors.extend(oauth_errors(f"{p}.oauth", b))
    if b.token_exchange is not None:
        errors.extend(token_exchange_errors(f"{p}.token_exchange", b))
    return errors


def _template_error(key: str, template: str) -> str | None:
    """Why a per-principal file template is refused (None: fine; a relative one was resolved
    against the config's folder)."""
    if template.count("{principal}") != 1 or "/" in template.partition("{principal}")[2]:
        return f"{key}: the file name (not a folder) must contain {{principal}} once"
    return None


def per_principal_errors(p: str, b: BackendConfig) -> list[str]:
    """``sharing = "per-principal"``, ``env_files``, ``credentials`` and ``token_files``
    (key-path errors)."""
    errors: list[str] = []
    if b.env_files is not None:
        if b.url:
            errors.append(f"{p}.env_files: only for a backend with a command (this one has a url)")
        elif b.sharing != "per-principal":
            errors.append(f'{p}.env_files: only with sharing = "per-principal"')
        if (why := _template_error(f"{p}.env_files", b.env_files)) is not None:
            errors.append(why)
    if b.credentials == "per-principal" or b.token_files is not None:
        if not b.url:
            key = "credentials" if b.credentials == "per-principal" else "token_files"
            errors.append(f"{p}.{key}: only for a remote backend (url)")
        elif b.sharing not in ("shared", "per-principal"):
            errors.append(f'{p}.sharing: credentials = "per-principal" runs an upstream session '
                          f'per principal; use sharing = "per-principal" (or leave it out)')
        code = b.oauth is not None and b.oauth.grant == "authorization_code"
        sources = (b.token_files is not None) + (b.token_exchange is not None) + code
        if b.credentials != "per-principal":
            errors.append(f'{p}.token_files: only with credentials = "per-principal"')
        elif sources == 0 and b.oauth is None:
            errors.append(f'{p}.credentials: "per-principal" needs a source: set token_files, '
                          '[token_exchange] or [oauth] grant = "authorization_code"')
        elif sources > 1:
            errors.append(f'{p}.credentials: one source: token_files, [token_exchange] or '
                          '[oauth] grant = "authorization_code"')
        if b.oauth is not None and not code and b.credentials == "per-principal":
            errors.append(f"{p}.oauth: the backend's own token is not used with "
                          'credentials = "per-principal" (each principal authorizes with '
                          'grant = "authorization_code"); remove one')
    if b.token_files is not None and (why := _template_error(f"{p}.token_files",
                                                              b.token_files)) is not None:
        errors.append(why)
    return errors


def endpoint_url_ok(url: str) -> bool:
    """Whether the gateway may send credentials to ``url``: https, or http to a loopback
    address (a token or metadata endpoint on this machine)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        return False
    if not parts.hostname or parts.username is not None or parts.fragment:
        return False
    if any(c.isspace() or ord(c) < 0x21 or ord(c) > 0x7e for c in url):
        return False
    return parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.hostname))


def redirect_uri(cfg: GatewayConfig) -> str:
    """Where an authorization server sends the operator back: ``listen.redirect_path`` under
    the origin of ``listen.public_url``, else under the HTTP listener's address (https when it
    serves TLS; a wildcard address as loopback, for a browser on this machine)."""
    listen = cfg.listen
    public = listen.public_url
    if public:
        parts = urlsplit(public)
        return f"{parts.scheme}://{parts.netloc}{listen.redirect_path}"
    host, port = parse_host_port(listen.http or "127.0.0.1:8766")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    scheme = "https" if listen.tls_cert is not None and listen.tls_key is not None else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{listen.redirect_path}"


def _client_id_errors(p: str, o: ClientAuth, required: bool = True) -> list[str]:
    if not o.client_id:
        return [f"{p}.client_id: required"] if required else []
    if not header_value_ok(o.client_id):
        return [f"{p}.client_id: must be printable ASCII"]
    return []


def _client_secret_errors(p: str, o: ClientAuth, required: bool = True) -> list[str]:
    """A token endpoint client's secrets: by reference only, the one its method uses
    (``required``: it must be there)."""
    errors: list[str] = []
    secret_key = "private_key" if o.auth_method == "private_key_jwt" else "client_secret"
    other = "client_secret" if secret_key == "private_key" else "private_key"
    for key in ("client_secret", "private_key"):
        value = getattr(o, key)
        if value is None:
            if key == secret_key and required:
                errors.append(f"{p}.{key}: required for auth_method = {o.auth_method!r}")
            continue
        if key == other:
            errors.append(f"{p}.{key}: not used with auth_method = {o.auth_method!r}")
        elif isinstance(value, str):
            errors.append(f'{p}.{key}: never a literal in the config: use {{ file = "/path" }} '
                          f'or {{ env = "VAR" }}')
        elif len(value) != 1 or not (value.get("file") or value.get("env")):
            errors.append(f'{p}.{key}: expected {{ file = "/path" }} or {{ env = "VAR" }}, '
                          f"got keys {sorted(value)}")
    return errors


def _resource_ok(resource: str) -> bool:
    return (urlsplit(resource).scheme in ("http", "https") and "#" not in resource
            and header_value_ok(resource))


def oauth_errors(p: str, b: BackendConfig) -> list[str]:
    """A remote's ``[oauth]`` (key-path errors): the secrets by reference only."""
    o = b.oauth
    assert o is not None
    code = o.grant == "authorization_code"
    errors = _client_id_errors(p, o, required=not code)
    if code and o.auth_method == "private_key_jwt":
        errors.append(f"{p}.auth_method: private_key_jwt is for grant = 'client_credentials'")
    if code and o.client_metadata_url and not o.client_metadata_url.startswith("https://"):
        errors.append(f"{p}.client_metadata_url: expected an https:// URL")
    if o.token_url and not endpoint_url_ok(o.token_url):
        errors.append(f"{p}.token_url: expected an https:// URL (or http:// to 127.0.0.1), "
                      f"got {o.token_url!r}")
    elif not o.token_url and b.url and not endpoint_url_ok(b.url):
        errors.append(f"{p}.token_url: required for a plain http:// url (the remote's metadata "
                      "would say where the credentials go: only trusted over https)")
    if o.resource and not _resource_ok(o.resource):
        errors.append(f"{p}.resource: expected an absolute http(s) URI without a fragment")
    errors.extend(_client_secret_errors(p, o, required=not code))
    if o.auth_method != "private_key_jwt" and (o.key_id or o.audience):
        errors.append(f"{p}: key_id and audience are for auth_method = 'private_key_jwt'")
    if not header_value_ok(o.scope) or not header_value_ok(o.key_id):
        errors.append(f"{p}: scope and key_id must be printable ASCII")
    if any(name.lower() == "authorization" for name in b.headers):
        errors.append(f"{p}: the Authorization header comes from the token: remove it from "
                      "headers")
    return errors


def token_exchange_errors(p: str, b: BackendConfig) -> list[str]:
    """A remote's ``[token_exchange]`` (key-path errors)."""
    o = b.token_exchange
    assert o is not None
    errors = _client_id_errors(p, o)
    if not o.token_url:
        errors.append(f"{p}.token_url: required (the authorization server's token endpoint)")
    elif not endpoint_url_ok(o.token_url):
        errors.append(f"{p}.token_url: expected an https:// URL (or http:// to 127.0.0.1), "
                      f"got {o.token_url!r}")
    if not o.audience and not o.resource:
        errors.append(f"{p}: set audience or resource (what the exchanged token is for)")
    if o.resource and not _resource_ok(o.resource):
        errors.append(f"{p}.resource: expected an absolute http(s) URI without a fragment")
    errors.extend(_client_secret_errors(p, o))
    if not all(header_value_ok(v) for v in (o.audience, o.scope, o.key_id)):
        errors.append(f"{p}: audience, scope and key_id must be printable ASCII")
    if o.auth_method != "private_key_jwt" and (o.key_id or o.assertion_audience):
        errors.append(f"{p}: key_id and assertion_audience are for auth_method = "
                      "'private_key_jwt'")
    if b.oauth is not None:
        errors.append(f"{p}: a remote's token is either the gateway's own (oauth) or each "
                      "principal's (token_exchange), not both")
    if b.credentials != "per-principal":
        errors.append(f'{p}: only with credentials = "per-principal" (each principal\'s token '
                      "on an upstream session of its own)")
    return errors


def resolve_command(backend: BackendConfig) -> str | None:
    """The executable a backend's command resolves to (PATH lookup for bare names)."""
    if "/" in backend.command:
        ok = os.path.isfile(backend.command) and os.access(backend.command, os.X_OK)
        return backend.command if ok else None
    path = backend.env.get("PATH", os.environ.get("PATH", os.defpath))
    return shutil.which(backend.command, path=path)


def _audit_errors(a: AuditSection) -> list[str]:
    errors = []
    if a.enabled and not a.key_file:
        errors.append("audit.key_file: required when audit.path or audit.journald is set")
    if a.key_file and not a.enabled:
        errors.append("audit.key_file: set, but neither audit.path nor audit.journald is")
    if a.max_bytes and a.max_bytes < 4096:
        errors.append("audit.max_bytes: must be 0 (never rotate) or at least 4096")
    for key in ("keep", "queue"):
        if getattr(a, key) < 1:
            errors.append(f"audit.{key}: must be at least 1")
    if not 0 < a.fsync_interval <= 3600:
        errors.append("audit.fsync_interval: must be positive and at most 3600 seconds")
    return errors


def semantic_errors(cfg: GatewayConfig, *, check_commands: bool) -> list[str]:
    errors: list[str] = []
    g = cfg.gateway
    if not re.fullmatch(r"[a-zA-Z0-9_.-]{1,8}", g.separator):
        errors.append("gateway.separator: must be 1-8 characters from [a-zA-Z0-9_.-]")
    if g.max_message_bytes < 1024:
        errors.append("gateway.max_message_bytes: must be at least 1024")
    if not 2 <= g.max_json_depth <= 512:
        errors.append("gateway.max_json_depth: must be between 2 and 512")
    if g.outbound_bytes < g.max_message_bytes:
        errors.append("gateway.outbound_bytes: must be at least gateway.max_message_bytes")
    if g.buffered_bytes_total < g.outbound_bytes:
        errors.append("gateway.buffered_bytes_total: must be at least gateway.outbound_bytes")
    if g.write_stall_timeout <= 0:
        errors.append("gateway.write_stall_timeout: must be positive")
    if g.replica_id and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", g.replica_id):
        errors.append("gateway.replica_id: must be 1-64 characters from [A-Za-z0-9_-]")
    if g.state_ttl <= 0:
        errors.append("gateway.state_ttl: must be positive")
    if not 0 < g.shared_park_limit <= 3600:
        errors.append("gateway.shared_park_limit: must be positive and at most 3600 seconds")
    for key in ("drain_delay", "drain_grace"):
        if not 0 <= getattr(g, key) <= 3600:
            errors.append(f"gateway.{key}: must be between 0 and 3600 seconds")
    for key in ("page_size", "max_inflight_per_connection", "outbound_queue", "max_connections",
                "max_parked_flows"):
        if getattr(g, key) is not None and getattr(g, key) < 1:
            errors.append(f"gateway.{key}: must be at least 1")
    errors.extend(_audit_errors(cfg.audit))
    path = cfg.listen.redirect_path
    if not path.startswith("/") or path in ("/mcp", "/healthz", "/readyz") \
            or not all("!" <= c <= "~" and c not in "?#" for c in path):
        errors.append("listen.redirect_path: expected a path of its own (\"/oauth/callback\"), "
                      "printable, without ? or #")
    coded = [name for name, b in cfg.backends.items()
             if b.oauth is not None and b.oauth.grant == "authorization_code"]
    if coded and not cfg.listen.http:
        errors.append(f"listen.http: off, but backend {coded[0]} has oauth.grant = "
                      "'authorization_code': the authorization server's redirect comes back "
                      "to listen.redirect_path on it")
    for key, value in (("listen.websocket", cfg.listen.websocket), ("listen.http", cfg.listen.http),
                       ("admin.listen", cfg.admin.listen)):
        if value is None:
            continue
        try:
            host, _port = parse_host_port(value)
        except ValueError as exc:
            errors.append(f"{key}: {exc}")
            continue
        if key in ("listen.websocket", "listen.http") and not is_loopback(host):
            problems = client_exposure_problems(cfg)
            if problems:
                errors.append(f"{key}: {host!r} is not a loopback address, and a client listener "
                              "off loopback needs " + "; ".join(problems))
        if key == "admin.listen" and not is_loopback(host) and not cfg.admin.allow_non_loopback:
            errors.append(
                f"{key}: {host!r} is not a loopback address; /status exposes backend stderr, "
                "set admin.allow_non_loopback = true to bind it anyway (and admin.token_sha256 "
                "for /status)"
            )
    errors.extend(guards.key_errors(
        tls_cert=cfg.listen.tls_cert, tls_key=cfg.listen.tls_key,
        behind_proxy=cfg.listen.behind_proxy, public_url=cfg.listen.public_url,
        admin_token_sha256=cfg.admin.token_sha256, check_files=check_commands))
    if not 0 <= cfg.admin.tool_latency_series <= 10_000:
        errors.append("admin.tool_latency_series: need 0 ... 10000 (histogram series per backend)")
    for key, hosts in (("listen.allowed_hosts", cfg.listen.allowed_hosts),
                       ("admin.allowed_hosts", cfg.admin.allowed_hosts)):
        for entry in hosts:
            if not _HOST_ENTRY.fullmatch(entry):
                errors.append(f"{key}: {entry!r} is not a host name or address "
                              "(optionally with :PORT)")
    try:
        mode = int(cfg.listen.unix_mode, 8)
        if not 0 <= mode <= 0o777:
            raise ValueError
    except ValueError:
        errors.append(f"listen.unix_mode: expected an octal mode like \"0660\", "
                      f"got {cfg.listen.unix_mode!r}")
    if cfg.listen.websocket is None and cfg.listen.unix is None and cfg.listen.http is None:
        errors.append("listen: configure at least one of websocket, unix and http")
    if cfg.listen.http_session_idle_timeout <= 0:
        errors.append("listen.http_session_idle_timeout: must be positive")
    if cfg.listen.http_max_sessions < 1:
        errors.append("listen.http_max_sessions: must be at least 1")
    errors.extend(_authz_errors(cfg))
    errors.extend(_auth_errors(cfg.auth))
    errors.extend(_telemetry_errors(cfg.telemetry))
    for name, b in cfg.backends.items():
        p = f"backends.{name}"
        errors.extend(remote_errors(p, b))
        errors.extend(per_principal_errors(p, b))
        for key in ("request_timeout", "max_call_duration", "start_timeout", "cancel_grace"):
            if getattr(b, key) <= 0:
                errors.append(f"{p}.{key}: must be positive")
        r = b.restart
        if r.backoff_initial <= 0 or r.backoff_max < r.backoff_initial:
            errors.append(f"{p}.restart: need 0 < backoff_initial <= backoff_max")
        if r.max_restarts < 0 or r.window <= 0:
            errors.append(f"{p}.restart: need max_restarts >= 0 and window > 0")
        if b.health.interval < 0 or b.health.timeout <= 0 or b.health.failures < 1:
            errors.append(f"{p}.health: need interval >= 0, timeout > 0, failures >= 1")
        if b.stderr_lines_per_second < 0 or b.stderr_burst < 1:
            errors.append(f"{p}: need stderr_lines_per_second >= 0 and stderr_burst >= 1")
        if b.instances < 1 or b.max_sessions < 1 or b.max_inflight < 1:
            errors.append(f"{p}: instances, max_sessions and max_inflight must be at least 1")
        if b.prefix is not None and b.prefix and not re.fullmatch(r"[a-zA-Z0-9_-]{1,32}", b.prefix):
            errors.append(f"{p}.prefix: must match [a-zA-Z0-9_-]{{0,32}}")
        for root in b.roots:
            if not root.startswith("file://"):
                errors.append(f"{p}.roots: {root!r} is not a file:// URI")
        if check_commands and b.url:
            if b.ca_file is not None and not os.path.isfile(b.ca_file):
                errors.append(f"{p}.ca_file: {b.ca_file!r} is not a file")
        elif check_commands:
            if resolve_command(b) is None:
                errors.append(f"{p}.command: {b.command!r} not found or not executable")
            if b.cwd is not None and not os.path.isdir(b.cwd):
                errors.append(f"{p}.cwd: {b.cwd!r} is not a directory")
    return errors


def _telemetry_errors(t: TelemetrySection) -> list[str]:
    errors = []
    if t.sample_ratio is not None and not 0 <= t.sample_ratio <= 1:
        errors.append("telemetry.sample_ratio: must be between 0 and 1")
    if t.endpoint is not None:
        parts = urlsplit(t.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            errors.append(f"telemetry.endpoint: {t.endpoint!r} is not an http:// or https:// URL")
    if t.max_queue is not None and not 1 <= t.max_queue <= 1_000_000:
        errors.append("telemetry.max_queue: need 1 ... 1000000 spans")
    return errors


def _authz_errors(cfg: GatewayConfig) -> list[str]:
    """``[[auth.limits]]`` and the caller conditions of ``[policy] rules``."""
    errors: list[str] = []
    for i, lim in enumerate(cfg.auth.limits):
        p = f"auth.limits[{i}]"
        if not lim.principal:
            errors.append(f"{p}.principal: must not be empty")
        if lim.max_inflight is None and lim.calls_per_second is None and not lim.caps:
            errors.append(f"{p}: set max_inflight, calls_per_second or a max_* cap")
        for key in ("max_inflight", *CAP_KEYS):
            value = getattr(lim, key)
            if value is not None and value < 1:
                errors.append(f"{p}.{key}: must be at least 1")
        if lim.calls_per_second is not None and not lim.calls_per_second > 0:
            errors.append(f"{p}.calls_per_second: must be positive")
    for i, rule in enumerate(cfg.policy.rules):
        p = f"policy.rules[{i}]"
        for key in ("match", "principal", "group"):
            if getattr(rule, key) == "":
                errors.append(f"{p}.{key}: must not be empty")
        if any(not scope or " " in scope for scope in rule.scopes):
            errors.append(f"{p}.scopes: scopes are non-empty and contain no spaces")
    for name, b in cfg.backends.items():
        for kind in ("tools", "prompts", "resources"):
            f = getattr(b, kind)
            if "" in f.include or "" in f.exclude:
                errors.append(f"backends.{name}.{kind}: an empty glob matches nothing; remove it")
    return errors


def _auth_errors(auth: AuthSection) -> list[str]:
    from gateway.auth.tokens import valid_hash, valid_name  # pure

    errors: list[str] = []
    for n, b in enumerate(auth.bearer):
        if not valid_name(b.principal):
            errors.append(f"auth.bearer[{n}].principal: must match [A-Za-z0-9_.@+-]{{1,128}}")
        if not valid_hash(b.token_sha256.lower()):
            errors.append(f"auth.bearer[{n}].token_sha256: must be the hex SHA-256 of the token "
                          "(64 hex digits; e.g. printf %s TOKEN | sha256sum), not the token")
        if not all(valid_name(g) for g in b.groups):
            errors.append(f"auth.bearer[{n}].groups: names must match [A-Za-z0-9_.@+-]{{1,128}}")
    if auth.tokens_file is not None and not auth.tokens_file:
        errors.append("auth.tokens_file: must not be empty (leave it out instead)")
    o = auth.oauth
    if o is not None:
        for key in ("issuer", "jwks_uri", "audience", "principal_claim"):
            if not getattr(o, key):
                errors.append(f"auth.oauth.{key}: must not be empty")
        scheme, _, rest = o.jwks_uri.partition("://")
        host = rest.split("/", 1)[0].rpartition("@")[2]
        host = host.rpartition(":")[0] if ":" in host and not host.endswith("]") else host
        if scheme != "https" and not (scheme == "http" and is_loopback(host.strip("[]"))):
            errors.append("auth.oauth.jwks_uri: must be an https:// URL (http:// only on loopback)")
        if o.jwks_refresh_min_interval <= 0:
            errors.append("auth.oauth.jwks_refresh_min_interval: must be positive")
        if o.leeway < 0:
            errors.append("auth.oauth.leeway: must not be negative")
    return errors


def fd_reserve(cfg: GatewayConfig) -> int:
    """fds the daemon needs besides its client connections with this config
    (:func:`gateway.limits.fd_reserve`: every backend child it may run, every remote instance's
    connections, its listeners)."""
    children = sum(limits.max_children(b.owned_sharing, b.instances, b.max_sessions)
                   for b in cfg.backends.values() if not b.url)
    remote_connections = sum(limits.max_children(b.owned_sharing, b.instances, b.max_sessions)
                             * remote_connections_of(b) for b in cfg.backends.values() if b.url)
    tcp = sum(1 for address in (cfg.listen.websocket, cfg.listen.http, cfg.admin.listen)
              if address is not None)
    return limits.fd_reserve(children=children, tcp_listeners=tcp,
                             unix_listeners=int(cfg.listen.unix is not None),
                             remote_connections=remote_connections)


def remote_connections_of(b: BackendConfig) -> int:
    """Connections one instance of remote backend ``b`` holds at most (its
    ``max_connections``, else :data:`gateway.limits.REMOTE_CONNECTIONS`)."""
    return limits.REMOTE_CONNECTIONS if b.max_connections is None else b.max_connections


def diff_backends(
    old: GatewayConfig, new: GatewayConfig
) -> tuple[list[str], list[str], list[str]]:
    """Pure reload diff: backend names to add, to remove, and to restart (changed config)."""
    added = [n for n in new.backends if n not in old.backends]
    removed = [n for n in old.backends if n not in new.backends]
    changed = [n for n in new.backends if n in old.backends and new.backends[n] != old.backends[n]]
    return added, removed, changed


def restart_only_changes(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Sections a reload cannot apply (listeners): they need a restart."""
    out = []
    if old.listen != new.listen:
        out.append("listen")
    if old.admin != new.admin:
        out.append("admin")
    if old.audit != new.audit:
        out.append("audit")
    if old.telemetry != new.telemetry:
        out.append("telemetry")
    for key in ("max_message_bytes", "max_json_depth", "log_target", "state_key_file",
                "replica_id"):
        if getattr(old.gateway, key) != getattr(new.gateway, key):
            out.append(f"gateway.{key}")
    return out
