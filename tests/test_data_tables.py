"""The tables that ship as package data (peaks.toml, categories.toml, rules.toml) load into the
objects their modules declare, in order, with the values the datasheets and checks give."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from loom_mcp.devices import peaks
from loom_mcp.traces import categories as cat
from loom_mcp.validate.static_checks import rules


@pytest.mark.parametrize(
    "package, name",
    [
        ("loom_mcp.devices", "peaks.toml"),
        ("loom_mcp.traces", "categories.toml"),
        ("loom_mcp.validate.static_checks", "rules.toml"),
    ],
)
def test_each_table_is_package_data_beside_its_module(package: str, name: str):
    assert resources.files(package).joinpath(name).is_file()


def test_peaks_are_the_datasheet_figures_times_their_units():
    h100 = peaks.lookup_peak("NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100.model == "H100 SXM"
    # The same products the old literals computed: 66.9 * T is not the float 66.9e12.
    assert h100.flops["fp64"] == 66.9 * peaks.T != 66.9e12
    assert h100.memory_bandwidth_bytes_s == 3.35 * peaks.T
    assert (h100.memory_bytes, h100.l2_bytes) == (80 * peaks.GiB, 50 * peaks.MiB)
    assert h100.source.startswith("NVIDIA H100 Tensor Core GPU datasheet and Hopper architecture")
    b200 = peaks.lookup_peak("NVIDIA B200")
    assert b200 is not None and b200.l2_bytes is None and b200.flops["fp4"] == 9000 * peaks.T
    mi300x = peaks.lookup_peak("AMD Instinct MI300X VF")
    assert mi300x is not None
    assert mi300x.source.startswith("AMD Instinct MI300X product page / data sheet (amd.com) and")


def test_every_part_and_name_rule_is_whole():
    assert len({p.model for p in peaks.PEAKS}) == len(peaks.PEAKS)
    assert all("{" not in p.source and "}" not in p.source for p in peaks.PEAKS)
    assert {model for model, _ in peaks._RULES} == {p.model for p in peaks.PEAKS}
    # Qualified variants before the bare name, or the bare name would always win.
    order = [model for model, _ in peaks._RULES]
    assert order.index("H100 PCIe") < order.index("H100 SXM")
    assert order.index("MI250X") < order.index("MI250")


def test_category_rules_keep_their_order_and_case():
    assert [c for c, _ in cat._KERNEL_RULES] == [
        cat.COMM, cat.MEMCPY, cat.TRITON, cat.ATTENTION, cat.MOE, cat.GEMM, cat.NORM, cat.QUANT,
        cat.ELEMENTWISE, cat.REDUCTION, cat.ELEMENTWISE,
    ]  # fmt: skip
    assert [c for c, _ in cat._OP_RULES] == [
        cat.COMM, cat.ATTENTION, cat.MOE, cat.GEMM, cat.NORM, cat.QUANT, cat.REDUCTION,
        cat.ELEMENTWISE,
    ]  # fmt: skip
    case_sensitive = [c for c, rx in cat._KERNEL_RULES + cat._OP_RULES if not rx.flags & re.I]
    assert case_sensitive == [cat.TRITON]
    # Split patterns are joined without a separator.
    assert cat.classify("ncclDevKernel_AllReduce", 0) == cat.COMM
    assert cat.classify("multimem_all_reduce", 0) == cat.COMM
    assert cat.op_category("aten::cudnn_convolution") == cat.GEMM


def test_rules_bind_exactly_what_rules_py_declares():
    declared = dict(rules.__annotations__)
    namespace: dict[str, object] = {"__annotations__": declared}
    rules._bind(namespace)
    bound = {name: value for name, value in namespace.items() if name.isupper()}
    assert len(bound) == 103 and all(value == getattr(rules, name) for name, value in bound.items())
    assert isinstance(rules.GUARDED_ROOTS, frozenset) and isinstance(rules.THREAD_MODULES, tuple)
    assert rules.MODULE_RULES[0] == (rules.THREAD_MODULES, rules.THREAD_IMPORT)
    with pytest.raises(ValueError, match="NOT_IN_THE_FILE"):
        rules._bind({"__annotations__": {**declared, "NOT_IN_THE_FILE": "Rule"}})
