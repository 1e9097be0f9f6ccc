"""``flowlock check --layout``: an unknown layout is refused with the supported ones, before any job."""

from flowlock.cli import main


def test_unknown_layout_is_refused_naming_the_supported_ones(capsys):
    assert main(["check", "--layout", "ulysses=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown layout 'ulysses=3'" in err and "ulysses=2, ulysses=4, dp=2,ulysses=2" in err
