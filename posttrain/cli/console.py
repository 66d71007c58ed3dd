"""Shared rich consoles: results to stdout, diagnostics to stderr."""

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
