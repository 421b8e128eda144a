"""The progress bar: silent off a terminal and on short runs, one line when drawn."""

from __future__ import annotations

import io

from hicache.simulate.progress import ProgressBar


def test_draws_one_line_and_ends_it():
    stream = io.StringIO()
    bar = ProgressBar("simulate", enabled=True, stream=stream, delay_s=0.0)
    for done in range(0, 101, 25):
        bar(done, 100)
    text = stream.getvalue()
    assert text.startswith("\rsimulate [")
    assert "100/100 100%" in text
    assert text.endswith("\n") and text.count("\n") == 1
    bar.close()
    assert stream.getvalue() == text  # finished: close adds nothing


def test_stays_silent_when_disabled_or_quick():
    stream = io.StringIO()
    ProgressBar("x", enabled=False, stream=stream, delay_s=0.0)(5, 10)
    quick = ProgressBar("x", enabled=True, stream=stream, delay_s=60.0)
    quick(5, 10)
    quick(10, 10)
    assert stream.getvalue() == ""
