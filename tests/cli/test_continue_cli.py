"""Continue for N more steps, as a journey through `tempera-train` (its `main`, in this
process, stopped by a real SIGTERM sent from the run's own progress event, so nothing depends
on timing): finish at step 6 → raise training.max_steps to 10 → continue → stop at step 7 →
resume → finish at step 10. The continue trains exactly the added steps from the run's end,
the history (losses, validation passes, samples) stays whole at every stage, as the front
ends read it, and the losses and final weights are bit for bit those of one uninterrupted
10-step run."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from modules.cli import headless
from modules.cli.train import main
from modules.frontend import earlier_losses, earlier_validation, latest_samples, resume_offer
from tests.train.test_resume import final_tensors

STEPS, RAISED, STOP_AT = 6, 10, 7


def write_config(folder: Path, cache: Path, name: str, max_steps: int) -> Path:
    path = folder / f"{name}.config.json"
    path.write_text(json.dumps({
        "general": {"cache_dir": str(cache)},
        "data": {"resolution": 64},
        "training": {"max_steps": max_steps, "batch_size": 2, "learning_rate": 1e-3},
        # 12 of the 48 shapes scored every 4 steps, and at the end of a finished run
        "validation": {"split_ratio": 0.25, "every_steps": 4},
        "sampling": {"prompts": ["a red circle"], "steps": 1},  # at the end of a finished run
        "logging": {"tensorboard": False},
        # no scheduled backup: a continue can start only from the one at the run's end
        "output": {"dir": name, "backup_every_steps": 0, "backup_every_minutes": 0},
    }))
    return path


def run_json(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


def test_continue_trains_the_added_steps_from_the_end_and_the_history_stays_whole(
        tmp_path, tempera_cache, monkeypatch):
    """Four runs of the tiny model (10 + 6 + 1 + 3 steps, three of them validating and
    sampling at their end): about 40 s on 2 CPU cores; the issue's headline journey."""
    whole = tmp_path / "whole"
    assert main(["--config", str(write_config(tmp_path, tempera_cache, "whole", RAISED)),
                 "--quiet"]) == 0
    config = str(write_config(tmp_path, tempera_cache, "journey", STEPS))
    output = tmp_path / "journey"

    # finish at step 6: a backup at the end, so a continue has its exact state
    assert main(["--config", config, "--quiet"]) == 0
    assert not resume_offer(output, STEPS).can_resume
    offer = resume_offer(output, RAISED)
    assert offer.continues_finished and not offer.rewinds and offer.backup_step == STEPS
    assert offer.more_steps == offer.steps_to_train == RAISED - STEPS
    finished = run_json(output)

    # raise Max steps and continue; SIGTERM after step 7
    shown = headless.TerminalCallbacks.on_progress

    def stop_at(self, progress):
        shown(self, progress)
        if progress.step == STOP_AT:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(headless.TerminalCallbacks, "on_progress", stop_at)
    more = ["--set", f"training.max_steps={RAISED}", "--resume"]
    assert main(["--config", config, "--quiet", *more]) == 143
    monkeypatch.undo()
    stopped = run_json(output)
    assert stopped["resumed_at_step"] == STEPS and stopped["steps_done"] == STOP_AT
    assert stopped["losses"][:STEPS] == finished["losses"]  # steps 1-6 were not trained again
    assert stopped["segments"][-1]["status"] == "finished"
    # what the Run tab reads after the stop: the finished run is still there, whole
    offer = resume_offer(output, RAISED)
    assert offer.finished_step is None and offer.finished_before == STEPS
    assert offer.backup_step == STOP_AT and offer.can_resume
    assert offer.steps_to_train == RAISED - STOP_AT
    assert [p.step for p in earlier_losses(output, STOP_AT)] == list(range(1, STOP_AT + 1))
    assert [v.step for v in earlier_validation(output, STOP_AT)] == [4, STEPS]
    assert latest_samples(output, STOP_AT)[0] == STEPS

    # resume to the end
    assert main(["--config", config, "--quiet", *more]) == 0
    done, reference = run_json(output), run_json(whole)
    assert done["status"] == "finished" and done["steps_done"] == RAISED
    assert done["losses"] == reference["losses"]  # every step, exactly
    want, have = final_tensors(whole), final_tensors(output)
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)
    history = dict(map(tuple, done["validation"]["history"]))
    assert sorted(history) == [4, STEPS, 8, RAISED]  # step 6's pass, from the first finish
    assert {step: history[step] for step in (4, 8, RAISED)} == dict(
        map(tuple, reference["validation"]["history"]))
    assert [s["status"] for s in done["segments"]] == ["finished", "stopped"]
    samples = {p.name for p in (output / "samples").iterdir()}
    assert {f"step-{STEPS:06d}-0.png", f"step-{RAISED:06d}-0.png"} <= samples
