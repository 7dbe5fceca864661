"""Dataset preparation inside Tempera: captions (`caption.py`) and masks for a folder of images.

`job.py` is the machinery every preparation job shares (listing, batching, atomic writes, the
journal, the folder lock, progress, Stop, the report); `hub.py` finds a model's weights in the
user's Hugging Face cache. Nothing here prints or imports a GUI toolkit: front ends (the
`tempera-data` command, the Data tab) drive a job through its callbacks and stop event.
"""
