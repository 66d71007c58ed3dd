"""``rl-cli``: the root Typer app. Each command group lives in its own module.

User mistakes (:class:`~posttrain.core.errors.UsageError`) print one red line per problem and exit
with code 2; ``--debug`` (or ``POSTTRAIN_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import os
import sys

import typer

from posttrain.cli import doctor, models_cmd, new, plot_cmd, plugins_cmd, rewards_cmd, run
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
app.command("run")(run.run)
app.command("plot")(plot_cmd.plot)
app.command("doctor")(doctor.doctor)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show tracebacks for errors")) -> None:
    if debug:
        os.environ["POSTTRAIN_DEBUG"] = "1"


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
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    debug = "--debug" in sys.argv or os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    from posttrain.core.errors import UsageError

    from posttrain.cli.options import _argv_disable_plugin

    try:
        _add_plugin_commands()
        app(args=_argv_disable_plugin(sys.argv[1:]), prog_name="rl-cli")
    except UsageError as exc:
        if debug:
            raise
        for line in str(exc).splitlines():
            err_console.print(f"[bold red]error:[/] {line}" if not line.startswith(" ") else line,
                              highlight=False, markup=True, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
