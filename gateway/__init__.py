"""mcp-gateway: many MCP servers behind one endpoint."""

__version__ = "0.1.0"
