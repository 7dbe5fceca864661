"""Seeds derived from names and numbers, the same in every process (`hash()` on str is not)."""
from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from `parts` (stable across processes, unlike `hash()` on str)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")
