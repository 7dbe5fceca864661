"""The GPU memory plan (a lower bound before any load) and its check against the card."""
