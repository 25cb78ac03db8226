"""The gateway as the client of a conformance ``auth/client-credentials-*`` scenario.

Run by ``conformance client --command``: the scenario's server URL is the last argument and
its credentials are in ``MCP_CONFORMANCE_CONTEXT`` (``client_id``, and ``client_secret`` or
``private_key_pem`` with ``signing_algorithm``).  The gateway runs in-process with that server
as a required remote backend whose ``[oauth]`` takes the secret or key from files (the token
endpoint is discovered); one client then lists the tools and calls ``test-tool`` through it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import connect, make_config, run_gateway


def oauth_table(ctx: dict[str, Any], folder: str) -> str:
    """``[backends.cc.oauth]`` for the scenario's context; secrets written to ``folder``."""
    lines = [f"client_id = {json.dumps(ctx['client_id'])}"]
    if "client_secret" in ctx:
        with open(os.path.join(folder, "secret"), "w") as f:
            f.write(ctx["client_secret"])
        lines.append(f'client_secret = {{ file = "{folder}/secret" }}')
    if "private_key_pem" in ctx:
        with open(os.path.join(folder, "key.pem"), "w") as f:
            f.write(ctx["private_key_pem"])
        lines += ['auth_method = "private_key_jwt"',
                  f'private_key = {{ file = "{folder}/key.pem" }}',
                  f"algorithm = {json.dumps(ctx.get('signing_algorithm', 'ES256'))}"]
    return "\n".join(lines) + "\n"


async def main(url: str, ctx: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        cfg = make_config(f'[backends.cc]\nurl = "{url}"\nrequired = true\n'
                          "[backends.cc.oauth]\n" + oauth_table(ctx, folder))
        async with run_gateway(cfg) as running, connect(running.url) as client:
            listed = await client.request("tools/list")
            called = await client.call("cc__test-tool")
            print(json.dumps({"tools/list": listed, "tools/call": called}))
            if "result" not in listed or "result" not in called:
                sys.exit(1)


if __name__ == "__main__":
    trio.run(main, sys.argv[-1], json.loads(os.environ.get("MCP_CONFORMANCE_CONTEXT", "{}")))
