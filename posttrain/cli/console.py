"""Shared rich consoles: results to stdout, diagnostics to stderr.

On a terminal they wrap at its width. Written to a file or a pipe (Slurm, nohup, ``| tee``), rich would
hard-wrap at 80 columns and truncate table cells; there they are unbounded instead, so every message
and every table row stays one line (``COLUMNS`` still wins when set).
"""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions

UNBOUNDED_WIDTH = 100_000


class PlainWhenRedirected(Console):
    """A Console that neither wraps nor truncates when its output is not a terminal."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)
        if self._width is None and not self.is_terminal and "COLUMNS" not in self._environ:
            return ConsoleDimensions(UNBOUNDED_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = PlainWhenRedirected(highlight=False)
err_console = PlainWhenRedirected(stderr=True, highlight=False)
