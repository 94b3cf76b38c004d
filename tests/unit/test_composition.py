"""docs/parallel.md's composition table is the one the rules give, and the rules' verdicts are the tested ones."""

from __future__ import annotations

import re

from graphstep.validation.composition import COLUMNS, LAYOUTS, cell, composition_table
from helpers.launch import ROOT


def test_docs_parallel_holds_the_table_the_rules_give():
    text = (ROOT / "docs" / "parallel.md").read_text()
    found = re.search(r"<!-- composition table: .*? -->\n(.*?)<!-- end of the composition table -->", text, re.S)
    assert found, "docs/parallel.md has no composition table between its markers"
    assert found.group(1) == composition_table(), (
        "docs/parallel.md's composition table is out of date: paste `python -m graphstep.validation.composition`")


def test_cells_name_the_refusing_rules():
    by_name = {layout.name: layout for layout in LAYOUTS}
    columns = dict(COLUMNS)
    assert cell(by_name["pp2 x tp2"], columns["full_iteration"]) == "yes"
    assert cell(by_name["3-D: pp2 x FSDP2 ZeRO-3 (dp2) x tp2"], columns["full_iteration"]) == "yes"
    assert cell(by_name["pp2 x cp2"], columns["full_iteration"]) == "yes"
    assert cell(by_name["pp2 x cp2"], columns["compile"]) == "yes"
    assert cell(by_name["pp2 x tp2"], columns["compile"]) == "yes"
    assert cell(by_name["3-D: pp2 x FSDP2 ZeRO-3 (dp2) x tp2"], columns["per-layer graphs"]) == "R27"
    assert cell(by_name["hybrid (Mamba), pp2 x cp2"], columns["per-layer graphs"]) == "yes"
    assert cell(by_name["interleaved pipeline (pp2 x vpp2)"], columns["per-layer graphs"]) == "yes"
    assert cell(by_name["interleaved pipeline (pp2 x vpp2)"], columns["full_iteration + recompute"]) == "yes"
    assert cell(by_name["MoE, pp2 x ep2"], columns["full_iteration + recompute"]) == "yes"
    assert cell(by_name["MoE, pp2 x tp2"], columns["full_iteration"]) == "yes"
