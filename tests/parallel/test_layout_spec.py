"""The parallel layout table: one parser for every spelling, the check's scenarios and the trace's
support read from it, and the command line's help rendered from it."""

import pytest

from flowlock.cli import build_parser
from flowlock.validate.layout_spec import (
    ONE_PROCESS,
    PARALLEL_LAYOUTS,
    layout_help,
    layout_names,
    parse_parallel_layout,
)
from flowlock.validate.layout_worker import SCENARIOS


@pytest.mark.parametrize("spec, name", [
    ("ulysses=2", "ulysses=2"), ("dp=1,ulysses=2", "ulysses=2"), ("ulysses=2, dp=2", "dp=2,ulysses=2"),
    ("dp=2,ulysses=1", "dp=2"), ("dp=1", "ulysses=1"), ("exact,dp=4", "dp=4,exact"),
])
def test_every_spelling_parses_to_its_row(spec, name):
    use = "check" if "exact" in spec else "trace"
    layout = parse_parallel_layout(spec, use)
    assert layout.name == name and layout in PARALLEL_LAYOUTS
    assert parse_parallel_layout(layout.name, use) is layout


@pytest.mark.parametrize("spec", ["ulysses=3", "dp=2,dp=2", "ulysses", "exact=1", "tp=2", "dp=x", ""])
def test_unknown_spellings_are_refused_naming_the_supported_layouts(spec):
    with pytest.raises(ValueError, match=f"unknown layout {spec!r}; supported: ulysses=2, ulysses=4, dp=2,ulysses=2, "
                                         "dp=2,exact, dp=4,exact$"):
        parse_parallel_layout(spec, "check")


def test_a_layout_is_refused_where_it_is_not_served():
    with pytest.raises(ValueError, match="layout 'dp=2,exact' has no trace here; supported: ulysses=1, ulysses=2,"):
        parse_parallel_layout("dp=2,exact", "trace")
    with pytest.raises(ValueError, match="layout 'ulysses=1' has no check here"):
        parse_parallel_layout("ulysses=1", "check")


def test_the_table_names_each_layout_once_and_every_check_has_its_scenario():
    assert len({layout.name for layout in PARALLEL_LAYOUTS}) == len(PARALLEL_LAYOUTS)
    for layout in PARALLEL_LAYOUTS:
        assert layout.world == layout.dp * layout.ulysses
        assert layout.check is None or layout.check in SCENARIOS, layout
    assert "trace" in SCENARIOS and ONE_PROCESS.world == 1 and ONE_PROCESS.traced


def test_the_command_line_help_is_rendered_from_the_table():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    check_help = next(a.help for a in sub["check"]._actions if a.dest == "layout")
    trace_help = next(a.help for a in sub["trace"]._actions if a.dest == "layout")
    assert check_help == layout_help("check") and trace_help == layout_help("trace")
    for layout in PARALLEL_LAYOUTS:
        assert (f"{layout.name} ({layout.world} ranks, {layout.checks})" in check_help) == (layout.check is not None)
    assert all(name in trace_help for name in layout_names("trace") if name != ONE_PROCESS.name)
    assert not any(name in trace_help for name in ("exact", "dp=4"))
