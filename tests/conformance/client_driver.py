"""The client the official conformance suite's `client` command runs: the gateway itself.

`conformance client --command "python tests/conformance/client_driver.py"` starts a test MCP
server per scenario and runs this with its URL as the last argument, the scenario in
MCP_CONFORMANCE_SCENARIO, the revision in MCP_CONFORMANCE_PROTOCOL_VERSION (2026-07-28 gives
`protocol_mode = "modern_only"`, any other `legacy_only`) and, for some, a JSON object in
MCP_CONFORMANCE_CONTEXT. It starts `mcp-gateway run` with that URL as its one remote backend
(required, unprefixed), waits for `/readyz`, then does over the gateway's WebSocket (a legacy
session with the elicitation capability, answering the elicitations the gateway relays with
the schema's defaults) what the scenario expects a client to do, and stops the gateway with
SIGTERM. The gateway's log goes to stderr (the suite keeps it as the scenario's stderr.txt).
An `auth/*` authorization code scenario: the backend (not required) waits in AUTHORIZING; the
driver runs `mcp-gateway authorize`, GETs the URL without following the redirect and delivers
its Location to the gateway's redirect endpoint, whenever the backend asks (at most 3 times).
Exit status: 0 when every step got an answer and the remote's first session held (for a
scenario where the gateway must refuse: when it refused), else 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from http import client as http_client
from typing import Any
from urllib.parse import urlsplit

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from helpers import Client, connect, free_port, http_request, poll, wait_instance  # noqa: E402

READY_TIMEOUT = 20.0  # the gateway's start (it fails by itself after the backend's start_timeout)
CALL_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0
MODERN = "2026-07-28"


def log(text: str) -> None:
    print(f"[driver] {text}", file=sys.stderr, flush=True)


def authorization_code(scenario: str) -> bool:
    """The scenario wants the authorization code flow: the driver plays the operator."""
    return scenario.startswith("auth/") and not scenario.startswith("auth/client-credentials")


def gateway_toml(url: str, revision: str, ws: int, admin: int, context: dict[str, Any],
                 folder: str, scenario: str = "", http: int = 0) -> str:
    """The gateway's config; for the authorization code flow also its HTTP listener (the
    redirect comes back there), its state directory, and the backend not required (it waits
    in AUTHORIZING until the driver authorizes)."""
    mode = "modern_only" if revision == MODERN else "legacy_only"
    code = authorization_code(scenario)
    lines = ["[gateway]", "drain_delay = 0.0",
             *([f"state_dir = {json.dumps(folder)}"] if code else []),
             "[listen]", f'websocket = "127.0.0.1:{ws}"',
             f'http = "127.0.0.1:{http}"' if code else 'http = ""', "[admin]",
             f'listen = "127.0.0.1:{admin}"', "[backends.remote]",
             f"url = {json.dumps(url)}", 'prefix = ""', f"required = {str(not code).lower()}",
             "start_timeout = 8.0", f'protocol_mode = "{mode}"']
    return "\n".join(lines + oauth_table(context, folder, code)) + "\n"


#: The Client ID Metadata Document URL the auth/basic-cimd scenario expects as client_id.
CIMD_URL = "https://conformance-test.local/client-metadata.json"


def oauth_table(context: dict[str, Any], folder: str, code: bool = False) -> list[str]:
    """The backend's ``[oauth]``: for the authorization code flow the grant, the metadata
    document URL and any pre-registered client; else the client credentials from an
    auth/client-credentials-* scenario's context (the secret or key written to files in
    ``folder``); none for other scenarios."""
    if code:
        lines = ["[backends.remote.oauth]", 'grant = "authorization_code"',
                 f"client_metadata_url = {json.dumps(CIMD_URL)}"]
        if "client_id" in context:
            lines.append(f"client_id = {json.dumps(context['client_id'])}")
    elif "client_id" not in context:
        return []
    else:
        lines = ["[backends.remote.oauth]", f"client_id = {json.dumps(context['client_id'])}"]
    if "client_secret" in context:
        path = os.path.join(folder, "secret")
        with open(path, "w", encoding="utf-8") as f:
            f.write(context["client_secret"])
        lines.append(f"client_secret = {{ file = {json.dumps(path)} }}")
    if "private_key_pem" in context:
        path = os.path.join(folder, "key.pem")
        with open(path, "w", encoding="utf-8") as f:
            f.write(context["private_key_pem"])
        lines += ['auth_method = "private_key_jwt"',
                  f"private_key = {{ file = {json.dumps(path)} }}",
                  f"algorithm = {json.dumps(context.get('signing_algorithm', 'ES256'))}"]
    return lines


# ---- what each scenario expects a client to do (the scenario sources in the suite's dist)

async def list_tools(client: Client) -> list[dict[str, Any]]:
    resp = await client.request("tools/list", {}, timeout=CALL_TIMEOUT)
    if "result" not in resp:
        raise RuntimeError(f"tools/list failed: {resp}")
    tools: list[dict[str, Any]] = resp["result"]["tools"]
    log("tools: " + ", ".join(t["name"] for t in tools))
    return tools


async def call(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    resp = await client.call(name, arguments, timeout=CALL_TIMEOUT)
    log(f"tools/call {name}: {json.dumps(resp)[:400]}")
    if "result" not in resp:
        raise RuntimeError(f"tools/call {name} failed: {resp.get('error')}")
    return resp


async def just_list(client: Client, context: dict[str, Any]) -> None:
    await list_tools(client)


async def tools_call(client: Client, context: dict[str, Any]) -> None:
    await list_tools(client)
    await call(client, "add_numbers", {"a": 5, "b": 3})


async def call_every_tool(client: Client, context: dict[str, Any]) -> None:
    """Each listed tool, with no arguments (elicitation defaults, sse-retry, the client
    credentials' test-tool)."""
    for tool in await list_tools(client):
        await call(client, tool["name"], {})


async def request_state(client: Client, context: dict[str, Any]) -> None:
    await list_tools(client)
    for name in ("test_mrtr_echo_state", "test_mrtr_unrelated", "test_mrtr_no_state",
                 "test_mrtr_no_result_type"):
        await call(client, name, {})


async def standard_headers(client: Client, context: dict[str, Any]) -> None:
    for tool in await list_tools(client):
        await call(client, tool["name"], {})
    resources = await client.request("resources/list", {}, timeout=CALL_TIMEOUT)
    for res in resources.get("result", {}).get("resources", []):
        await client.request("resources/read", {"uri": res["uri"]}, timeout=CALL_TIMEOUT)
    prompts = await client.request("prompts/list", {}, timeout=CALL_TIMEOUT)
    for prompt in prompts.get("result", {}).get("prompts", []):
        await client.request("prompts/get", {"name": prompt["name"]}, timeout=CALL_TIMEOUT)


async def custom_headers(client: Client, context: dict[str, Any]) -> None:
    await list_tools(client)
    for item in context.get("toolCalls", []):
        await call(client, item["name"], item.get("arguments", {}))


async def invalid_tool_headers(client: Client, context: dict[str, Any]) -> None:
    """Every tool the gateway lists, with a string for each required property: the gateway
    must have left out the tools whose x-mcp-header is invalid."""
    for tool in await list_tools(client):
        schema = tool.get("inputSchema", {})
        args = {p: "x" for p in schema.get("required", [])}
        await call(client, tool["name"], args)


async def schema_preservation(client: Client, context: dict[str, Any]) -> None:
    tools = {t["name"]: t for t in await list_tools(client)}
    await call(client, "json_schema_echo",
               {"schema": tools["json_schema_2020_12_tool"]["inputSchema"]})


SCENARIOS: dict[str, Callable[[Client, dict[str, Any]], Awaitable[None]]] = {
    "initialize": just_list,
    "tools_call": tools_call,
    "elicitation-sep1034-client-defaults": call_every_tool,
    "sse-retry": call_every_tool,
    "request-metadata": just_list,
    "sep-2322-client-request-state": request_state,
    "http-standard-headers": standard_headers,
    "http-custom-headers": custom_headers,
    "http-invalid-tool-headers": invalid_tool_headers,
    "json-schema-ref-no-deref": just_list,
    "json-schema-2020-12-preservation": schema_preservation,
    "auth/client-credentials-basic": call_every_tool,
    "auth/client-credentials-jwt": call_every_tool,
}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """This client's answer to a request the gateway relays: an elicitation accepted with each
    property's default (a boolean without one: true), no roots."""
    method, params = request["method"], request.get("params") or {}
    if method == "elicitation/create":
        props = (params.get("requestedSchema") or {}).get("properties", {})
        content = {k: p["default"] if "default" in p else True
                   for k, p in props.items() if "default" in p or p.get("type") == "boolean"}
        result: dict[str, Any] = {"action": "accept", "content": content}
    elif method == "roots/list":
        result = {"roots": []}
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": request["id"],
                "error": {"code": -32601, "message": f"not supported: {method}"}}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


async def answer_requests(client: Client) -> None:
    done = 0
    while True:
        await client.wait_for(lambda done=done: len(client.requests) > done,
                              timeout=float("inf"))
        for request in client.requests[done:]:
            log(f"answering {request['method']}")
            await client.send(answer(request))
        done = len(client.requests)


# ---- the operator of the authorization code flow

AUTHORIZATIONS = 3  # the most the driver completes in one scenario
SETTLE_TIMEOUT = 10.0  # the backend reaching RUNNING or AUTHORIZING
LEAVE_TIMEOUT = 2.0  # the backend leaving AUTHORIZING once authorized
# The scenarios where the gateway must refuse to go on (the suite allows the client to fail):
# the driver succeeds when no step could be done.
REFUSALS = frozenset({"auth/scope-retry-limit", "auth/resource-mismatch",
                      "auth/iss-supported-missing", "auth/iss-wrong-issuer",
                      "auth/iss-unexpected", "auth/iss-normalized",
                      "auth/metadata-issuer-mismatch"})


async def settled(admin: int, states: tuple[str, ...] = ("RUNNING", "AUTHORIZING")) -> str:
    """The backend's state once it is one of ``states`` (another process's: polled)."""
    found = await wait_instance(admin, lambda i: i["state"] in states, timeout=SETTLE_TIMEOUT)
    return str(found["state"])


def authorize(config: str, http: int) -> None:
    """Be the operator: `mcp-gateway authorize remote` gives the URL; the authorization server
    (the scenario's) answers it with a redirect at once, which is not followed but delivered
    to the gateway's redirect endpoint, as a browser would."""
    done = subprocess.run([sys.executable, "-m", "gateway", "authorize", "remote", "--config",
                           config], capture_output=True, text=True, timeout=CALL_TIMEOUT,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mcp-gateway authorize failed: {done.stderr.strip()}")
    url = urlsplit(done.stdout.strip())
    conn = http_client.HTTPConnection(url.hostname, url.port, timeout=CALL_TIMEOUT)
    conn.request("GET", f"{url.path}?{url.query}")
    answer = conn.getresponse()
    location = answer.getheader("location")
    conn.close()
    if answer.status not in (301, 302, 303, 307) or not location:
        raise RuntimeError(f"the authorization endpoint answered {answer.status}, no redirect")
    back = urlsplit(location)
    if (back.hostname, back.port) != ("127.0.0.1", http):
        raise RuntimeError(f"redirected elsewhere: {location}")
    conn = http_client.HTTPConnection("127.0.0.1", http, timeout=CALL_TIMEOUT)
    conn.request("GET", f"{back.path}?{back.query}")
    answer = conn.getresponse()
    said = answer.read().decode(errors="replace").strip()
    conn.close()
    log(f"redirect delivered: {answer.status} {said}")
    if answer.status != 200:
        raise RuntimeError(f"the gateway refused the redirect: {said}")


async def authorized_steps(client: Client, admin: int, config: str, http: int,
                           steps: Callable[[Client, dict[str, Any]], Awaitable[None]],
                           context: dict[str, Any]) -> None:
    """The steps, authorizing whenever the backend waits in AUTHORIZING (at most
    :data:`AUTHORIZATIONS` times); a failed step after which it waits is tried again."""
    done = 0
    while True:
        if await settled(admin) == "AUTHORIZING":
            if done == AUTHORIZATIONS:
                raise RuntimeError(f"still AUTHORIZING after {done} authorizations")
            done += 1
            await trio.to_thread.run_sync(authorize, config, http)
            with trio.move_on_after(LEAVE_TIMEOUT):  # it may come back at once (a moved server)
                await settled(admin, ("STARTING", "RUNNING", "BACKOFF"))
            continue
        try:
            await steps(client, context)
            return
        except RuntimeError:
            try:
                if await settled(admin, ("AUTHORIZING",)) == "AUTHORIZING":
                    log("the backend wants an authorization again")
                    continue
            except trio.TooSlowError:
                pass
            raise


async def drive(ws_port: int, admin: int, scenario: str, context: dict[str, Any],
                config: str = "", http: int = 0) -> None:
    """The scenario's steps (authorizing when the backend asks); then the remote's session must
    still be the first one (a restart in between, e.g. a GET stream refused, is a client defect
    no check of the suite sees; an AUTHORIZING wait is no restart)."""
    steps = SCENARIOS.get(scenario, call_every_tool if authorization_code(scenario)
                          else just_list)
    async with connect(f"ws://127.0.0.1:{ws_port}/",
                       capabilities={"elicitation": {"form": {}}}) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_requests, client)
            if scenario in REFUSALS:
                try:
                    await authorized_steps(client, admin, config, http, steps, context)
                except (RuntimeError, trio.TooSlowError) as exc:
                    log(f"refused, as it must be: {exc}")
                    nursery.cancel_scope.cancel()
                    return
                raise RuntimeError("the gateway went on where it must refuse")
            if authorization_code(scenario):
                await authorized_steps(client, admin, config, http, steps, context)
            else:
                await steps(client, context)
            nursery.cancel_scope.cancel()
    status, body = await http_request(admin, "/status")
    instance = json.loads(body)["backends"][0]["instances"][0]
    if status != 200 or instance["restarts"] or instance["state"] != "RUNNING":
        raise RuntimeError(f"the remote's session did not hold: {instance}")


async def wait_ready(admin: int, proc: subprocess.Popen[bytes]) -> None:
    async def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode} before it was ready")
        try:
            status, _ = await http_request(admin, "/readyz")
        except OSError:
            return False
        return status == 200

    with trio.fail_after(READY_TIMEOUT):
        await poll(ready, 0.05)  # another process's readiness


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_TIMEOUT)
        log(f"gateway exited with {code}")
    except subprocess.TimeoutExpired:
        log("gateway still running after SIGTERM: killed")
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> int:
    url = argv[-1]
    scenario = os.environ.get("MCP_CONFORMANCE_SCENARIO", "")
    revision = os.environ.get("MCP_CONFORMANCE_PROTOCOL_VERSION", "2025-11-25")
    context = json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT") or "{}")
    ws, admin, http = free_port(), free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="clientconf-") as tmp:
        path = os.path.join(tmp, "gateway.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(gateway_toml(url, revision, ws, admin, context, tmp, scenario, http))
        log(f"scenario {scenario} at {revision}: gateway for {url}")
        env = {**os.environ, "PYTHONPATH": ROOT}
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config", path],
                                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
        started = time.monotonic()
        try:
            trio.run(wait_ready, admin, proc)
            log(f"gateway ready in {time.monotonic() - started:.2f}s")
            trio.run(drive, ws, admin, scenario, context, path, http)
            return 0
        except Exception:
            log("failed:\n" + traceback.format_exc())
            return 1
        finally:
            stop(proc)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
