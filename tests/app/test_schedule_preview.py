"""The learning-rate curve under the LR scheduler field: the schedule training follows, redrawn
when its settings change."""
from __future__ import annotations

from modules.config.schema import LRScheduler, Optimizer
from tests.app.conftest import pump


def _curve_heights(app) -> list[float]:
    """The curve's y values, turned so that higher means a higher learning rate."""
    canvas = app.schedule_preview.canvas
    (item,) = canvas.find_withtag("curve")
    ys = canvas.coords(item)[1::2]
    return [-y for y in ys]


def _peaks(heights: list[float]) -> int:
    """How many times the curve jumps back up to the top."""
    top = max(heights)
    return sum(1 for a, b in zip(heights, heights[1:]) if b >= top - 1 and a < top - 10)


def test_the_curve_follows_the_schedule_and_its_settings(app):
    app.tabview.set("Training")
    binding = app.binding
    binding.set_value("training.max_steps", 200)
    binding.set_value("training.lr_scheduler", LRScheduler.COSINE_WITH_RESTARTS)
    binding.set_value("training.lr_cycles", 3)
    pump(app)
    restarts = _curve_heights(app)
    assert restarts[0] == max(restarts) and _peaks(restarts) == 2  # 3 cosines: 2 restarts
    assert "over 200 steps" in app.schedule_preview.caption.cget("text")
    binding.set_value("training.lr_scheduler", LRScheduler.LINEAR)
    pump(app)
    linear = _curve_heights(app)
    assert linear != restarts and linear == sorted(linear, reverse=True)  # only falls
    binding.set_text("training.lr_warmup_steps", "50")
    pump(app)
    warm = _curve_heights(app)
    top = warm.index(max(warm))
    assert 0 < top < len(warm) - 1 and warm[0] < warm[top]  # rises first, then falls
    binding.set_value("training.max_steps", 0)
    pump(app)
    assert "assumed" in app.schedule_preview.caption.cget("text")


def _drawn(app) -> tuple[set[str], str]:
    """The canvas's item tags, and the text of its message (if it shows one)."""
    canvas = app.schedule_preview.canvas
    tags = {tag for item in canvas.find_all() for tag in canvas.gettags(item)}
    message = canvas.find_withtag("message")
    return tags, canvas.itemcget(message[0], "text") if message else ""


def test_no_curve_is_drawn_for_an_ignored_rate_or_a_rejected_entry_only_why(app):
    """Adafactor's relative step ignores the learning rate, and "6o" is not applied (the
    config still holds the old rate): a curve would describe neither run."""
    binding = app.binding
    binding.set_value("training.max_steps", 200)
    pump(app)
    assert "curve" in _drawn(app)[0]
    binding.set_value("training.optimizer", Optimizer.ADAFACTOR_RELATIVE)
    pump(app)
    tags, message = _drawn(app)
    assert tags == {"message"} and message == ("No curve: Adafactor (relative step) sets its "
                                               "own step size")
    assert app.schedule_preview.caption.cget("text") == ""     # no "peak 1" either
    binding.set_value("training.optimizer", Optimizer.ADAMW)
    app.registry.find("training.learning_rate").var.set("6o")  # typed: rejected at the field
    pump(app)
    tags, message = _drawn(app)
    assert tags == {"message"}
    assert message == "No curve: “Training › Learning rate” is not a valid value"
    app.registry.find("training.learning_rate").var.set("6e-5")
    pump(app)
    assert "curve" in _drawn(app)[0] and "peak 6e-05" in app.schedule_preview.caption.cget("text")
