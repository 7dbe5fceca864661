"""The secrets scan: what it flags, what it leaves alone, and that it never echoes a secret."""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.cloud.run_meta import add_run_meta, parse_run_meta
from modules.cloud.secrets import scan_text
from modules.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
HF = "hf_" + "aB3" * 12  # assembled so this file itself is not a finding

SECRETS = {
    "hf token in any text": f"upload with {HF} please",
    "hub token key": '{"hub_token": "abc123def"}',
    "password key": "password=hunter2",
    "yaml api key": "api_key: sk-live-123",
    "private key": "-----BEGIN OPENSSH PRIVATE KEY-----",
    "rsa key": "-----BEGIN RSA PRIVATE KEY-----",
    "aws key id": "AKIA" + "ABCDEFGHIJKLMNOP",
    "aws secret": "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG",
}
NOT_SECRETS = {
    "tokenizer path": '{"tokenizer": "models/tok"}',
    "empty token": '{"hub_token": ""}',
    "null token": '{"hub_token": null}',
    "env reference": '{"hub_token": "$HF_TOKEN"}',
    "env prefix": "token: env:HF_TOKEN",
    "placeholder": "password: <your password>",
    "number": '{"max_token": 77}',
    "prose": "the tokens are passed to the text encoder",
}


@pytest.mark.parametrize("name", SECRETS)
def test_secret_looking_values_are_found(name):
    findings = scan_text("line one\n" + SECRETS[name], "f.json")
    assert findings and findings[0].line == 2 and findings[0].where == "f.json"


@pytest.mark.parametrize("name", NOT_SECRETS)
def test_references_and_ordinary_keys_are_not_findings(name):
    assert scan_text(NOT_SECRETS[name], "f.json") == []


def test_a_finding_never_repeats_the_secret():
    text = "\n".join(SECRETS.values())
    shown = "\n".join(str(f) for f in scan_text(text, "f"))
    for secret in (HF, "hunter2", "abc123def", "wJalrXUtnFEMI", "AKIAABCDEFGHIJKLMNOP"):
        assert secret not in shown


def test_presets_templates_and_docs_are_clean():
    files = [*REPO.glob("training_presets/**/*.json"), *REPO.glob("templates/cloud/*"),
             REPO / "docs" / "cloud.md"]
    assert len(files) >= 5
    for path in files:
        assert scan_text(path.read_text(), str(path)) == [], path


def test_run_meta_refuses_secrets_and_lands_in_run_json(tmp_path):
    with pytest.raises(ConfigError, match="secret"):
        parse_run_meta([f"token={HF}"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_run_meta(["no-equals-sign"])
    record = tmp_path / "run.json"
    record.write_text('{"status": "finished", "meta": {"a": "1"}}')
    add_run_meta(record, parse_run_meta(["commit=abc123", "config=runs/x.json"]))
    assert record.read_text().count('"commit": "abc123"') == 1
    assert '"a": "1"' in record.read_text() and '"status": "finished"' in record.read_text()
