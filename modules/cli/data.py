"""`tempera-data`: prepare a dataset folder before training (docs/datasets.md).

    tempera-data caption FOLDER [--preset small-card|detailed|tags] [--existing skip|extend|replace]
                                [--prefix "sks"] [--model REPO_OR_FOLDER] [--prompt ...] ...
    tempera-data mask FOLDER (--prompt TEXT ... | --remove-background) [--threshold 0.5]
                             [--dilate PIXELS] [--blur RADIUS] [--invert] [--replace] ...

Each subcommand is one row of `COMMANDS` (its options, and the function that runs it), so a new
kind of preparation is one more row. A caption option left out takes the preset's value, then
the default (modules/data/prep/caption.py's CaptionSettings, whose help texts the options show).

Exit codes: 0 finished, 1 the job failed after it started (the files written before are whole),
2 refused before anything was written (bad option, folder, model or lock: one line says what
to do), 130 / 143 stopped by Ctrl+C (SIGINT) / SIGTERM after the batch in progress was written;
the same command again continues where it stopped.
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line and exit 2, as the rest
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclass(frozen=True)
class Command:
    """One subcommand: its help, how it adds its options, and what runs it."""
    help: str  # noqa: A002 - argparse's word
    add_options: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Any, threading.Event], Any]  # -> JobReport


def caption_options(parser: argparse.ArgumentParser) -> None:
    """--preset, then one option per CaptionSettings field, from the field's help."""
    from modules.data.prep.caption import PRESETS, CaptionSettings
    parser.add_argument("--preset", choices=tuple(PRESETS),
                        help="; ".join(f"{name}: {p.summary}" for name, p in PRESETS.items()))
    for f in dataclasses.fields(CaptionSettings):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_text = f.metadata["help"] + (f" (default {default})" if default not in ("", ())
                                          else "")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, choices=f.metadata.get("choices"),
                                default=None, help=help_text)


def caption_settings(args: argparse.Namespace) -> Any:
    """CaptionSettings from the options: the preset's values, then each option given."""
    from modules.data.prep.caption import CaptionSettings, preset_settings
    from modules.data.prep.tools import parse_setting
    given = {f.name: parse_setting(f, getattr(args, f.name))
             for f in dataclasses.fields(CaptionSettings) if getattr(args, f.name) is not None}
    return preset_settings(args.preset, **given)


def run_caption(args: argparse.Namespace, hooks: Any, stop: threading.Event) -> Any:
    from modules.data.prep.caption import caption_folder
    return caption_folder(Path(args.folder), caption_settings(args), hooks, stop)


def mask_options(parser: argparse.ArgumentParser) -> None:
    from modules.cli.data_mask import add_arguments
    add_arguments(parser)


def run_mask(args: argparse.Namespace, hooks: Any, stop: threading.Event) -> Any:
    from modules.cli.data_mask import run
    return run(args, hooks, stop)


COMMANDS: dict[str, Command] = {
    "caption": Command("write a caption file for each image with a captioner or a tagger",
                       caption_options, run_caption),
    "mask": Command("write a loss mask for each image: CLIPSeg with a prompt, or a background "
                    "remover", mask_options, run_mask),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="tempera-data", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog=__doc__.split("\n\n", 1)[1])
    subs = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, command in COMMANDS.items():
        sub = subs.add_parser(name, help=command.help, description=command.help)
        sub.add_argument("folder", help="the dataset folder")
        sub.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
        command.add_options(sub)
    return parser.parse_args(argv)


class TerminalProgress:
    """A tqdm bar with the count and ETA on stderr, status lines above it."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.bar: Any = None

    def status(self, text: str) -> None:
        if self.quiet:
            return
        from tqdm import tqdm
        tqdm.write(text, file=sys.stderr)

    def progress(self, progress: Any) -> None:
        if self.quiet:
            return
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=progress.total, unit="image", dynamic_ncols=True,
                            file=sys.stderr)
        self.bar.update(progress.done - self.bar.n)
        self.bar.set_postfix_str(f"failed {progress.failed}, unreadable {progress.skipped}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from modules.data.prep.job import JobHooks, JobRefused
    from modules.util.library_noise import silence_library_noise
    silence_library_noise()
    terminal = TerminalProgress(args.quiet)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():  # a second one: stop at once
            raise KeyboardInterrupt
        received.append(signum)
        terminal.status(f"{signal.Signals(signum).name}: finishing the batch in progress "
                        "(send it again to abort at once)")
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        report = COMMANDS[args.command].run(
            args, JobHooks(progress=terminal.progress, status=terminal.status), stop)
    except JobRefused as exc:
        terminal.close()
        print(f"tempera-data {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second signal: the files written so far are whole
        terminal.close()
        print(f"tempera-data {args.command}: stopped at once; every file written is whole, and "
              "the same command continues the job", file=sys.stderr)
        return 128 + (received[-1] if received else signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        terminal.close()
    print("\n".join(report.lines()))
    if report.status == "failed":
        return 1
    if report.status == "stopped":
        return 128 + (received[0] if received else signal.SIGINT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
