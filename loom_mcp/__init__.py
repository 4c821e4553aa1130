"""loom-mcp: an MCP server that owns execution and the verdict for GPU kernel optimization."""

__version__ = "0.1.0"
