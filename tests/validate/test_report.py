"""The report style: plain aligned text off a terminal, ``rich`` tables on one, JSON to a file."""

import io
import json

import pytest

from flowlock.validate.report import Table, plain, show, write_json

TABLE = Table("counts", ("name", "value"), (("alpha", "1"), ("b", "1234")), right=frozenset({1}))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_aligns_columns_and_right_aligns_numbers():
    assert plain(TABLE).splitlines() == [
        "counts",
        "name  | value",
        "-------------",
        "alpha |     1",
        "b     |  1234",
    ]


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="2 columns"):
        Table("t", ("a", "b"), (("only one",),))


def test_off_a_terminal_show_writes_plain_text():
    out = io.StringIO()
    show(["a line", TABLE], stream=out)
    assert out.getvalue() == "a line\n" + plain(TABLE) + "\n"


def test_on_a_terminal_show_draws_a_rich_table_and_leaves_lines_as_they_are():
    out = _Terminal()
    show(["[bold] is not markup", TABLE], stream=out)
    text = out.getvalue()
    assert "[bold] is not markup" in text
    assert "┃" in text or "│" in text  # a box-drawn table, not the plain one
    assert "alpha" in text and "1234" in text and "-------------" not in text


def test_write_json_creates_the_folder(tmp_path):
    path = tmp_path / "deeper" / "report.json"
    write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
