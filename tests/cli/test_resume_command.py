"""The resume command `tempera-train` prints after a stop, run as printed in a shell; a finished
run refused by `--resume` (exit 2) until training.max_steps is raised; a stop before the first
step saying there is nothing to resume; under torchrun, the command keeps the launcher. Real
processes, real signals."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from modules.cli.train import main
from modules.train.recipe.distributed import launcher_words
from modules.train.state.backup_files import backups_folder, list_backups
from modules.train.state.resume_offer import saved_step
from tests.child_env import with_repo_on_pythonpath
from tests.cli.test_resume_cli import record, wait_for
from tests.cli.run_settings import backed_up_run

REPO = Path(__file__).resolve().parents[2]
STEPS = 8  # given with --set: the config file says 40


def write_run_files(folder: Path, cache: Path) -> tuple[Path, Path]:
    """A config in a folder whose name needs shell quoting, with output.overwrite on (as the
    demo preset ships), and a --local file whose seed must reach the resume (the seed changes
    the math: a resume without it is refused)."""
    runs = folder / "my runs"
    runs.mkdir()
    config = runs / "it's.json"
    config.write_text(json.dumps(backed_up_run(cache, "out", 40, overwrite=True)))
    local = runs / "local.json"
    local.write_text(json.dumps({"training.seed": 7}))
    return config, local


def start(cwd: Path, *args: str, quiet: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), *args,
                             *(["--quiet"] if quiet else [])], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=with_repo_on_pythonpath())


def in_shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` pasted into a shell in `cwd`."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True,
                          env=with_repo_on_pythonpath(), timeout=600)


def printed_command(stderr: str, lead: str) -> str:
    """The command on the last stderr line that starts with `lead` ("... with: COMMAND")."""
    lines = [line for line in stderr.splitlines() if line.startswith(lead)]
    assert lines, stderr
    return lines[-1].split(" with: ", 1)[1]


def test_the_printed_resume_command_resumes_and_a_finished_run_is_refused(tmp_path,
                                                                          tempera_cache,
                                                                          monkeypatch):
    config, local = write_run_files(tmp_path, tempera_cache)
    output = config.parent / "out"
    relative = str(config.relative_to(tmp_path))
    proc = start(tmp_path, "--config", relative, "--local", str(local.relative_to(tmp_path)),
                 "--set", f"training.max_steps={STEPS}")
    assert wait_for(lambda: list_backups(output)), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err
    command = printed_command(err, "resume with: ")
    words = shlex.split(command)
    assert words[-2:] == ["--resume", "latest"] and relative in words
    assert "--local" in words and f"training.max_steps={STEPS}" in words

    resumed = in_shell(command, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    finished = record(output)
    assert finished["status"] == "finished" and finished["resume_count"] == 1
    assert finished["steps_done"] == STEPS and saved_step(output / "final") == STEPS
    assert finished["overwrite"].startswith("not applied")

    # the same command again: the run finished, nothing is resumed or rewritten (exit 2)
    final_files = {p: p.read_bytes() for p in (output / "final").iterdir()}
    again = in_shell(command, tmp_path)
    assert again.returncode == 2, again.stderr
    assert f"finished at step {STEPS}" in again.stderr
    assert f"raise training.max_steps above {STEPS}" in again.stderr
    assert {p: p.read_bytes() for p in (output / "final").iterdir()} == final_files
    assert record(output)["steps_done"] == STEPS

    # a raised step budget continues it from its end (its backup at STEPS) to the new maximum
    # (the same command's words, by the command's own main in this process: one child less)
    assert Path(words[1]).name == "train.py", words
    monkeypatch.chdir(tmp_path)
    assert main([*words[2:], "--set", f"training.max_steps={STEPS + 2}"]) == 0
    assert record(output)["steps_done"] == STEPS + 2
    assert record(output)["resumed_at_step"] == STEPS
    assert saved_step(output / "final") == STEPS + 2


def test_a_stop_before_the_first_step_has_nothing_to_resume(tmp_path, tempera_cache,
                                                           monkeypatch):
    config, local = write_run_files(tmp_path, tempera_cache)
    output = config.parent / "out"
    proc = start(tmp_path, "--config", str(config), "--set", "output.overwrite=false",
                 "--set", "training.max_steps=3", quiet=False)
    seen: list[str] = []
    for line in proc.stderr:  # the signal handler is in place once training reports
        seen.append(line)
        if "scanning datasets" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=240)
    err = "".join(seen) + rest
    assert proc.returncode == 143, err
    assert "resume with" not in err and "nothing to resume" in err
    assert not (output / "final").exists() and not list_backups(output)
    assert record(output)["status"] == "stopped"

    # the printed start command trains the run (its words, by the command's own main in this
    # process: the shell and the program's words are the resume command's test above)
    words = shlex.split(printed_command(err, "nothing to resume"))
    assert Path(words[1]).name == "train.py" and "--resume" not in words, words
    monkeypatch.chdir(tmp_path)
    assert main(words[2:]) == 0
    assert record(output)["status"] == "finished" and saved_step(output / "final") == 3


# resume_advice as main() calls it after a stop, in each process torchrun starts (no training:
# the advice reads the launcher's command line and the output folder's backups)
ADVICE = """import sys
sys.path.insert(0, {repo!r})
from modules.cli.train import parse_args, resume_advice
from modules.config import load_config
args = parse_args(sys.argv[1:])
print(resume_advice(args, load_config(args.config), own_process=True))
"""


def test_under_torchrun_the_printed_command_keeps_the_launcher_and_its_options(tmp_path,
                                                                              tempera_cache):
    """Pasted without torchrun, the command would resume in one process at half the
    effective batch."""
    config, _ = write_run_files(tmp_path, tempera_cache)
    backup = backups_folder(config.parent / "out") / "step-000002"
    backup.mkdir(parents=True)
    for name in ("backup.json", "tensors.safetensors"):  # what list_backups looks for
        (backup / name).write_text("{}")
    script = tmp_path / "advice.py"
    script.write_text(ADVICE.format(repo=str(REPO)))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch"
    done = subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", "29541", "advice.py",
         "--config", str(config.relative_to(tmp_path)), "--set", "training.max_steps=9"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**with_repo_on_pythonpath(), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("resume with: ")]
    assert len(lines) == 2, done.stdout  # each process prints it
    words = shlex.split(printed_command(lines[0], "resume with: "))
    assert Path(words[0]).name == "torchrun" and Path(words[0]).resolve() == Path(
        torchrun).resolve()
    assert words[1:] == ["--nproc_per_node", "2", "--master_port", "29541", "advice.py",
                         "--config", "my runs/it's.json", "--set", "training.max_steps=9",
                         "--resume", "latest"]


def test_a_launcher_run_by_its_interpreter_is_written_as_the_shell_finds_it(tmp_path,
                                                                            monkeypatch):
    """/proc gives a console script as `python /path/torchrun ...` (the #! line's work)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "torchrun"
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o755)
    parent = ["/usr/bin/python3", str(launcher), "--nproc-per-node=4", "scripts/train.py",
              "--config", "a.json"]
    monkeypatch.setenv("PATH", os.pathsep.join(["/nonexistent", str(tmp_path)]))
    assert launcher_words(parent, "scripts/train.py") == [str(launcher), "--nproc-per-node=4",
                                                          "scripts/train.py"]
    monkeypatch.setenv("PATH", str(bin_dir))
    assert launcher_words(parent, "/abs/scripts/train.py") == ["torchrun", "--nproc-per-node=4",
                                                               "scripts/train.py"]
    # `python -m torch.distributed.run`, and a program the launcher was not given
    module = ["/nowhere/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2",
              "train.py"]
    assert launcher_words(module, "train.py") == module
    assert launcher_words(parent, "other.py") is None
