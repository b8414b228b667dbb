"""Progress that shows in a terminal and in a log file alike.

On a terminal :func:`progress_bar` is tqdm's bar. Elsewhere — ``nohup``, SLURM, a file — a bar
is a stream of carriage returns that a log shows as one line at the end, if at all; there it
writes plain lines instead, at most one every :data:`LINE_INTERVAL` seconds (plus the first and
the last)::

    test (seed 0): 12/40 jobs (30%), 0.41 jobs/s, ETA 1m08s · ties[density=0.2] · gsm8k

The object answers the part of tqdm's interface mergelab uses (iteration, ``update``,
``set_postfix_str``, ``close``, ``with``), so either can stand where the other did.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

LINE_INTERVAL = 5.0  # seconds between two progress lines in a log


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    initial: int = 0,
    stream: TextIO | None = None,
    interval: float = LINE_INTERVAL,
) -> Any:
    """tqdm's bar on a terminal, :class:`LineProgress` elsewhere, nothing when not ``enabled``."""
    stream = sys.stderr if stream is None else stream
    if enabled and _is_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=stream)
    return LineProgress(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        enabled=enabled,
        initial=initial,
        stream=stream,
        interval=interval,
    )


def on_terminal(stream: TextIO | None = None) -> bool:
    """Whether progress on ``stream`` (default stderr) is drawn as tqdm's bars."""
    return _is_terminal(sys.stderr if stream is None else stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class LineProgress:
    """Plain progress lines: done/total, rate, ETA and the current item (see the module
    docstring). ``interval``: the least number of seconds between two lines."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        enabled: bool = True,
        initial: int = 0,
        stream: TextIO | None = None,
        interval: float = LINE_INTERVAL,
        clock: Any = time.monotonic,
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.enabled, self.interval, self.clock = enabled, interval, clock
        self.stream = sys.stderr if stream is None else stream
        self.n = self.initial = initial
        self.postfix = ""
        self.started = clock()
        self.last_line: float | None = None
        self.shown_n: int | None = None
        self.closed = False
        if enabled and (total is None or total > initial):
            self._line()

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "LineProgress(iterable) to iterate"
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled and self.last_line is not None:
            if self.clock() - self.last_line >= self.interval:
                self._line()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.enabled and self.shown_n != self.n:
            self._line()

    def text(self) -> str:
        """The progress line as it stands now."""
        elapsed = max(self.clock() - self.started, 1e-9)
        done = self.n - self.initial
        parts = [f"{self.n}/{self.total} {self.unit}s" if self.total else f"{self.n} {self.unit}s"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if done > 0:
            rate = done / elapsed
            parts.append(
                f"{rate:.2f} {self.unit}s/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}"
            )
            if self.total and self.n < self.total:
                parts.append(f"ETA {_duration((self.total - self.n) / rate)}")
        parts.append(f"elapsed {_duration(elapsed)}")
        line = f"{self.desc}: " + ", ".join(parts) if self.desc else ", ".join(parts)
        return line + (f" · {self.postfix}" if self.postfix and self.n != self.total else "")

    def _line(self) -> None:
        try:
            print(self.text(), file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed log: progress is not worth failing the work for
            self.enabled = False
            return
        self.last_line = self.clock()
        self.shown_n = self.n


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def quiet_library_bars(stream: TextIO | None = None) -> None:
    """Outside a terminal, turn off transformers', huggingface_hub's and datasets' own bars
    ("Loading weights", "Generating test split"), which would fill a log with carriage returns."""
    if _is_terminal(sys.stderr if stream is None else stream):
        return
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:  # read by datasets when it is imported (an lm-eval task's data)
        import os

        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
