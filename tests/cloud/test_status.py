"""`tempera-cloud status`: local work roots, and ssh remotes through a fake ssh on PATH."""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from modules.cloud.cli import main as cloud_main
from modules.cloud.git import CloudError
from modules.cloud.queue import RunStatus, write_status
from modules.cloud.remote_status import Remote, parse_remote, read_statuses, ssh_command

# Logs its argv, then runs the remote command with the local shell (the "remote" is this machine).
FAKE_SSH = """#!/bin/sh
printf '%s\\n' "$@" > "{log}"
for last; do :; done
exec sh -c "$last"
"""


@pytest.fixture
def work_root(tmp_path) -> Path:
    root = tmp_path / "work root"  # a space, to prove the remote path is quoted
    for i, state in enumerate(("finished", "invalid")):
        run_id = f"2025010{i}-000000-abcdef12-run{i}"
        write_status(root, RunStatus(run_id=run_id, state=state, commit="abcdef1234" * 4,
                                     config=f"runs/run{i}.json", output_dir=f"/o/{run_id}",
                                     log=str(root / "runs" / run_id / "log.txt"),
                                     queued_at=1000.0 + i,
                                     error="" if i == 0 else "runs/run1.json is invalid"))
        (root / "runs" / run_id / "log.txt").write_text("".join(f"line {n}\n" for n in range(100)))
    return root


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "ssh-argv.txt"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH.format(log=log))
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_parse_remote_tells_local_paths_from_ssh(tmp_path):
    assert parse_remote(str(tmp_path)) == Remote(str(tmp_path))
    assert parse_remote("gpu:/srv/work") == Remote("/srv/work", "gpu")
    assert parse_remote("me@gpu.example:/srv/work") == Remote("/srv/work", "me@gpu.example")
    assert parse_remote("ssh://me@gpu:2222/srv/work") == Remote("/srv/work", "me@gpu", 2222)


def test_ssh_command_is_batch_mode_with_port_and_refuses_option_hosts(fake_ssh):
    argv = ssh_command(Remote("/p", "me@gpu", 2222), "true")
    assert argv[1:] == ["-o", "BatchMode=yes", "-p", "2222", "me@gpu", "true"]
    with pytest.raises(CloudError):
        ssh_command(Remote("/p", "-oProxyCommand=evil"), "true")


def test_local_status_table_and_log_tail(work_root, capsys):
    assert cloud_main(["status", "--remote", str(work_root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["RUN", "STATE", "COMMIT"]
    assert "finished" in lines[1] and "invalid" in lines[2] and "is invalid" in lines[2]
    assert cloud_main(["status", "--remote", str(work_root), "--log",
                       "20250101-000000-abcdef12-run1", "--lines", "3"]) == 0
    assert capsys.readouterr().out == "line 97\nline 98\nline 99\n"


def test_status_over_ssh_reads_the_same_statuses(work_root, fake_ssh, capsys):
    remote = f"me@gpu:{work_root}"
    statuses = read_statuses(parse_remote(remote))
    assert [s.state for s in statuses] == ["finished", "invalid"]
    argv = fake_ssh.read_text().splitlines()
    assert argv[:3] == ["-o", "BatchMode=yes", "me@gpu"]
    assert argv[3].startswith(f"cd -- {shlex.quote(str(work_root))} && ")
    assert cloud_main(["status", "--remote", remote, "--json"]) == 0
    assert [s["run_id"] for s in json.loads(capsys.readouterr().out)] == [s.run_id for s in statuses]
    assert cloud_main(["status", "--remote", remote, "--log", statuses[0].run_id,
                       "--lines", "2"]) == 0
    assert capsys.readouterr().out == "line 98\nline 99\n"
    assert fake_ssh.read_text().splitlines()[-1].startswith("tail -n 2 -- ")


def test_status_over_ssh_reports_a_missing_work_root_and_bad_run_ids(tmp_path, fake_ssh, capsys):
    assert cloud_main(["status", "--remote", f"gpu:{tmp_path / 'nope'}"]) == 1
    assert "ssh gpu failed" in capsys.readouterr().err
    assert cloud_main(["status", "--remote", f"gpu:{tmp_path}", "--log", "../../etc"]) == 1
    assert "not a run id" in capsys.readouterr().err
