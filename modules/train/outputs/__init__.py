"""What a run writes: samples, checkpoints and their rotation, final and best weights (`saving.py`
for the file layouts, `embedding_files.py` for a textual inversion's), the run record `run.json`
(`record.py`) and what the files say about the data."""
