"""Issue 44 items 5 and 6: what the window says is named as the window names things (labels, not
config names) and stops being shown once it is no longer true. Real pointer and keyboard input
(xdotool); the trainer and the benchmark are the tests' own, so no model is built."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace


from modules.events import CompileEvent, Progress
from tests.app import xdo
from tests.app.conftest import REPO, pump, shown


def progress(step: int, total: int = 4) -> Progress:
    return Progress(step=step, max_steps=total, epoch=1, max_epochs=1, loss=0.5, smoothed_loss=0.5,
                    lr=1e-4, seconds_per_step=2.0, eta_seconds=2.0 * (total - step))


def tab(app, name: str):
    return app.tabview._segmented_button._buttons_dict[name]


def test_a_stopped_run_says_what_is_true_in_the_windows_words(make_app, tmp_path, real_input):
    """The log and status line name settings by their labels, the compile line has one pair
    of brackets, the status line follows the step bar, and once stopped the step line has no
    ETA; loading another preset clears the run and the title names the preset's family."""
    app = make_app(initial_preset=REPO / "training_presets" / "demo.json")
    output = tmp_path / "out"
    app.registry.find("output.dir").var.set(str(output))
    at_step = threading.Event()

    def train(config, callbacks, commands):
        callbacks.on_status(f"output.overwrite is not applied: resuming continues the run in "
                            f"{output}")
        callbacks.on_progress(progress(1))
        callbacks.on_status("sampling at step 1")
        callbacks.on_compile(CompileEvent("unet", "UNet compiled in 247.3 s (7 graphs)",
                                          seconds=247.3, kind="done"))
        callbacks.on_progress(progress(2))
        at_step.set()
        while not commands.stop_requested:
            time.sleep(0.02)
        callbacks.on_status(f"stopped: 2 steps, outputs in {output}; resume with --resume "
                            f"latest (newest backup: step 2, {output / 'backups'})")
        return SimpleNamespace(status="stopped", steps=2, output_dir=output)

    app.runs.train_fn = train
    shown(app)
    panel = app.run_panel
    xdo.click(app, panel.buttons["start"])
    pump(app, at_step.is_set)
    pump(app, lambda: panel.step_label.cget("text").startswith("2/4"))
    assert "ETA 0:04" in panel.step_label.cget("text"), panel.log_text()
    assert panel.status_text == "Training…"           # "sampling at step 1" is over
    log = panel.log_text()
    assert "“Overwrite previous run” is not applied" in log and "output.overwrite" not in log
    assert "compile: UNet compiled in 247.3 s (7 graphs)\n" in log   # no "(247.3 s)" after it
    xdo.click(app, panel.buttons["stop"])
    pump(app, lambda: app.runs.worker is None)
    assert panel.step_label.cget("text") == "2/4 · stopped · loss 0.5000"  # no rate, no ETA
    log = panel.log_text()
    assert "Resume continues it (newest backup: step 2" in log and "--resume" not in log

    app.presets_bar.menu._dropdown_callback("sdxl / lora")    # chosen, then Load clicked
    xdo.click(app, app.presets_bar.buttons["Load"])
    assert app.presets_bar.current.name == "lora.json"
    assert app.title() == "Tempera — sdxl / lora"             # not "lora.json": which family?
    assert panel.step_label.cget("text") == "" and panel.step_bar.get() == 0
    assert panel.plot.steps == [] and panel.sample_paths == []


def test_ready_is_not_said_while_a_problem_is_listed(app, real_input):
    shown(app)
    app.registry.find("training.batch_size").var.set("four")
    xdo.click(app, app.run_panel.buttons["start"])
    assert app.problems_panel.is_open and app.run_panel.status_error
    xdo.click(app, tab(app, "Training"))
    rate = app.registry.find("training.learning_rate")
    assert xdo.scroll_into_view(app, app.scroll_frames["Training"], rate.frame)
    xdo.click(app, rate.entry)                       # an edit that fixes nothing
    xdo.clear_and_type(app, "0.0002")
    assert app.binding.config.training.learning_rate == 0.0002
    status = app.run_panel.status_text
    assert status != "Ready." and status.startswith("1 problem(s) listed below the tabs")


def test_a_tooltip_names_adapters_by_their_labels(app, real_input):
    shown(app)
    xdo.click(app, tab(app, "Training"))
    view = app.registry.find("training.conv_rank")   # greyed under LoRA, saying who has it
    assert xdo.scroll_into_view(app, app.scroll_frames["Training"], view.frame)
    xdo.move_to(*xdo.centre(view.label))
    tip = view.tooltips[0]
    pump(app, lambda: tip.window is not None, timeout=5)
    shown_text = tip.window.winfo_children()[0].cget("text")
    assert "LoCon (LoRA + convolutions) / LoHa / LoKr / DoRA do" in shown_text
    assert "LOHA" not in shown_text and "LOCON" not in shown_text
    xdo.move_to(0, 0)


def test_a_stopped_benchmark_offers_no_fastest_and_says_why_inside_the_window(app,
                                                                               real_input):
    from modules.bench.runner import BenchmarkResult, BenchProgress
    from modules.config.schema import CompileBackend
    release = threading.Event()

    def bench(config, *, backends, progress, should_stop, **kwargs):
        progress(BenchProgress(1, 2, "NONE", "cold", "eager: warm-up"))
        release.wait(30)
        cells = [{"id": "a", "label": "NONE", "backend": "NONE", "components": "-",
                  "scope": "-", "dynamic": "-", "status": "ok", "median_step_seconds": 0.5,
                  "timed_steps": [0.5] * 4, "speedup": 1.0},
                 {"id": "b", "label": "TRITON unet", "backend": "TRITON", "components": "unet",
                  "scope": "FULL", "dynamic": "AUTO", "status": "skipped",
                  "error": "benchmark stopped"}]
        return BenchmarkResult({}, {"warmup": 3}, cells)

    app.benchmark.bench_fn = bench
    app.binding.set_value("compile.backend", CompileBackend.TRITON)
    shown(app)
    xdo.click(app, tab(app, "Advanced Options"))
    section = app.benchmark
    assert xdo.scroll_into_view(app, app.scroll_frames["Advanced Options"], section.button)
    xdo.click(app, section.button)
    assert section.text().startswith("Benchmarking None (eager), Triton + CUDA graphs on")
    pump(app, lambda: "[1/2] None (eager): eager: warm-up" in section.status.cget("text"))
    release.set()
    pump(app, lambda: section.result is not None and not section.running, timeout=20)
    xdo.settle(app, 0.5)
    assert section.apply_button.cget("state") == "disabled"
    assert section.apply_tip.text.startswith("Not now: not every cell finished")
    status = section.status._label                  # wrapped inside the window, all of it
    assert "not every cell finished" in status.cget("text")
    assert status.winfo_rootx() + status.winfo_reqwidth() <= app.winfo_rootx() + app.winfo_width()
    assert status.winfo_height() >= status.winfo_reqheight()
    assert "TRITON = Triton + CUDA graphs" in section.text()


def test_engine_text_is_named_as_the_window_names_things_and_paths_are_left_alone():
    from app.readable import readable
    from modules.config.schema import DynamicShapes
    assert readable("raise training.max_steps above 60; data.datasets[1].path: no such "
                    "folder; validation.every_steps is 0") == (
        "raise “Max steps” above 60; “Datasets › row 2 › Folder”: no such folder; "
        "“Validate every N steps” is 0")
    assert readable("LOCON (LoRA on more layers) and ADAFACTOR (fixed learning rate), not "
                    "NONE") == ("LoCon (LoRA + convolutions; LoRA on more layers) and "
                                "Adafactor (fixed learning rate), not None (eager)")
    assert readable("AUTO (recommended)", DynamicShapes) == "Automatic (recommended)"
    assert readable("AUTO") == "AUTO"               # three enums, three labels: left as it is
    kept = "/data/SDXL/x.png, LORA.json, config.json, torch.compile, a CUDA GPU, min SNR, e.g."
    assert readable(kept) == kept
    assert readable("stopped; resume with --resume latest (newest backup: step 2)") == (
        "stopped; Resume continues it (newest backup: step 2)")
