"""Errors a user can cause. The CLI prints them as one line each (no traceback unless ``--debug``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(Exception):
    """A user mistake (bad config, unknown plugin, missing file). Exit code 2, no traceback."""

    exit_code = 2


class ConfigError(UsageError):
    """Every problem found in a run config, collected before anything starts.

    ``errors`` is a list of ``"path: message"`` strings, one per problem.
    """

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        head = f"{len(self.errors)} error(s) in {source}" if source else f"{len(self.errors)} config error(s)"
        super().__init__(head + ":\n" + "\n".join(f"  {e}" for e in self.errors))


class RunFailed(UsageError):
    """The run cannot go on (a trainer rank died): not a user mistake, but reported the same way, one line
    naming what failed and where its log is, exit code 1; ``rl-cli run --resume`` continues the run."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm, Kubernetes and ``kill`` send), raised in the main thread so a run stops as on
    Ctrl-C: it says where it stopped and how to resume; exit code 143 (128 + SIGTERM)."""

    exit_code = 143


class Stalled(KeyboardInterrupt):
    """The run watchdog found no progress for ``watchdog.stall_s``: raised in the main thread (as SIGTERM's
    :class:`Terminated` is, so no ``except Exception`` on the way swallows it); the CLI reports it as a
    :class:`RunFailed` line, exit code 1."""

    exit_code = 1


class PluginError(UsageError):
    """A plugin could not be loaded or registered (duplicate name, import failure, bad hook)."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" Did you mean 'grpo'?"`` or ``""``: the suffix every unknown-name message uses."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def unknown(kind: str, word: str, choices: Iterable[str], hint: str = "") -> str:
    """The one message for every unknown name: what, did-you-mean, and the valid choices."""
    choices = sorted(str(c) for c in choices)
    listed = ", ".join(choices) if choices else "(none registered)"
    return f"unknown {kind} {word!r}.{did_you_mean(word, choices)} Valid: {listed}{hint}"
