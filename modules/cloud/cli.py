"""`tempera-cloud` / `scripts/cloud.py`: push-to-train runs (docs/cloud.md).

Subcommands:
  init DIR                      make DIR a training repo (git, runs/, .gitignore, README, pre-push)
  install-hook --bare GIT_DIR   on the GPU machine: train configs pushed to that bare repository
  push-and-train CONFIG --repo  copy a config under runs/, check it, commit it, push it
  status --remote WHERE         run states, step/loss/ETA, log tails; --follow to keep watching
  fetch RUN --remote WHERE      copy a run's final weights, samples, compile bundle or all back
  add-bundle FILE --repo        commit a compile bundle into the training repo's bundles/
  cancel RUN --remote WHERE     a queued run never starts; a running one stops with a save
  run-changed --after SHA       the same as the hook, in the foreground (GitHub Actions)
  check-secrets                 scan files, staged changes or a pre-push for secret-looking values
  work --work-root DIR          run the queue (started by the hook; --daemon: keep running)

Exit codes: 0 done; 1 a command failed, a check refused (secrets, an invalid config) or a run
failed; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from modules.cloud.git import CloudError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tempera-cloud", description=__doc__.split("\n")[0],
                                     epilog="See docs/cloud.md for the whole recipe.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="make a folder a training repository")
    p.add_argument("dir", type=Path)

    p = sub.add_parser("install-hook", help="install the pre-receive (secrets) and post-receive (train) hooks into a bare repository")
    p.add_argument("--bare", type=Path, required=True, help="the bare repository users push to")
    p.add_argument("--work-root", type=Path, required=True,
                   help="where checkouts, run statuses, logs and outputs go on this machine")
    p.add_argument("--branch", default="main", help="the branch whose pushes train (main)")
    p.add_argument("--local", type=Path, help="this machine's local overrides JSON file")
    p.add_argument("--tempera", help="the train command (default: this Python -m "
                                     "modules.cli.train), e.g. /opt/tempera/.venv/bin/tempera-train")
    p.add_argument("--force", action="store_true", help="replace pre-/post-receive hooks not ours")

    p = sub.add_parser("push-and-train", help="commit a config under runs/ and push it")
    p.add_argument("config", type=Path)
    p.add_argument("--repo", type=Path, default=Path("."), help="the training repository (.)")
    p.add_argument("--remote", default="origin")
    p.add_argument("--branch", default="main")

    p = sub.add_parser("status", help="show runs and log tails")
    p.add_argument("--remote", required=True,
                   help="a work root: local path, [user@]host:/path or ssh://[user@]host[:port]/path")
    p.add_argument("--log", metavar="RUN_ID", help="print the end of this run's log")
    p.add_argument("--lines", type=int, default=40)
    p.add_argument("--json", action="store_true", help="statuses as JSON")
    p.add_argument("--follow", action="store_true",
                   help="keep showing: the table (or --log's lines) every --every seconds until "
                        "no run is queued or running (Ctrl+C ends it)")
    p.add_argument("--every", type=float, default=10.0, help="--follow's interval (10 s)")

    p = sub.add_parser("fetch", help="copy a run's results back (rsync over ssh, else scp)")
    p.add_argument("run_id", metavar="RUN")
    p.add_argument("--remote", required=True, help="the work root, as for status")
    p.add_argument("--what", choices=["final", "samples", "bundle", "all"], default="final",
                   help="final: final/ + run.json + config.json + the compile bundle the run "
                        "wrote (default); samples; bundle: only that bundle (+ run.json); all")
    p.add_argument("--to", type=Path, help="destination folder (default ./outputs/RUN)")
    p.add_argument("--add-to-repo", type=Path, metavar="REPO",
                   help="also put the fetched compile bundle into this training repository's "
                        "bundles/ and commit it (as add-bundle does)")

    p = sub.add_parser("add-bundle", help="commit a compile bundle into a training repository's "
                                          "bundles/, so the next push carries it")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="a .tcb file")
    p.add_argument("--repo", type=Path, default=Path("."), help="the training repository (.)")
    p.add_argument("--no-commit", action="store_true", help="copy it, do not commit it")

    p = sub.add_parser("cancel", help="cancel a queued or running run")
    p.add_argument("run_id", metavar="RUN")
    p.add_argument("--remote", required=True, help="the work root, as for status")

    p = sub.add_parser("run-changed", help="queue and run the configs a push added or changed")
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--before", help="the push's before; used only while this runner has no "
                                    "record of what it trained for --record-key")
    p.add_argument("--after", required=True)
    p.add_argument("--work-root", type=Path, required=True)
    p.add_argument("--local", type=Path)
    p.add_argument("--tempera")
    p.add_argument("--record-key", default="default",
                   help="whose configs: the repository (e.g. ${{ github.repository }})")
    p.add_argument("--copy-logs", type=Path, metavar="DIR",
                   help="copy each run's log here (for an Actions artifact)")

    p = sub.add_parser("check-secrets", help="refuse secret-looking values")
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--staged", action="store_true", help="scan what is staged in --repo")
    p.add_argument("--pre-push", metavar="REMOTE",
                   help="pre-push hook mode: ref lines on stdin, scan what the push sends")
    p.add_argument("--repo", type=Path, default=Path("."))

    p = sub.add_parser("work", help="run queued runs one at a time (the hook starts this)")
    p.add_argument("--work-root", type=Path, required=True)
    p.add_argument("--wait-for-lock", action="store_true")
    p.add_argument("--daemon", action="store_true",
                   help="keep running: start queued (and interrupted) runs as they appear, also "
                        "after a reboot without a push (docs/cloud.md: systemd user unit)")
    p.add_argument("--poll", type=float, default=30.0, help="--daemon's interval (30 s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CloudError as exc:
        print(f"tempera-cloud: error: {exc}", file=sys.stderr)
        return 1


def cmd_init(args) -> int:
    from modules.cloud.repo import init_training_repo
    for line in init_training_repo(args.dir):
        print(line)
    print(f"next: git -C {args.dir} remote add origin <gpu-box>:<bare repo>, then "
          f"tempera-cloud push-and-train CONFIG --repo {args.dir}")
    return 0


def cmd_install_hook(args) -> int:
    from modules.cloud.hook import install_hook
    from modules.cloud.runs import CloudSettings, parse_train_command
    settings = CloudSettings(work_root=args.work_root, branch=args.branch,
                             local_overrides=args.local.resolve() if args.local else None,
                             train_command=parse_train_command(args.tempera))
    hook = install_hook(args.bare, settings, force=args.force)
    print(f"installed {hook}; pushes to {args.branch} train under {settings.work_root}")
    return 0


def cmd_push_and_train(args) -> int:
    from modules.cloud.repo import push_and_train
    result = push_and_train(args.config, args.repo, args.remote, args.branch)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(result.push_output.rstrip())
    print(f"pushed {result.config} in commit {result.commit[:10]} to {args.remote}/{args.branch}")
    if result.remote_invalid:
        print(f"tempera-cloud: error: the GPU machine found {', '.join(result.remote_invalid)} "
              "INVALID and started nothing (problems above); fix the config and push again",
              file=sys.stderr)
        return 1
    return 0


def cmd_status(args) -> int:
    import time

    from modules.cloud.remote_status import format_table, parse_remote, read_log_tail, read_views
    remote = parse_remote(args.remote)
    while True:
        if args.log:
            print(read_log_tail(remote, args.log, args.lines), end="")
            if not args.follow:
                return 0
            views = [v for v in read_views(remote) if v.status.run_id == args.log]
        else:
            views = read_views(remote)
            if args.json:
                print(json.dumps([{**asdict(v.status), "observed_state": v.state,
                                   "progress": v.progress} for v in views], indent=2))
            else:
                print(format_table(views))
        if not args.follow or not any(v.state in ("queued", "running") for v in views):
            return 0
        time.sleep(args.every)
        print(flush=True)


def cmd_fetch(args) -> int:
    from modules.cloud.fetch import fetch_run
    from modules.cloud.remote_status import parse_remote
    from modules.cloud.bundles import OUTPUT_BUNDLES, add_bundle
    from modules.compile.bundle import candidate_files
    dest = args.to or Path("outputs") / args.run_id
    for line in fetch_run(parse_remote(args.remote), args.run_id, args.what, dest):
        print(line)
    for bundle in candidate_files([dest / OUTPUT_BUNDLES]):
        if args.add_to_repo:
            for line in add_bundle(bundle, args.add_to_repo):
                print(line)
        else:
            print(f"compile bundle {bundle}: to start the next runs on this GPU warm, "
                  f"tempera-cloud add-bundle {bundle} --repo <training repo>")
    return 0


def cmd_add_bundle(args) -> int:
    from modules.cloud.bundles import add_bundle
    for file in args.files:
        for line in add_bundle(file, args.repo, commit=not args.no_commit):
            print(line)
    return 0


def cmd_cancel(args) -> int:
    from modules.cloud.fetch import cancel_run
    from modules.cloud.remote_status import parse_remote
    print(cancel_run(parse_remote(args.remote), args.run_id))
    return 0


def cmd_run_changed(args) -> int:
    from modules.cloud.actions import run_changed
    from modules.cloud.runs import CloudSettings, parse_train_command
    settings = CloudSettings(work_root=args.work_root.resolve(),
                             local_overrides=args.local.resolve() if args.local else None,
                             train_command=parse_train_command(args.tempera))
    return run_changed(args.repo, args.before, args.after, settings, args.record_key,
                       args.copy_logs)


def cmd_check_secrets(args) -> int:
    from modules.cloud.secrets import format_findings, scan_files, scan_pre_push, scan_staged
    findings = scan_files(args.files)
    if args.staged:
        findings += scan_staged(args.repo)
    if args.pre_push:
        findings += scan_pre_push(args.repo, args.pre_push, sys.stdin.read().splitlines())
    if findings:
        print(format_findings(findings), file=sys.stderr)
        return 1
    return 0


def cmd_work(args) -> int:
    import time

    from modules.cloud.queue import process_queue
    while True:
        done = process_queue(args.work_root.resolve(), wait_for_lock=args.wait_for_lock)
        if done or not args.daemon:
            print(f"tempera-cloud worker: ran {len(done)} run(s): {', '.join(done) or '-'}",
                  flush=True)
        if not args.daemon:
            return 0
        time.sleep(args.poll)


COMMANDS = {"init": cmd_init, "install-hook": cmd_install_hook,
            "push-and-train": cmd_push_and_train, "status": cmd_status, "fetch": cmd_fetch,
            "cancel": cmd_cancel, "add-bundle": cmd_add_bundle,
            "run-changed": cmd_run_changed, "check-secrets": cmd_check_secrets, "work": cmd_work}


if __name__ == "__main__":
    sys.exit(main())
