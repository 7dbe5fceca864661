"""The recipe and its step: `recipe.py` (setup, train_step, train, backups), the loop's helpers
(`loop.py`), what one micro-step is fed (`step_inputs.py`) and the small pure functions it
calls: objectives, builders (optimizer, schedule, draws, precision), what trains
(`trainable.py`, `adapters.py`), the compile guard, the text-encoder cache, several processes."""
