"""What every `keel report` test checks of a PNG: that it opens, has the plot's size, and is not blank."""

from __future__ import annotations

from pathlib import Path

from keel.tools.report.plots import DPI, SIZE


def assert_png_drawn(path: Path) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)  # raises on a truncated or non-PNG file
    height, width = pixels.shape[:2]
    assert width == SIZE[0] * DPI and height >= SIZE[1] * DPI, (path.name, pixels.shape)
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05, (
        path.name,
        float(rgb.std()),
    )  # lines, text and axes on white, not an empty canvas
    # some coloured (plotted) pixels
    assert (rgb.reshape(-1, 3).std(axis=1) > 0.1).mean() > 0.002, path.name
