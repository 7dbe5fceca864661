"""A virtual X display (Xvfb) for running the window without a screen: tests and screenshots."""
from __future__ import annotations

import os
import subprocess


def start_xvfb(screen: str = "1400x950x24") -> tuple[subprocess.Popen, str]:
    """Start Xvfb on a free display number (it reports the number itself); return (process,
    ":N"). Raises OSError when Xvfb cannot be run and RuntimeError when it reports nothing."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(["Xvfb", "-displayfd", str(write_fd), "-screen", "0", screen,
                                 "-nolisten", "tcp"], pass_fds=(write_fd,),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        number = pipe.readline().strip()
    if not number:
        proc.kill()
        raise RuntimeError("Xvfb did not report a display number")
    return proc, f":{number}"
