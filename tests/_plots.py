"""What a chart a benchmark or the demo writes must be: a PNG that parses and holds more than empty axes."""

from __future__ import annotations

import io
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_drawn_png(path: Path) -> None:
    """`path` starts with the PNG signature, matplotlib reads it back, and it is larger than the PNG of one
    empty pair of axes at the same pixel size (a chart whose lines, bars, labels or legend were never drawn
    compresses to about that; every chart of ours holds more)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG: it starts with {data[:8]!r}"
    height, width = imread(io.BytesIO(data), format="png").shape[:2]
    empty = Figure(figsize=(width / 100, height / 100), dpi=100)
    empty.add_subplot()
    blank = io.BytesIO()
    FigureCanvasAgg(empty).print_png(blank)
    assert len(data) > len(blank.getvalue()), (
        f"{path} ({width} x {height} px) holds {len(data)} bytes, no more than empty axes ({len(blank.getvalue())})"
    )
