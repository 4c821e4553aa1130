"""benchmark_command through the protocol: two real programs, parsed metrics, a CI, a record."""

from __future__ import annotations

import json
import sys

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server

PROGRAM = '''
import json, os, random
speed = float(os.environ.get("SPEED", "1"))
random.seed()
print("warming up")
print(json.dumps({"decode_tokens_per_s": 100 * speed * random.uniform(0.995, 1.005),
                  "ttft_ms": 50 / speed * random.uniform(0.995, 1.005)}))
'''


@pytest.mark.anyio
async def test_faster_program_wins_on_both_metrics(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    fast = tmp_path / "fast.py"
    fast.write_text(f"import os\nos.environ['SPEED'] = '1.3'\nexec(open({str(script)!r}).read())\n")
    server = build_server(load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    async with Client(server) as client:
        result = await client.call_tool("benchmark_command", {
            "baseline_command": [sys.executable, str(script)], "command": [sys.executable, str(fast)],
            "runs": 5, "parser": "json"})
        assert result.is_error is False, result.content
        data = result.structured_content
        by_name = {m["name"]: m for m in data["metrics"]}
        assert by_name["decode_tokens_per_s"]["higher_is_better"] is True
        assert by_name["ttft_ms"]["higher_is_better"] is False
        for metric in by_name.values():
            assert 1.2 < metric["ratio"]["estimate"] < 1.4
            assert metric["ratio"]["ci_low"] > 1.0
        assert len(json.dumps(data)) < 4096
        record = await client.read_resource(f"loom://runs/{data['benchmark_id']}")
        assert json.loads(record.contents[0].text)["mode"] == "command"

