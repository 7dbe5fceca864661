"""`tempera-cloud` / `scripts/cloud.py`: push-to-train runs (docs/cloud.md).

Subcommands:
  init DIR                      make DIR a training repo (git, runs/, .gitignore, README, pre-push)
  install-hook --bare GIT_DIR   on the GPU machine: train configs pushed to that bare repository
  push-and-train CONFIG --repo  copy a config under runs/, check it, commit it, push it
  status --remote WHERE         run states and log tails (a local work root or [user@]host:path)
  run-changed --before --after  the same as the hook, in the foreground (GitHub Actions)
  check-secrets                 scan files, staged changes or a pre-push for secret-looking values
  work --work-root DIR          run the queue (started in the background by the hook)

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

    p = sub.add_parser("run-changed", help="queue and run the configs a push added or changed")
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--work-root", type=Path, required=True)
    p.add_argument("--local", type=Path)
    p.add_argument("--tempera")

    p = sub.add_parser("check-secrets", help="refuse secret-looking values")
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--staged", action="store_true", help="scan what is staged in --repo")
    p.add_argument("--pre-push", metavar="REMOTE",
                   help="pre-push hook mode: ref lines on stdin, scan what the push sends")
    p.add_argument("--repo", type=Path, default=Path("."))

    p = sub.add_parser("work", help="run queued runs one at a time (the hook starts this)")
    p.add_argument("--work-root", type=Path, required=True)
    p.add_argument("--wait-for-lock", action="store_true")
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
    return 0


def cmd_status(args) -> int:
    from modules.cloud.remote_status import format_table, parse_remote, read_log_tail, read_statuses
    remote = parse_remote(args.remote)
    if args.log:
        print(read_log_tail(remote, args.log, args.lines), end="")
        return 0
    statuses = read_statuses(remote)
    if args.json:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
    else:
        print(format_table(statuses))
    return 0


def cmd_run_changed(args) -> int:
    from modules.cloud.queue import FINISHED, process_queue, read_status
    from modules.cloud.runs import (CloudSettings, describe, parse_train_command,
                                    queue_changed_runs, repo_git_dir)
    settings = CloudSettings(work_root=args.work_root.resolve(),
                             local_overrides=args.local.resolve() if args.local else None,
                             train_command=parse_train_command(args.tempera))
    statuses = queue_changed_runs(repo_git_dir(args.repo), args.before, args.after, settings)
    for status in statuses:
        print(describe(status))
    if not statuses:
        print("tempera-cloud: no config under runs/ was added or changed; nothing to train")
    process_queue(settings.work_root, wait_for_lock=True)
    failed = 0
    for status in (read_status(settings.work_root, s.run_id) for s in statuses):
        print(f"tempera-cloud: {status.run_id}: {status.state} {status.error}".rstrip())
        failed += status.state != FINISHED
    return 1 if failed else 0


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
    from modules.cloud.queue import process_queue
    done = process_queue(args.work_root.resolve(), wait_for_lock=args.wait_for_lock)
    print(f"tempera-cloud worker: ran {len(done)} run(s): {', '.join(done) or '-'}")
    return 0


COMMANDS = {"init": cmd_init, "install-hook": cmd_install_hook,
            "push-and-train": cmd_push_and_train, "status": cmd_status,
            "run-changed": cmd_run_changed, "check-secrets": cmd_check_secrets, "work": cmd_work}


if __name__ == "__main__":
    sys.exit(main())
