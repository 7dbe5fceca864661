"""The one error type the data layer raises for problems the user must fix in their dataset."""
from __future__ import annotations


class DatasetError(Exception):
    """A dataset problem the user can fix (missing folder, no usable images, unreadable file).

    The caller turns it into a config error before training starts, never a crash mid-run.
    """
