"""flexsgl's log: progress bars show on a terminal only, at log level info or lower."""

import io

import pytest

from flexsgl import log


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty, level, disable, shown", [
    (True, "info", False, True),
    (False, "info", False, False),  # a file or a pipe: a log gets no bars
    (True, "warning", False, False),
    (True, "info", True, False),
])
def test_progress_bars_show_on_a_terminal_at_info(monkeypatch, tty, level, disable, shown):
    stream = Stream(tty)
    monkeypatch.setattr(log.sys, "stderr", stream)
    before = log.logger.level
    log.logger.setLevel(level.upper())
    try:
        bar = log.progress(range(5), desc="loading weights", disable=disable)
        assert list(bar) == [0, 1, 2, 3, 4]
    finally:
        log.logger.setLevel(before)
    assert ("loading weights" in stream.getvalue()) == shown, stream.getvalue()


def test_a_stream_without_isatty_is_no_terminal():
    assert not log.on_terminal(None) and not log.on_terminal(object())
    closed = io.StringIO()
    closed.close()
    assert not log.on_terminal(closed)
