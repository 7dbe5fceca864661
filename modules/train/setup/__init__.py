"""Before anything is written and at the start: `prepare.py` (every check that can fail on the
user's input, then the model loaded), the inputs on disk (`inputs.py`), the output folder's
lock, what `recipe.setup` calls on its way (`start.py`), and *Check compilation*'s explanation
(`explain_run.py`)."""
