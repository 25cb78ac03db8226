"""Backend children: process control, the MCP client session with each child, supervision."""
