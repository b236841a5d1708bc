"""The ``fp8export`` command line: a click group that only translates.

Each command lives in ``fp8export.commands.<name>`` and is imported only when it runs (or
when ``--help`` lists it; command modules import nothing heavier than click). Commands build
a frozen config, call one function in ``fp8export.api`` and render the result. This module
maps outcomes to the exit codes of the CLI contract and ends every run of a command with a
``PASSED | <cmd> | <s>`` or ``FAILED | <cmd> | <s>`` line on stderr: Fp8ExportError → 1 with one
message and no traceback, usage errors (click's and UsageError) → 2, VerificationFailed → 3,
Ctrl-C → 130, SIGTERM/SIGHUP → 128 + the signal (unwound like Ctrl-C, so temporary outputs are
removed). Any other exception is a bug: one line naming it and how to report it (the traceback
with ``fp8export --debug`` or ``FP8EXPORT_DEBUG=1``), then ``FAILED``, exit 4.
``--help`` and ``--version`` print no status line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback

import click

from fp8export import __version__
from fp8export._progress import printable
from fp8export.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_VERIFY_FAILED,
    Fp8ExportError,
    Terminated,
    UsageError,
    VerificationFailed,
)


# Each command's module is imported only when that command is listed or run.
def _convert() -> click.Command:
    from fp8export.commands.convert import command

    return command


def _calibrate() -> click.Command:
    from fp8export.commands.calibrate import command

    return command


def _export_onnx() -> click.Command:
    from fp8export.commands.export_onnx import command

    return command


def _build_engine() -> click.Command:
    from fp8export.commands.build_engine import command

    return command


def _verify() -> click.Command:
    from fp8export.commands.verify import command

    return command


def _inspect() -> click.Command:
    from fp8export.commands.inspect import command

    return command


# name -> loader of its click command, in the order of the data flow.
COMMANDS = {
    "convert": _convert,
    "calibrate": _calibrate,
    "export-onnx": _export_onnx,
    "build-engine": _build_engine,
    "verify": _verify,
    "inspect": _inspect,
}


def _raise_terminated(signum, frame):
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


@contextlib.contextmanager
def _unwind_on_termination():
    """SIGTERM and SIGHUP (a job killed, a terminal closed) unwind like Ctrl-C, so the hidden
    temporary outputs are removed instead of left behind. Only where the signal has its
    default action (``nohup`` keeps SIGHUP ignored) and in the main thread; restored after."""
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _raise_terminated)
        except ValueError:  # not the main thread: leave the defaults
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _terminated(exc: BaseException) -> Terminated | None:
    while exc is not None:
        if isinstance(exc, Terminated):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _command_name(argv: list[str]) -> str:
    """The command a command line runs (its first non-option word), for the status line."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return "fp8export"


def _debug(argv: list[str]) -> bool:
    """``fp8export --debug CMD`` (before the command) or ``FP8EXPORT_DEBUG=1``."""
    name = _command_name(argv)
    flags = argv[:argv.index(name)] if name in argv else argv
    return "--debug" in flags or os.environ.get("FP8EXPORT_DEBUG", "") not in ("", "0")


def _internal_error(exc: Exception, debug: bool) -> None:
    """A bug, not the user's input: say so, how to report it, and where the traceback is."""
    if debug:
        click.echo(printable(traceback.format_exc()).rstrip("\n"), err=True)
    click.echo(f"Internal error (a bug in fp8export {__version__}, not in your input): "
               f"{type(exc).__name__}: {printable(exc)}", err=True)
    how = "the traceback above" if debug else \
        "the traceback (rerun with `fp8export --debug ...` or FP8EXPORT_DEBUG=1 to show it)"
    click.echo(printable(f"Please report it to the fp8export maintainers with the command "
                         f"line, the output of `fp8export --version` and {how}."), err=True)


def _quiet() -> bool:
    from fp8export.distributed import is_quiet_rank

    return is_quiet_rank()


def _report(exc: BaseException, message: str) -> str | None:
    """The line this process prints for ``exc``; None where a data-parallel run has rank 0
    speak for it (``fp8export.distributed.error_line``)."""
    from fp8export.distributed import error_line

    return error_line(exc, message)


def _leave() -> None:
    if "torch.distributed" in sys.modules:  # only a run that joined a process group
        from fp8export.distributed import leave

        leave()


class LazyGroup(click.Group):
    """Imports a command's module only when that command is listed or run."""

    def list_commands(self, ctx):
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx, name):
        return self._load(name)

    @staticmethod
    def _load(name):
        load = COMMANDS.get(name)
        return None if load is None else load()

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run one command line; return (or, standalone, exit with) the contract's exit code."""
        argv = list(sys.argv[1:] if args is None else args)
        name = _command_name(argv)
        start = time.perf_counter()
        try:
            with _unwind_on_termination():
                rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:  # usage errors (2) and click's file errors (1)
            exc.show()
            code = exc.exit_code
        except UsageError as exc:
            line = _report(exc, printable(exc))
            if line is not None:
                click.echo(f"Error: {printable(line)}", err=True)
                click.echo(f"Try 'fp8export {name} --help' for the options.", err=True)
            code = EXIT_USAGE
        except Fp8ExportError as exc:
            line = _report(exc, printable(exc))
            if line is not None:
                click.echo(f"Error: {printable(line)}", err=True)
            code = EXIT_BAD_INPUT
        except VerificationFailed as exc:
            if not _quiet():
                click.echo(f"Verification failed: {printable(exc)}", err=True)
            code = EXIT_VERIFY_FAILED
        except (click.Abort, KeyboardInterrupt) as exc:  # click turns Ctrl-C into Abort
            term = _terminated(exc)
            what = f"Terminated by {signal.Signals(term.signum).name}" if term else "Interrupted"
            # click has already ended the line (after a terminal's "^C") when it turned the
            # interrupt into Abort; one more newline would leave blank lines in a log
            lead = "" if isinstance(exc, click.Abort) else "\n"
            click.echo(f"{lead}{what}: outputs are written atomically, nothing was left "
                       "half-written.", err=True)
            code = 128 + term.signum if term else EXIT_INTERRUPTED
        except Exception as exc:  # a bug in fp8export, not bad input: its own code
            if _report(exc, f"internal error: {type(exc).__name__}: {printable(exc)}") \
                    is not None:
                _internal_error(exc, _debug(argv))
            code = EXIT_INTERNAL
        else:
            if isinstance(rv, int):  # --help, --version: click's own exits, not a run
                return self._finish(rv, standalone_mode)
            code = EXIT_OK
        status = "PASSED" if code == EXIT_OK else "FAILED"
        if not _quiet():
            click.echo(f"{status} | {name} | {time.perf_counter() - start:.2f}s", err=True)
        _leave()
        return self._finish(code, standalone_mode)

    @staticmethod
    def _finish(code: int, standalone_mode: bool) -> int:
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fp8export")
@click.option("--debug", is_flag=True,
              help="On an internal error (exit 4), print its traceback (also FP8EXPORT_DEBUG=1).")
def cli(debug):
    """Take a trained transformer to a verified FP8 (E4M3) deployment.

    Inputs: Hugging Face folders, .safetensors, .pt/.pth/.bin state dicts, Transformer Engine
    and torchao checkpoints, Keras 3 .keras / .weights.h5 files. Scale convention everywhere:
    scale = amax / 448 (a dequantization factor).
    """


def main(argv=None) -> int:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="fp8export", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
