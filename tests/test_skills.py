"""The agent skills: Agent Skills front matter rules, size, packaging, and truth about the tools.

A skill that names a tool (or an argument) the server does not have sends an agent into
`Unknown tool` errors, so every tool and argument the skills mention is checked against the
server's real tools/list.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.cli import build_parser
from loom_mcp.config import load_config
from loom_mcp.install import (
    SKILLS_PACKAGE_DIR,
    add_install_parser,
    packaged_skills,
    skill_files,
)
from loom_mcp.server import build_server

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# The one copy of the skills: package data, read by install through importlib.resources.
SKILLS = REPO / "loom_mcp" / SKILLS_PACKAGE_DIR
SKILL_DIRS = sorted(p.parent for p in SKILLS.glob("*/SKILL.md"))

# The loop's tools: the loop skill must cover each of them.
LOOP_TOOLS = {
    "device_info",
    "start_campaign",
    "profile",
    "analyze_trace",
    "compile_kernel",
    "run_validation",
    "benchmark",
    "submit_candidate",
    "campaign_report",
}
# Functions the skills show in backticks that belong to task/candidate files or Python, not MCP.
NOT_TOOLS = {
    "check",
    "data_ptr",
    "id",
    "get_inputs",
    "get_init_inputs",
    "flops",
    "bytes_moved",
    "forward",
    "load_inline",
}
SPEC_FIELDS = {"name", "description", "license", "compatibility", "metadata", "allowed-tools"}


# ---------------------------------------------------------------- a tiny YAML front matter reader


def _scalar(raw: str) -> str:
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        inner = raw[1:-1]
        # JSON's string escapes are a subset of YAML's double-quoted ones.
        return inner.replace("''", "'") if raw[0] == "'" else json.loads(raw)
    if raw[:1] in "[{&*!|>%@`":
        raise ValueError(f"unsupported YAML value {raw!r}: keep front matter to plain scalars")
    if re.search(r":\s|\s#", raw):
        raise ValueError(f"unquoted value {raw!r} contains ': ' or ' #', which YAML reads differently")
    return raw


def parse_front_matter(text: str) -> tuple[dict[str, object], str]:
    """Plain `key: value` lines, one level of `key:` + indented `k: v` maps, `>`/`|` blocks."""
    lines = text.split("\n")
    if lines[0].strip() != "---":
        raise ValueError("SKILL.md must start with a '---' front matter line")
    end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    data: dict[str, object] = {}
    i = 1
    while i < end:
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        if line[0].isspace():
            raise ValueError(f"unexpected indentation: {line!r}")
        key, sep, rest = line.partition(":")
        if not sep:
            raise ValueError(f"not a 'key: value' line: {line!r}")
        key, rest = key.strip(), rest.strip()
        if key in data:
            raise ValueError(f"duplicate key {key!r}")
        i += 1
        block: list[str] = []
        while i < end and (not lines[i].strip() or lines[i][0].isspace()):
            block.append(lines[i])
            i += 1
        if rest in (">", "|", ">-", "|-"):
            parts = [b.strip() for b in block]
            data[key] = (" " if rest[0] == ">" else "\n").join(p for p in parts if p)
        elif rest == "":
            mapping = {}
            for b in (b for b in block if b.strip()):
                k, s, v = b.strip().partition(":")
                if not s:
                    raise ValueError(f"not a 'key: value' line in {key}: {b!r}")
                mapping[k.strip()] = _scalar(v)
            data[key] = mapping
        else:
            if any(b.strip() for b in block):
                raise ValueError(f"{key}: multi-line plain scalars are not supported; use '>'")
            data[key] = _scalar(rest)
    return data, "\n".join(lines[end + 1 :])


def test_parser_reads_what_yaml_would():
    meta, body = parse_front_matter(
        "---\nname: a-b\ndescription: >\n  one\n  two\nmetadata:\n  k: 'v'\n---\n# body\n"
    )
    assert meta == {"name": "a-b", "description": "one two", "metadata": {"k": "v"}}
    assert body == "# body\n"
    with pytest.raises(ValueError):
        parse_front_matter("---\ndescription: says: this\n---\n")


# ---------------------------------------------------------------- the spec's rules


def test_skills_exist():
    assert {p.name for p in SKILL_DIRS} >= {"loom-optimize", "loom-setup"}


@pytest.mark.parametrize("skill", SKILL_DIRS, ids=lambda p: p.name)
def test_front_matter_follows_the_spec(skill: Path):
    meta, body = parse_front_matter((skill / "SKILL.md").read_text(encoding="utf-8"))
    assert set(meta) <= SPEC_FIELDS, f"fields outside the spec: {set(meta) - SPEC_FIELDS}"
    name = meta["name"]
    assert isinstance(name, str) and 1 <= len(name) <= 64
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), "lowercase, digits, single inner hyphens"
    assert name == skill.name, "name must equal the directory name"
    description = meta["description"]
    assert isinstance(description, str) and 1 <= len(description) <= 1024
    assert re.search(r"\bUse when\b", description), "the description must say when to use it"
    if "compatibility" in meta:
        assert isinstance(meta["compatibility"], str) and 1 <= len(meta["compatibility"]) <= 500
    if "metadata" in meta:
        assert isinstance(meta["metadata"], dict)
        assert all(isinstance(v, str) for v in meta["metadata"].values())
    assert len((skill / "SKILL.md").read_text(encoding="utf-8").splitlines()) < 500
    assert body.strip(), "a skill needs a body"


@pytest.mark.parametrize("skill", SKILL_DIRS, ids=lambda p: p.name)
def test_front_matter_agrees_with_yaml(skill: Path):
    yaml = pytest.importorskip("yaml")  # optional cross-check; the tiny parser is the rule
    text = (skill / "SKILL.md").read_text(encoding="utf-8")
    meta, _ = parse_front_matter(text)
    assert yaml.safe_load(text.split("---\n")[1]) == meta


# ---------------------------------------------------------------- packaging


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_package_data_ships_every_skill_file():
    """pyproject's package-data globs (what a wheel and `pip install -e .` ship) cover them all."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["loom_mcp"]
    package = REPO / "loom_mcp"
    shipped = {
        Path(match).as_posix()
        for pattern in patterns
        for match in glob.glob(pattern, root_dir=package, recursive=True)
        if (package / match).is_file()
    }
    files = {f"{SKILLS_PACKAGE_DIR}/{rel}" for rel in _tree(SKILLS)}
    assert files and files <= shipped, f"not shipped: {sorted(files - shipped)}"
    assert not (REPO / "skills").exists(), "the skills live only in loom_mcp/skills_data/"


def test_install_finds_the_packaged_skills():
    assert Path(str(packaged_skills())) == SKILLS
    found = skill_files()
    assert set(found) == {p.name for p in SKILL_DIRS}
    for name, files in found.items():
        assert files == _tree(SKILLS / name)


# ---------------------------------------------------------------- the skills tell the truth


def _inline_code(markdown: str) -> list[str]:
    without_fences = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", without_fences)


def _argument_names(text: str) -> set[str]:
    """`repo, goal, task?` / `trace=<id>` / `profiler="nsys"` -> {repo, goal, task, trace, profiler}."""
    text = re.sub(r"\"[^\"]*\"|'[^']*'|\([^)]*\)|<[^>]*>", "", text)
    names = set()
    for token in re.split(r"[,\s+/]+", text):
        token = token.split("=")[0].rstrip("?").strip()
        if re.fullmatch(r"[a-z_][a-z0-9_]*", token) and token not in {"or", "with"}:
            names.add(token)
    return names


def mentions(markdown: str) -> dict[str, set[str]]:
    """{tool: arguments named with it} for every tool the skill refers to."""
    found: dict[str, set[str]] = {}
    for span in _inline_code(markdown):
        m = re.fullmatch(r"([a-z][a-z0-9_]*)(?:\((.*)\))?", span.strip())
        if not m:
            continue
        name, args = m.group(1), m.group(2)
        if name in LOOP_TOOLS or (args is not None and name not in NOT_TOOLS):
            found.setdefault(name, set()).update(_argument_names(args or ""))
    # Rows of a table whose first header cell is "tool": | `tool` | `arguments` ... | ... |
    in_table = False
    for line in markdown.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        if re.match(r"\|\s*tool\s*\|", line):
            in_table = True
            continue
        row = re.match(r"\|\s*`([a-z_]+)`\s*\|([^|]*)\|", line)
        if in_table and row:
            args: set[str] = set()
            for span in re.findall(r"`([^`]+)`", row.group(2)):
                args |= _argument_names(span)
            found.setdefault(row.group(1), set()).update(args)
    return found


def test_mention_extraction():
    got = mentions(
        "Call `start_campaign(repo, goal, task?)` then `check(out, ref)`.\n\n"
        "| tool | call it with | you get |\n|---|---|---|\n"
        "| `profile` | `task` (+ `shape?`), or `command` with `profiler=\"nsys\"` | x |\n\n"
        "| kind | means |\n|---|---|\n| `launch_bound` | the `target` pattern |\n"
    )
    assert got == {"start_campaign": {"repo", "goal", "task"},
                   "profile": {"task", "shape", "command", "profiler"}}


def test_loop_skill_covers_the_loop():
    text = (SKILLS / "loom-optimize" / "SKILL.md").read_text(encoding="utf-8")
    assert set(mentions(text)) >= LOOP_TOOLS


@pytest.fixture
async def tools(loom_home) -> dict[str, set[str]]:
    async with Client(build_server(load_config(loom_home))) as client:
        listed = await client.list_tools()
    return {t.name: set(t.input_schema.get("properties", {})) for t in listed.tools}


@pytest.mark.anyio
@pytest.mark.parametrize("skill", SKILL_DIRS, ids=lambda p: p.name)
async def test_every_tool_and_argument_named_exists(skill: Path, tools: dict[str, set[str]]):
    named = mentions((skill / "SKILL.md").read_text(encoding="utf-8"))
    assert named, "the skill names no tool at all"
    missing = sorted(set(named) - set(tools))
    assert not missing, f"{skill.name} names tools the server lacks: {missing}"
    for tool, args in named.items():
        unknown = sorted(args - tools[tool])
        assert not unknown, f"{skill.name}: {tool} has no argument(s) {unknown}"


def _command_lines(markdown: str) -> list[str]:
    lines = []
    for block in re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", markdown, flags=re.S | re.M):
        lines += [line.split(" #")[0].strip() for line in block.splitlines()]
    lines += [span.strip() for span in _inline_code(markdown)]
    return [line for line in lines if line.startswith("loom-mcp ")]


@pytest.mark.parametrize("skill", SKILL_DIRS, ids=lambda p: p.name)
def test_every_loom_mcp_command_line_parses(skill: Path):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "install" not in sub.choices:  # until the CLI wires it in itself
        add_install_parser(sub)
    lines = _command_lines((skill / "SKILL.md").read_text(encoding="utf-8"))
    if skill.name == "loom-setup":
        assert any(line.startswith("loom-mcp install") for line in lines)
    for line in lines:
        argv = shlex.split(line)[1:]
        if argv in (["--version"], ["--help"]):
            continue
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{skill.name}: `{line}` is not a valid loom-mcp command line")
