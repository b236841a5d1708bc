"""The ``fp8export`` command line: a click group that only translates.

Each command lives in ``fp8export.commands.<name>`` and is imported only when it runs (or
when ``--help`` lists it; command modules import nothing heavier than click). Commands build
a frozen config, call one function in ``fp8export.api`` and render the result. This module
maps errors to the exit codes of the CLI contract: Fp8ExportError → 1 with one message and no
traceback, click usage errors → 2, VerificationFailed → 3.
"""

from __future__ import annotations

import importlib
import sys
import time

import click

from fp8export import __version__
from fp8export.errors import EXIT_BAD_INPUT, EXIT_VERIFY_FAILED, Fp8ExportError, VerificationFailed

# name -> module holding a click command called `command`, in the order of the data flow.
COMMANDS = {
    "convert": "fp8export.commands.convert",
    "calibrate": "fp8export.commands.calibrate",
    "export-onnx": "fp8export.commands.export_onnx",
    "build-engine": "fp8export.commands.build_engine",
    "verify": "fp8export.commands.verify",
    "inspect": "fp8export.commands.inspect",
}


class LazyGroup(click.Group):
    """Imports a command's module only when that command is listed or run."""

    def list_commands(self, ctx):
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx, name):
        return self._load(name)

    @staticmethod
    def _load(name):
        module = COMMANDS.get(name)
        if module is None:
            return None
        try:
            return importlib.import_module(module).command
        except ModuleNotFoundError as exc:
            if exc.name == module:  # command not built in this version
                return None
            raise

    def invoke(self, ctx):
        start = time.perf_counter()
        # click 8.2 deprecates ctx.protected_args; read the private field where it exists.
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        args = [*protected, *ctx.args]
        name = args[0] if args else ""
        try:
            result = super().invoke(ctx)
        except Fp8ExportError as exc:
            click.echo(f"Error: {exc}", err=True)
            click.echo(f"FAILED | {name} | {time.perf_counter() - start:.2f}s", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except VerificationFailed as exc:
            click.echo(f"Verification failed: {exc}", err=True)
            click.echo(f"FAILED | {name} | {time.perf_counter() - start:.2f}s", err=True)
            ctx.exit(EXIT_VERIFY_FAILED)
        except KeyboardInterrupt:
            click.echo("Interrupted; nothing was left half-written.", err=True)
            ctx.exit(130)
        if name:
            click.echo(f"PASSED | {name} | {time.perf_counter() - start:.2f}s", err=True)
        return result


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fp8export")
def cli():
    """Take a trained transformer to a verified FP8 (E4M3) deployment.

    \b
    convert       checkpoint -> E4M3 safetensors folder with per-tensor scales
    calibrate     sample data -> activation amax (amax.json)
    export-onnx   FP8 folder -> standard ONNX Q/DQ graph
    build-engine  ONNX -> TensorRT FP8 engine
    verify        FP8 outputs vs bf16 reference logits -> report (exit 3 on fail)
    inspect       tables and plots of checkpoints, FP8 folders, ONNX graphs

    Scale convention everywhere: scale = amax / 448 (a dequantization factor).
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
