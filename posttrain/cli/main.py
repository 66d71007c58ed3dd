"""``rl-cli``: the root Typer app. Each command group lives in its own module.

User mistakes (:class:`~posttrain.core.errors.UsageError`) print one red line per problem and exit
with code 2; ``--debug`` (or ``POSTTRAIN_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import os
import signal
import sys

import typer
from rich.markup import escape

from posttrain.cli import config_cmd, doctor, models_cmd, new, plot_cmd, plugins_cmd, rewards_cmd, run
from posttrain.cli.console import err_console

app = typer.Typer(
    name="rl-cli",
    help="posttrain: plugin-based RL post-training (GRPO, PPO and relatives) on Megatron-core and SGLang.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(plugins_cmd.app, name="plugins")
app.add_typer(new.app, name="new")
app.add_typer(rewards_cmd.app, name="rewards")
app.add_typer(models_cmd.app, name="models")
app.add_typer(config_cmd.app, name="config")
app.command("run")(run.run)
app.command("plot")(plot_cmd.plot)
app.command("doctor")(doctor.doctor)


def _print_version(value: bool) -> None:
    if value:
        import platform

        from posttrain import __version__

        print(f"rl-cli (posttrain) {__version__}, Python {platform.python_version()}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show tracebacks for errors (accepted anywhere on the "
                                                            "command line)"),
          version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    if debug:
        os.environ["POSTTRAIN_DEBUG"] = "1"


def take_debug_flag(args: list[str]) -> tuple[bool, list[str]]:
    """``--debug`` may come anywhere (``rl-cli run cfg.yaml --debug``), not only before the command, as
    users add it to the end of the line that just failed; it is taken out before Typer parses. After a
    ``--`` everything is an argument, so it stays there."""
    end = args.index("--") if "--" in args else len(args)
    head = [a for a in args[:end] if a != "--debug"]
    return len(head) < end, head + args[end:]


def _add_plugin_commands() -> None:
    """Commands contributed through ``posttrain_register_commands`` (installed plugins only)."""
    from posttrain.core.plugins import load_plugins

    try:
        plugins = load_plugins()
    except Exception:  # a broken plugin must not make the CLI unusable; `plugins list` reports it
        return
    plugins.pm.hook.posttrain_register_commands(app=app)


def main() -> None:
    import faulthandler

    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    except (OSError, ValueError):  # stderr without a file descriptor (captured, embedded): no stack dumps
        pass
    flag, args = take_debug_flag(sys.argv[1:])
    if flag:
        os.environ["POSTTRAIN_DEBUG"] = "1"  # also reaches the processes a run starts
    debug = os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    from posttrain.core.errors import UsageError

    from posttrain.cli.options import _argv_disable_plugin

    try:
        previous = {sig: signal.signal(sig, _stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (embedded): the signals keep their handlers
        previous = {}
    try:
        _add_plugin_commands()
        app(args=_argv_disable_plugin(args), prog_name="rl-cli")
    except UsageError as exc:
        if debug:
            raise
        _print_error(str(exc))
        sys.exit(exc.exit_code)
    except (OSError, RuntimeError) as exc:  # the file system under the run (full, read-only): one line, exit 1
        from posttrain.core.storage import storage_failure

        line = storage_failure(exc)
        if debug or line is None:
            raise
        _print_error(line)
        sys.exit(1)
    except KeyboardInterrupt as exc:
        from posttrain.core.errors import Terminated

        err_console.print("terminated" if isinstance(exc, Terminated) else "interrupted")
        sys.exit(143 if isinstance(exc, Terminated) else 130)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_error(text: str) -> None:
    for line in text.splitlines():
        # messages quote user text (keys, values, docstrings): escaped, so `[low, high]` stays as it is
        err_console.print(f"[bold red]error:[/] {escape(line)}" if not line.startswith(" ") else escape(line),
                          highlight=False, markup=True, soft_wrap=True)


def _stop_signal(signum: int, frame: object) -> None:
    """Ctrl-C and SIGTERM (which stops a run as Ctrl-C does, with exit code 143): while a run trains, the first
    one stops it at the end of the step in flight, with a checkpoint (``core.interrupts``); else, or the second
    time, at once. Either way the run says how to resume it."""
    from posttrain.core import interrupts
    from posttrain.core.errors import Terminated

    exc = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    if interrupts.request(exc, signum):
        err_console.print(f"{interrupts.signal_name(exc)}: stopping at the end of this step, with a checkpoint "
                          "(again to stop now)", highlight=False)
        return
    raise exc


if __name__ == "__main__":
    main()
