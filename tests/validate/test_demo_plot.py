"""The demo plot stays readable: a series zero at every step is named "identical (0)", steps are
integers, count axes start at 0, strict is drawn above stock, and the log axis holds only positives."""

import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt  # noqa: E402

from flowlock.validate.demo_plot import draw_demo, plot_demo  # noqa: E402


def _lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_zero_strict_and_drifting_stock(demo_payload):
    fig = draw_demo(demo_payload(stock=(300, 320, 0), stock_logp=(4, 4, 0), stock_dlogp=(2.5e-6, 2.8e-6, 0.0)))
    try:
        velocity, logp, dlogp = fig.axes
        for ax in (velocity, logp):
            lines = _lines_by_label(ax)
            strict, stock = lines["flowlock strict: identical (0) at every step"], lines["stock diffusers"]
            assert strict.get_zorder() > stock.get_zorder()
            assert list(strict.get_ydata()) == [0, 0, 0]
            assert ax.get_ylim()[0] == 0
            assert all(float(t).is_integer() for t in ax.get_yticks())
            assert list(ax.get_xticks()) == [0, 1, 2]
        assert list(_lines_by_label(velocity)["stock diffusers"].get_ydata()) == [600, 640, 0]  # both batchings
        assert dlogp.get_yscale() == "log" and dlogp.get_ylim()[0] > 0
        labels = [line.get_label() for line in dlogp.get_lines()]
        assert "flowlock strict: identical (0) at every step" in labels
        assert "stock diffusers (0 at step 2: not on a log axis)" in labels
        assert list(_lines_by_label(dlogp)["stock diffusers (0 at step 2: not on a log axis)"].get_xdata()) == [0, 1]
    finally:
        plt.close(fig)


def test_both_paths_identical(demo_payload):
    fig = draw_demo(demo_payload())
    try:
        velocity, logp, dlogp = fig.axes
        for ax in (velocity, logp):
            assert set(_lines_by_label(ax)) == {"flowlock strict: identical (0) at every step",
                                                "stock diffusers: identical (0) at every step"}
            assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1
        assert dlogp.get_yscale() == "linear" and list(dlogp.get_yticks()) == []
        assert "no log-prob changed" in [t.get_text() for t in dlogp.texts]
    finally:
        plt.close(fig)


def test_plot_demo_writes_a_png(demo_payload, tmp_path):
    path = plot_demo(demo_payload(stock=(1, 0, 0)), tmp_path / "sub" / "demo.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
