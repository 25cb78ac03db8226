// The TypeScript SDK client (npm @modelcontextprotocol/sdk, pinned in scripts/setup) with an
// `authProvider` (a minimal OAuthClientProvider: no stored client, no token, never opens a
// browser) against an MCP Streamable HTTP endpoint that answers 401. Prints one JSON line: what
// the SDK did and the error it reported:
//   {"connected": false, "error": "<name>: <message>", "registered": bool, "redirect": url|null,
//    "requests": ["METHOD path status", ...]}
// Usage: node ts_oauth_client.mjs NODE_MODULES URL [TOKEN]
// (TOKEN: what tokens() returns, e.g. a wrong one; none: the SDK starts without a token.)
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, url, token] = process.argv.slice(2);
const sdk = (path) => import(pathToFileURL(join(modules, "@modelcontextprotocol/sdk/dist/esm", path)).href);
const { Client } = await sdk("client/index.js");
const { StreamableHTTPClientTransport } = await sdk("client/streamableHttp.js");

const out = { connected: false, error: null, registered: false, redirect: null, requests: [] };
const redirect = "http://127.0.0.1:9/callback"; // never used: redirectToAuthorization only records
const provider = {
  get redirectUrl() { return redirect; },
  get clientMetadata() { return { client_name: "interop-ts", redirect_uris: [redirect] }; },
  clientInformation() { return undefined; },
  saveClientInformation() { out.registered = true; },
  tokens() { return token ? { access_token: token, token_type: "Bearer" } : undefined; },
  saveTokens() {},
  redirectToAuthorization(u) { out.redirect = u.href; },
  saveCodeVerifier() {},
  codeVerifier() { return "v".repeat(43); },
};
const recording = async (input, init) => {
  const response = await fetch(input, init);
  const where = new URL(input instanceof Request ? input.url : String(input));
  out.requests.push(`${init?.method ?? "GET"} ${where.pathname} ${response.status}`);
  return response;
};
const transport = new StreamableHTTPClientTransport(new URL(url), { authProvider: provider, fetch: recording });
const client = new Client({ name: "interop-ts-oauth", version: "0" });
try {
  await client.connect(transport);
  out.connected = true;
  await client.close();
} catch (e) {
  out.error = `${e?.name ?? "Error"}: ${e?.message ?? e}`;
}
console.log(JSON.stringify(out));
