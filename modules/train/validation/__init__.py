"""Validation: which images it scores (`validation_set.py`) and the passes (`validation.py`)."""
