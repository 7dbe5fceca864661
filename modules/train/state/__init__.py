"""A run's state and how it continues: the `Run` the recipe owns (`run.py`), the `TrainingState`
(`training_state.py`), backups (`backup.py`, `backup_files.py`, and `sharded_state.py` for FSDP's shards), what a folder offers to resume
(`resume_offer.py`), the run it continues (`earlier_run.py`) and the compile times of earlier
runs (`history.py`)."""
