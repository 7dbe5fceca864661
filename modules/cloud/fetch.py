"""`tempera-cloud fetch` and `cancel`: get a run's results back, stop a run, locally or over ssh.

Fetch copies parts of `<work-root>/outputs/<run-id>/` (`FETCH_PARTS`) into a local folder:
rsync over ssh when rsync is installed here (`--partial`: an interrupted copy continues where it
stopped when run again), scp otherwise (a rerun copies again), a plain copy for a local work
root (files already there with the same size and time are skipped). Cancel creates the run's
cancel marker: a queued run never starts, a running one stops with a save (--stop-file).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from modules.cloud.bundles import OUTPUT_BUNDLES
from modules.cloud.git import CloudError
from modules.cloud.queue import cancel_path
from modules.cloud.remote_status import _RUN_ID, Remote, _run_ssh

# What each --what copies: (the part, whether the run must have it).
FETCH_PARTS: dict[str, list[tuple[str, bool]]] = {
    "final": [("final", True), ("run.json", False), ("config.json", False),
              (OUTPUT_BUNDLES, False)],
    "samples": [("samples", True), ("run.json", False)],
    "bundle": [(OUTPUT_BUNDLES, True), ("run.json", False)],
    "all": [(".", True)],
}
# Why a part a fetch needs may be missing.
MISSING_WHY = {OUTPUT_BUNDLES: "it wrote no compile bundle (nothing compiled with inductor, "
                               "compile.bundles off), or it has not ended yet"}


def check_run_id(run_id: str) -> None:
    if not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise CloudError(f"{run_id!r} is not a run id")


def ssh_transport(remote: Remote) -> str:
    """The ssh command rsync's -e runs (BatchMode: fail instead of prompting)."""
    port = f" -p {int(remote.port)}" if remote.port else ""
    return f"ssh -o BatchMode=yes{port}"


def rsync_command(remote: Remote, run_id: str, part: str, dest: Path) -> list[str]:
    """rsync of one part; `/./` keeps the part's path under dest (`--relative`)."""
    source = f"{remote.host}:{shlex.quote(f'{remote.path}/outputs/{run_id}/./{part}')}"
    return ["rsync", "-a", "--partial", "--relative", "-e", ssh_transport(remote), source,
            f"{dest}/"]


def scp_command(remote: Remote, run_id: str, part: str, dest: Path) -> list[str]:
    port = ["-P", str(int(remote.port))] if remote.port else []
    target = dest if part == "." else dest / Path(part).parent
    source = f"{remote.path}/outputs/{run_id}/{part}"
    return ["scp", "-r", "-p", "-o", "BatchMode=yes", *port,
            f"{remote.host}:{shlex.quote(source)}", f"{target}/"]


def copy_tree_resumable(source: Path, dest: Path) -> int:
    """Copy a file or folder; files already at dest with the same size and mtime are skipped.

    Each file is written under a temporary name and renamed, so an interrupted copy never
    leaves a truncated file that a later run would skip. Returns the number of files copied.
    """
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    copied = 0
    for path in files:
        target = dest if path == source else dest / path.relative_to(source)
        stat = path.stat()
        if target.is_file() and target.stat().st_size == stat.st_size and \
                int(target.stat().st_mtime) == int(stat.st_mtime):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        shutil.copy2(path, partial)
        os.replace(partial, target)
        copied += 1
    return copied


def fetch_run(remote: Remote, run_id: str, what: str, dest: Path, use_rsync: bool | None = None
              ) -> list[str]:
    """Copy a run's `what` (final | samples | bundle | all) into dest; returns one line per part.

    A part the run must have but does not (no `final/` before the run finished) raises
    CloudError naming it; optional parts are reported as missing.
    """
    check_run_id(run_id)
    if what not in FETCH_PARTS:
        raise CloudError(f"--what {what!r}: expected one of {', '.join(FETCH_PARTS)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if use_rsync is None:
        use_rsync = shutil.which("rsync") is not None
    report = []
    for part, required in FETCH_PARTS[what]:
        if remote.host is None:
            source = Path(remote.path) / "outputs" / run_id / part
            ok = source.exists()
            if ok:
                count = copy_tree_resumable(source, dest / part if part != "." else dest)
                report.append(f"{part}: {count} file(s) copied to {dest}")
        else:
            build = rsync_command if use_rsync else scp_command
            proc = subprocess.run(build(remote, run_id, part, dest), capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL)
            ok = proc.returncode == 0
            report.append(f"{part}: copied with {'rsync' if use_rsync else 'scp'} to {dest}" if ok
                          else f"{part}: not copied: {proc.stderr.strip()[-300:]}")
        if not ok and required:
            raise CloudError(f"run {run_id} has no {part} at {remote.host or ''}"
                             f"{':' if remote.host else ''}{remote.path}/outputs/{run_id} "
                             f"({MISSING_WHY.get(part, 'not finished yet, or not this run id?')})"
                             "\n" + "\n".join(report))
        if not ok and remote.host is None:
            report.append(f"{part}: missing")
    return report


def cancel_run(remote: Remote, run_id: str) -> str:
    """Create the run's cancel marker; a queued run never starts, a running one stops and saves."""
    check_run_id(run_id)
    if remote.host is None:
        marker = cancel_path(Path(remote.path), run_id)
        if not marker.parent.is_dir():
            raise CloudError(f"no run {run_id} under {remote.path}/runs")
        marker.touch()
    else:
        folder = shlex.quote(f"{remote.path}/runs/{run_id}")
        _run_ssh(remote, f"test -d {folder} && touch {folder}/cancel")
    return (f"cancel requested for {run_id}: a queued run will not start, a running one stops "
            f"after its current step with a save (see `status`)")
