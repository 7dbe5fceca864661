"""What a run warns about when it starts and records in run.json's `warnings` (issue 44): the
config's caveats and, for a run counted in epochs, a warm-up longer than the run."""
from __future__ import annotations

import json

from modules.config import Config, apply_overrides
from modules.events import RecordingCallbacks
from modules.train.outputs.record import RunRecord
from modules.train.setup.start import record_warnings, warmup_warning


def test_a_warmup_longer_than_a_run_counted_in_epochs_is_warned_with_where_the_rate_ends():
    config = apply_overrides(Config(), ["training.lr_warmup_steps=600"])  # max_steps 0: epochs
    warning = warmup_warning(config, 24)
    assert warning.startswith("training.lr_warmup_steps is 600, longer than the run's 24 steps")
    assert "at 4% of training.learning_rate" in warning
    assert warmup_warning(config, 600) is None
    relative = apply_overrides(Config(), ["training.lr_warmup_steps=600",
                                          "training.optimizer=ADAFACTOR_RELATIVE"])
    assert warmup_warning(relative, 24) is None  # no rate is used, so no warm-up either


def test_the_warnings_are_said_and_recorded_in_run_json(tmp_path):
    config = apply_overrides(Config(), ["training.lr_warmup_steps=600",
                                        "training.method=FINE_TUNE", "training.adapter=LOHA",
                                        "output.formats=diffusers"])
    record, callbacks = RunRecord(tmp_path / "run.json"), RecordingCallbacks()
    record_warnings(record, config, 24, callbacks)
    warnings = json.loads((tmp_path / "run.json").read_text())["warnings"]
    assert len(warnings) == 2 and warnings[0].startswith("training.adapter is LOHA")
    assert warnings[1].startswith("training.lr_warmup_steps is 600")
    # the config's caveats were said by check_run already; the run's length adds this one
    assert callbacks.statuses == [f"warning: {warnings[1]}"]
