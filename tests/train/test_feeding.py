"""Feeding the step: how long training waited for batches (run.json), and data-loader workers
that start once per run yet give exactly the batches the main process would."""
from __future__ import annotations

import itertools
import json

from modules.data.feed import FeedMeter
from modules.data.shapes import write_shapes
from modules.train.trainer import train


class FakeClock:
    """A clock that moves only when the fake loader says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slow_items(clock: FakeClock, waits: list[float]):
    for i, wait in enumerate(waits):
        clock.now += wait
        yield i


def test_the_meter_counts_every_wait_but_the_loaders_start_up():
    clock = FakeClock()
    meter = FeedMeter(clock)
    items = list(meter.timed(slow_items(clock, [5.0, 0.5, 1.5, 0.0])))
    assert items == [0, 1, 2, 3]
    assert meter.first_wait == 5.0 and meter.batches == 3
    assert meter.wait_seconds == 2.0 and meter.longest_wait == 1.5
    report = meter.report(training_seconds=8.0, workers=0, pin_memory=False)
    assert report["share_of_training_time"] == 0.25
    assert report["first_batch_wait_seconds"] == 5.0 and report["batches_after_the_first"] == 3


def test_the_hint_names_the_fixes_only_when_waiting_matters():
    clock = FakeClock()
    meter = FeedMeter(clock)
    list(meter.timed(slow_items(clock, [1.0, 2.0, 2.0])))
    hint = meter.hint(training_seconds=10.0, workers=0, cached_latents=False)
    assert hint and "40 %" in hint and "data.workers" in hint and "cache_latents" in hint
    assert "data.workers" not in meter.hint(10.0, workers=4, cached_latents=False)
    assert meter.hint(training_seconds=100.0, workers=0, cached_latents=False) is None


def _small_folder(tmp_path):
    folder = tmp_path / "six"
    write_shapes(folder, 6, 64)
    return folder


def test_training_says_how_long_it_waited_for_data(tiny_config, tmp_path):
    folder = _small_folder(tmp_path)
    result = train(tiny_config(f'data.datasets=[{{"path": "{folder}"}}]', "training.max_steps=0",
                               "training.epochs=2"))
    fed = result.record["data_loading"]
    assert result.steps == 6
    assert fed["batches_after_the_first"] == 5  # 3 batches an epoch, the first one aside
    assert fed["workers"] == 0 and fed["pin_memory"] is False
    assert 0 <= fed["share_of_training_time"] < 1


def test_workers_start_once_per_run_and_train_what_the_main_process_trains(
        tiny_config, tmp_path, monkeypatch):
    import modules.train.state.run as run_module
    folder = _small_folder(tmp_path)
    built = itertools.count()
    real = run_module.epoch_dataloader

    def counting(*args, **kwargs):
        next(built)
        return real(*args, **kwargs)

    common = [f'data.datasets=[{{"path": "{folder}"}}]', "training.max_steps=0",
              "training.epochs=3", "data.random_flip=true"]
    main = train(tiny_config(*common, f"output.dir={tmp_path / 'main'}"))
    monkeypatch.setattr(run_module, "epoch_dataloader", counting)
    workers = train(tiny_config(*common, "data.workers=2", f"output.dir={tmp_path / 'w'}"))
    assert next(built) == 1, "the loader (and its workers) was built more than once"
    assert workers.record["data_loading"]["workers"] == 2
    losses = [json.loads((r.output_dir / "run.json").read_text())["losses"]
              for r in (main, workers)]
    assert len(losses[0]) == 9 and losses[1] == losses[0]
