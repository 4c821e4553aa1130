"""The MCPServer that `build_server` (server.py) fills with loom's tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from loom_mcp.errors import LoomError
from loom_mcp.runtime import Services


class LoomServer(MCPServer):
    """MCPServer whose argument mistakes come back coded: unknown tools [NOT_FOUND], arguments
    that fail the tool's schema (or that it does not take) [BAD_INPUT] naming them, relative
    paths resolved against the named campaign's repository or refused."""

    services: Services | None = None

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        from pydantic import ValidationError

        from loom_mcp.tool_contract import absolute_paths, argument_error

        tool = self._tool_manager.get_tool(name)
        if tool is None:
            known = ", ".join(t.name for t in self._tool_manager.list_tools())
            raise ToolError(f"[NOT_FOUND] no tool {name[:100]!r}; the tools are: {known}")
        try:
            if self.services is not None:
                ledger = self.services.ledger

                def campaign_repo(campaign_id: str) -> Path | None:
                    row = ledger.campaign(campaign_id)
                    return Path(row["repo"]) if row else None

                arguments = absolute_paths(
                    name, arguments, campaign_repo, known_id=lambda value: ledger.run(value) is not None
                )
            return await super().call_tool(name, arguments, context)
        except LoomError as exc:
            raise ToolError(f"Error executing tool {name}: {exc}") from exc
        except ToolError as exc:
            if not isinstance(exc.__cause__, ValidationError):
                raise
            fields = tool.fn_metadata.arg_model.model_fields
            accepted = {n: f.is_required() for n, f in fields.items()}
            raise ToolError(
                f"Error executing tool {name}: {argument_error(name, exc.__cause__, accepted)}"
            ) from exc.__cause__
