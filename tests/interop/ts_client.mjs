// The TypeScript SDK client (npm @modelcontextprotocol/sdk, pinned in scripts/setup) against an
// MCP Streamable HTTP endpoint: initialize, list the tools, call one, close. Prints one JSON line:
//   {"protocolVersion": ..., "sessionId": ..., "tools": [names], "result": <tools/call result>}
// Usage: node ts_client.mjs NODE_MODULES URL TOOL JSON_ARGS
// (NODE_MODULES: where scripts/setup installed the SDK; ES modules do not read NODE_PATH.)
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, url, tool, args] = process.argv.slice(2);
const sdk = (path) => import(pathToFileURL(join(modules, "@modelcontextprotocol/sdk/dist/esm", path)).href);
const { Client } = await sdk("client/index.js");
const { StreamableHTTPClientTransport } = await sdk("client/streamableHttp.js");
const transport = new StreamableHTTPClientTransport(new URL(url));
const client = new Client({ name: "interop-ts", version: "0" });
await client.connect(transport);
const tools = (await client.listTools()).tools.map((t) => t.name);
const result = await client.callTool({ name: tool, arguments: JSON.parse(args) });
const out = {
  protocolVersion: transport.protocolVersion,
  sessionId: transport.sessionId,
  tools,
  result,
};
await transport.terminateSession();
await client.close();
console.log(JSON.stringify(out));
