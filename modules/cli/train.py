"""`tempera-train` / `scripts/train.py`: train from a config file, headless.

Exit codes: 0 the run finished, 2 the config or its inputs are invalid (every problem is printed
and nothing is written to the output folder), 1 training failed after it started (files saved
before the failure stay intact), 130 / 143 stopped by SIGINT / SIGTERM after a backup, or
aborted at once by a second one (run.json says `aborted`, with the steps done).
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modules.cli.progress import ProgressReporter

EPILOG = """\
--set takes dotted keys and parses the value by the field's type, e.g.
  --set training.max_steps=200 --set compile.backend=aot_eager --set compile.vae=true
  --set sampling.prompts='["a cat", "a dog"]' --set data.datasets[0].path=./images
Paths in the config file are relative to the file's folder; paths given with --set are
relative to the current folder. docs/config.md lists every field.

Exit codes: 0 finished (or stopped from a front end), 1 training failed, 2 invalid config or
input (nothing written), 130 / 143 stopped cleanly by Ctrl+C (SIGINT) / SIGTERM: the step was
finished, a backup and the final weights were written; --resume continues it (docs/resume.md).
A second signal aborts at once (130 / 143 too; run.json says aborted, with the steps done)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tempera-train", description="Train a Stable Diffusion-style model from a config.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path,
                        help="config JSON file (e.g. training_presets/demo.json)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one field (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="validate the config and its inputs, then exit without training")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="latest|PATH",
                        help="continue an interrupted run from its newest backup (or the backup "
                             "folder PATH); the same as --set training.resume_from=...")
    # Cloud runs (docs/cloud.md): machine-local overrides and where a run came from.
    parser.add_argument("--local", type=Path, metavar="FILE",
                        help='machine-local overrides: a JSON file of {"dotted.key": value} pairs, '
                             "applied after the config and before --set (never committed)")
    parser.add_argument("--run-meta", dest="run_meta", action="append", default=[],
                        metavar="KEY=VALUE",
                        help='recorded under "meta" in run.json, e.g. commit=<sha> (repeatable)')
    parser.add_argument("--progress-file", type=Path, metavar="FILE",
                        help="write progress (step/total, loss, it/s, ETA, compile status) to this "
                             "JSON file and a clean line to stderr instead of a progress bar")
    parser.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                        help="how often --progress-file is written (30)")
    parser.add_argument("--stop-file", type=Path, metavar="FILE",
                        help="stop with a save once this file exists (tempera-cloud cancel)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from modules.frontend import silence_library_noise
    silence_library_noise()  # warnings about packages we never use (modules/util/library_noise.py)
    from modules.config import ConfigError, apply_overrides, load_config
    from modules.events import TrainerCommands
    from modules.frontend import TrainingAborted, TrainingError, train

    from modules.cloud.local_overrides import apply_local_overrides  # --local
    from modules.cloud.run_meta import add_run_meta, parse_run_meta  # --run-meta

    try:
        config = load_config(args.config)
        if args.local:
            config = apply_local_overrides(config, args.local)
        config = apply_overrides(config, args.overrides)
        if args.resume:
            config.training.resume_from = resume_value(args.resume)
        run_meta = parse_run_meta(args.run_meta)
        if args.check:  # every check a start runs, short of loading the model and training
            from modules.events import NullCallbacks
            from modules.frontend import check_run
            checked = check_run(config, NullCallbacks())
            print(f"{args.config}: valid ({len(checked.scan.items)} images; model "
                  f"{checked.model_path})")
            for line in checked.shape_plan:  # several resolutions, buckets: the compile cost
                print(line)
            if checked.memory is not None:
                print("\n".join(checked.memory.describe()))
            if checked.memory is not None and checked.memory.plan is not None:
                from modules.train.memory.memory_check import levers_report
                from modules.train.recipe.distributed import launched_distributed
                print("\n".join(levers_report(checked.config, checked.model_path,
                                               checked.memory.plan, launched_distributed())))
            return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from modules.cli.headless import TerminalCallbacks
    callbacks: TerminalCallbacks | ProgressReporter = TerminalCallbacks(
        quiet=args.quiet, bar=args.progress_file is None)
    if args.progress_file:
        from modules.cli.progress import ProgressReporter
        callbacks = ProgressReporter(callbacks, args.progress_file, args.progress_every)
    commands = TrainerCommands()
    stop_watch = None
    if args.stop_file:
        from modules.cli.progress import watch_stop_file
        stop_watch = watch_stop_file(args.stop_file, commands, callbacks.on_status)
    # First, where the run writes (the demo's outputs go to the user's data folder, which a
    # user would not guess)
    callbacks.on_status(f"output folder: {config.output.dir}")
    stop_signal = StopSignal(commands, callbacks)
    previous = {sig: signal.signal(sig, stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = train(config, callbacks, commands)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        add_run_meta(Path(config.output.dir) / "run.json", run_meta)  # --run-meta, if any
        print(f"error: {exc}", file=sys.stderr)
        print(resume_advice(args, config, argv is None), file=sys.stderr)
        return 1
    except TrainingAborted as exc:  # a second signal after the output folder was written
        print(f"error: {exc}", file=sys.stderr)
        print(resume_advice(args, config, argv is None), file=sys.stderr)
        return stop_signal.exit_code()
    except KeyboardInterrupt:  # a second signal before anything was written
        print("error: aborted before training began (a second stop signal); nothing was "
              "written", file=sys.stderr)
        return stop_signal.exit_code()
    except Exception as exc:  # before the loop (e.g. the output folder)
        from modules.util.errors import describe
        print(f"error: the run could not start: {describe(exc)}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if stop_watch is not None:
            stop_watch.set()
        callbacks.close()
    add_run_meta(result.output_dir / "run.json", run_meta)  # --run-meta, if any
    print(f"{result.status}: {result.steps} steps; outputs in {result.output_dir}")
    if result.status == "stopped":
        print(resume_advice(args, config, argv is None), file=sys.stderr)
        if stop_signal.received:  # the shell's convention: 128 + the signal's number
            return 128 + stop_signal.received
    return 0


def resume_advice(args: argparse.Namespace, config, own_process: bool) -> str:
    """After a stop or a failure: the command that resumes this run, pasted as it is into the
    same shell (the same program, config, --local and --set options, shell-quoted, plus
    `--resume latest`); or, when no backup was written, that there is nothing to resume and
    the command that starts the run again. Under a launcher of several processes (torchrun,
    accelerate launch) the command is the launcher's, with its options: the program alone
    would go on in one process, at a fraction of the effective batch."""
    from modules.frontend import list_backups
    from modules.train.recipe.distributed import launched_distributed, launcher_command
    output_dir = Path(config.output.dir)
    launcher = launcher_command(sys.argv[0]) if own_process and sys.argv else None
    words = [*(launcher or program_words(own_process)), "--config", str(args.config)]
    if args.local:
        words += ["--local", str(args.local)]
    for override in args.overrides:
        words += ["--set", override]
    unknown = ("\nnote: a launcher started this run's processes, and its command line could "
               "not be read: run the command above under it, with its options"
               if launched_distributed() and launcher is None else "")
    if list_backups(output_dir):
        return "resume with: " + shlex.join([*words, "--resume", "latest"]) + unknown
    if (output_dir / "run.json").exists() and not config.output.overwrite:
        # the folder now holds this run's record (no weights, no backup): a new start in it
        # needs overwrite, which removes nothing of value here
        words += ["--set", "output.overwrite=true"]
    return ("nothing to resume: no backup was written (the run ended before its first "
            "backup); start it again with: " + shlex.join(words) + unknown)


def program_words(own_process: bool) -> list[str]:
    """How this command was started, to print a command that starts it again: `tempera-train`
    when that is what the shell finds, `python scripts/train.py` as run, and tempera-train
    when main() was called inside another program (its sys.argv is not ours)."""
    started = Path(sys.argv[0]) if own_process and sys.argv and sys.argv[0] else None
    if started is None:
        return ["tempera-train"]
    if started.suffix == ".py":
        python = shutil.which("python")
        same = python is not None and Path(python).resolve() == Path(sys.executable).resolve()
        return ["python" if same else sys.executable, str(started)]
    found = shutil.which(started.name)
    same = found is not None and Path(found).resolve() == started.resolve()
    return [started.name if same else str(started)]


def resume_value(given: str) -> str:
    """`--resume`'s value for training.resume_from: "latest", or a folder made absolute
    against the current folder (the config field reads relative paths inside the output)."""
    return given if given == "latest" else str(Path(given).expanduser().resolve())


class StopSignal:
    """SIGINT (Ctrl+C) or SIGTERM: finish the step, write a backup and the final save, exit
    130 / 143. A second signal interrupts at once (KeyboardInterrupt), exiting by its own
    number the same way."""

    def __init__(self, commands, callbacks) -> None:
        self.commands, self.callbacks = commands, callbacks
        self.received = 0

    def exit_code(self) -> int:
        """The shell's convention, 128 + the signal's number (130 for a KeyboardInterrupt
        that came from no signal of ours)."""
        return 128 + (self.received or signal.SIGINT)

    def __call__(self, signum, frame) -> None:
        if self.commands.stop_requested:
            self.received = signum
            raise KeyboardInterrupt
        self.received = signum
        self.callbacks.on_status(f"{signal.Signals(signum).name}: finishing the step, writing a "
                                 "backup and saving (send it again to abort)")
        self.commands.request_stop()


if __name__ == "__main__":
    sys.exit(main())
