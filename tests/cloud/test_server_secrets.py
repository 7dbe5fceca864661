"""Secrets refused on the GPU machine (pre-receive), the widened scanner, and masking."""
from __future__ import annotations

import json
import subprocess

import pytest

from modules.cloud.queue import INVALID, list_statuses
from modules.cloud.secrets import scan_text

from .conftest import git, sparse_config

HF = "hf_" + "aB3" * 12  # assembled so this file itself is not a finding
WANDB = "0123456789abcdef" * 2 + "01234567"  # 40 hex digits
KINDS = {  # (file name, text) -> the kind reported
    "netrc password": ("netrc", "machine api.wandb.ai login me password " + "s3cr" + "etpw"),
    "netrc login": (".netrc", "login someone"),
    "40-hex API key (WandB style)": ("wandb.env", "WANDB=" + WANDB),
    "private key": ("id_rsa", "-----BEGIN OPENSSH " + "PRIVATE KEY-----"),
    "Google API key": ("c.json", "AIza" + "B" * 35),
    "OpenAI-style API key": ("c.json", "sk-" + "a1" * 20),
    "Slack token": ("c.json", "xoxb-" + "1234567890-abc"),
    "GitLab token": ("c.json", "glpat-" + "x" * 20),
    "WandB API key": ("preset.json", '"wandb_project":"' + WANDB + '"'),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_found_with_its_value_masked(kind):
    name, text = KINDS[kind]
    findings = scan_text("first\n" + text, name, name)
    assert [f.kind for f in findings if f.kind == kind] == [kind]
    finding = next(f for f in findings if f.kind == kind)
    assert finding.line == 2 and "chars)" in str(finding)
    value = text.split()[-1].split("=")[-1]
    assert value not in str(finding)


def test_a_commit_sha_in_a_note_is_not_a_secret():
    note = f"Trained at commit {WANDB}, see runs/cats.json\n"
    assert scan_text(note, "notes.md", "notes.md") == []
    assert scan_text(note, "commit message of abc", "") == []
    assert scan_text(note, ".env", ".env") != []  # the same value in an .env file is refused


def push(repo, *args):
    return subprocess.run(["git", "push", *args, "origin", "main"], cwd=repo, capture_output=True,
                          text=True, timeout=60)


def test_server_refuses_a_secret_pushed_with_no_verify_and_nothing_trains(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    config = sparse_config(sampling={"prompts": []})
    config["hub"] = {"note": HF}
    (cloud.repo / "runs").mkdir(exist_ok=True)
    (cloud.repo / "runs" / "leak.json").write_text(json.dumps(config))
    git(cloud.repo, "add", "-A")
    git(cloud.repo, "commit", "-q", "-m", "leak")
    before = git(cloud.bare, "rev-parse", "main")
    proc = push(cloud.repo, "--no-verify")  # skips the laptop's pre-push hook
    assert proc.returncode != 0
    assert "runs/leak.json (commit " in proc.stderr
    assert ":1: looks like a Hugging Face token" in proc.stderr  # file, line, kind
    assert "Hugging Face token" in proc.stderr and HF not in proc.stderr
    assert "hf_…(39 chars)" in proc.stderr
    assert git(cloud.bare, "rev-parse", "main") == before
    assert list_statuses(cloud.work_root) == []


def test_server_refuses_a_secret_in_a_commit_message(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    (cloud.repo / "notes.txt").write_text("fine\n")
    git(cloud.repo, "add", "-A")
    git(cloud.repo, "commit", "-q", "-m", f"use token {HF}")
    proc = push(cloud.repo, "--no-verify")
    assert proc.returncode != 0 and "commit message of" in proc.stderr
    assert HF not in proc.stderr


def test_server_accepts_a_sha_in_a_note(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    (cloud.repo / "notes.txt").write_text(f"baseline: {WANDB}\n")
    git(cloud.repo, "add", "-A")
    git(cloud.repo, "commit", "-q", "-m", f"note {WANDB}")
    assert push(cloud.repo, "--no-verify").returncode == 0


def test_a_secret_in_the_machine_overrides_never_reaches_a_run(make_cloud, fake_train):
    cloud = make_cloud(fake_train, local={"general.device": "CPU", "x_token": "abcdef123456"})
    cloud.commit_and_push({"runs/a.json": sparse_config(sampling={"prompts": []})})
    (status,) = list_statuses(cloud.work_root)
    assert status.state == INVALID and "secret" in status.problems[0]
    assert "abcdef123456" not in json.dumps(status.problems)
    assert not (cloud.work_root / "outputs" / status.run_id).exists()
