"""The static checks' rule table agrees with the published CHECKS, and every family is wired."""

from __future__ import annotations

import pytest

from loom_mcp.validate.static_checks import CHECKS, check_candidate_source, rules
from loom_mcp.validate.static_checks.analyzer import CALL_HANDLERS

RULES = {name: value for name, value in vars(rules).items() if isinstance(value, rules.Rule)}
RULES.update({f"NATIVE_PATTERNS[{i}]": rule for i, (_, rule) in enumerate(rules.NATIVE_PATTERNS)})


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_is_a_published_check_at_a_published_severity(name: str):
    rule = RULES[name]
    assert rule.check in CHECKS, name
    assert rule.severity in CHECKS[rule.check].split("/"), name


def test_every_published_check_and_severity_has_a_rule():
    made = {(r.check, r.severity) for r in RULES.values()}
    for check, severities in CHECKS.items():
        for severity in severities.split("/"):
            assert (check, severity) in made, (check, severity)


def test_each_import_family_names_its_own_modules():
    for modules, rule in rules.MODULE_RULES:
        assert modules and "{name}" in rule.message, rule


def test_a_call_reaches_every_family():
    assert len(CALL_HANDLERS) == len({h.__module__ for h in CALL_HANDLERS})
    source = (
        "import os, torch\n"
        "setattr(torch, 'x', 1)\n"  # patching
        "os.system('x')\n"  # timing (processes)
        "vars()\n"  # reference (grader introspection)
        "open('f')\n"  # escape (files)
        "d.get(x.data_ptr())\n"  # shortcuts (pointer cache)
        "torch.manual_seed(0)\n"  # precision (seeds)
    )
    found = {f.check for f in check_candidate_source(source)}
    assert found >= {
        "static.monkeypatch",
        "static.threads",
        "static.grader_introspection",
        "static.io",
        "static.pointer_cache",
        "static.seed",
    }


def test_a_syntax_error_is_located():
    (finding,) = check_candidate_source("x = (\n", "cand.py")
    assert (finding.check, finding.severity) == ("static.syntax", "error")
    assert finding.where == f"cand.py:{finding.line}" and finding.message.startswith(
        "The source does not parse: "
    )
