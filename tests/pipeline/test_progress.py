"""kiln.core.progress: what a line says (count, rate, ETA), how often a log gets one, and silence
when nothing listens."""

from __future__ import annotations

import threading

from kiln.core import progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_text_gives_count_rate_and_eta():
    clock = Clock()
    t = progress.Task("perplexity", total=400, unit="windows", clock=clock)
    assert t.text() == "0/400 windows"  # no rate before the first item
    clock.now, t.done = 40.0, 120
    assert t.text() == "120/400 windows, 3.0/s, ETA 1m33s"
    t.total = None
    assert t.text() == "120 windows, 3.0/s"
    assert progress.duration(45) == "45s" and progress.duration(7500) == "2h05m"


def test_lines_come_every_interval_not_every_advance():
    clock, lines = Clock(), []
    shown = progress.Lines(lines.append, every_s=10.0, clock=clock)
    with progress.task("quality[baseline]", displays=[shown], clock=clock):
        progress.total(30, "documents")
        for _ in range(30):
            clock.now += 1.0
            progress.advance()
    assert lines == ["  quality[baseline]: 10/30 documents, 1.0/s, ETA 20s",
                     "  quality[baseline]: 20/30 documents, 1.0/s, ETA 10s",
                     "  quality[baseline]: 30/30 documents, 1.0/s, ETA 0s"]


def test_no_task_no_output_and_the_outer_task_comes_back():
    progress.advance(5)  # nothing open: nothing happens, nothing fails
    progress.total(3)
    clock, lines = Clock(), []
    with progress.task("outer", displays=[progress.Lines(lines.append, every_s=0, clock=clock)], clock=clock) as outer:
        with progress.task("inner", clock=clock) as inner:
            progress.advance(2)
        progress.advance()
    assert (outer.done, inner.done) == (1, 2)
    assert lines == ["  outer: 1 items"]
    progress.advance()
    assert outer.done == 1


def test_advance_from_many_threads_counts_every_item():
    with progress.task("load") as t:
        threads = [threading.Thread(target=lambda: [progress.advance() for _ in range(2000)]) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert t.done == 8000


def test_a_terminal_gets_a_bar_a_pipe_lines_and_both_the_log(monkeypatch):
    from rich.console import Console

    monkeypatch.setenv(progress.EVERY_ENV, "2.5")
    piped = progress.displays_for(Console(force_terminal=False))
    assert [type(d) for d in piped] == [progress.Lines, progress.Lines] and piped[0].every_s == 2.5
    tty = progress.displays_for(Console(force_terminal=True))
    assert [type(d) for d in tty] == [progress.Bar, progress.Lines]


def test_the_bar_shows_the_stage_label_as_written():
    import io

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress.task("quality[baseline]", displays=[progress.Bar(console)]):
        progress.total(4, "documents")
        progress.advance(3)
    assert "quality[baseline]" in out.getvalue() and "3/4 documents" in out.getvalue()  # not rich markup


def test_a_loop_knows_when_kiln_shows_its_progress():
    assert not progress.shown()
    with progress.task("bare"):
        assert not progress.shown()  # open, but nothing displays it
        with progress.task("lmeval[baseline]", displays=[progress.Lines(lambda _: None)]):
            assert progress.shown()  # lm-eval's adapter then keeps its tqdm bar off the terminal
