"""Compile bundles: a run's compiled code in one file that another machine can start warm from.

Inductor's caches (modules/compile/cache.py) make the second run on the same disk warm. A bundle
carries that work to a new cache folder, another machine or a cloud run: torch's portable cache
artifacts (`torch.compiler.save_cache_artifacts`: FX graphs, AOTAutograd entries, autotune
results, dynamic-shape profiles; on CUDA Triton's kernels ride inside the FX graph entries)
plus what those leave out on the CPU: the C++ kernels inductor built, which a new cache folder
would otherwise compile again (seconds each).

A bundle is a zip file: ``header.json`` (the fingerprint of what it was compiled for, the
artifacts' length and SHA-256), ``artifacts.bin`` and ``kernels/<path in the cache folder>``.
Its name carries the fingerprint's hash, so a folder may hold bundles for many settings and a
run picks the one made for it. A bundle that does not match is not loaded and the lookup says
which part of the fingerprint differed; a damaged one is named and skipped. Neither ever stops
a run or changes its numbers: the cache entries torch loads are keyed by what they compile, so
a loaded entry is only used where the run would have compiled exactly that code.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from modules.util.atomic import atomic_file, atomic_write_bytes

BUNDLE_SUFFIX = ".tcb"
AHEAD_WHY = "compiled ahead while the data was cached"  # a hit on the compile-ahead bundle
BUNDLE_FORMAT = 1
HEADER = "header.json"
ARTIFACTS = "artifacts.bin"
KERNELS = "kernels/"
# The cache folder's own bookkeeping, never carried: torch's artifacts hold the FX graph and
# AOTAutograd entries, and lock files belong to the process that made them.
_NOT_KERNELS = {"fxgraph", "aotautograd", "locks", "triton", "bundles"}


@dataclass(frozen=True)
class Fingerprint:
    """What a bundle's compiled code was made for: a bundle is loaded only where all match."""
    torch: str
    triton: str                 # "" without Triton (CPU)
    cuda: str                   # "" on a CPU build
    device: str                 # "cpu", or the GPU's name
    capability: str             # "9.0"; "" on the CPU
    threads: str                # CPU kernels are built for a thread count; "" on a GPU
    family: str                 # model.type
    components: tuple[str, ...]  # "unet: INDUCTOR REGIONAL <settings hash>" per compiled one
    dtype: str                  # weights / mixed precision
    shapes: tuple[str, ...]     # the batch shapes the run compiles for, "2x64x64"

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def file_name(self) -> str:
        return f"{self.family.lower()}-{self.digest()}{BUNDLE_SUFFIX}"

    def differences(self, other: "Fingerprint") -> list[str]:
        """Each part that differs, as "<part>: this run <mine>, bundle <its>"."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                show = (lambda v: ", ".join(v) if isinstance(v, tuple) else (v or "none"))
                out.append(f"{f.name}: this run {show(mine)}, bundle {show(theirs)}")
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Fingerprint":
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = data[f.name]
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


def settings_hash(settings: Mapping) -> str:
    """A short stable hash of a component's torch.compile arguments and inductor options."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()
                          ).hexdigest()[:12]


class BundleError(Exception):
    """A bundle file that cannot be used: not a bundle, truncated, damaged, another format."""


@dataclass(frozen=True)
class BundleFile:
    path: Path
    fingerprint: Fingerprint
    header: dict


def read_header(path: Path) -> BundleFile:
    """The bundle's header, checked to be whole; raises BundleError naming what is wrong."""
    try:
        with zipfile.ZipFile(path) as z:
            header = json.loads(z.read(HEADER))
            if header.get("format") != BUNDLE_FORMAT:
                raise BundleError(f"{path}: bundle format {header.get('format')!r}, this "
                                  f"Tempera reads format {BUNDLE_FORMAT}")
            return BundleFile(path, Fingerprint.from_dict(header["fingerprint"]), header)
    except IsADirectoryError as err:
        raise BundleError(f"{path} is a folder, not a bundle file") from err
    except PermissionError as err:
        raise BundleError(f"{path} cannot be read: {err.strerror}") from err
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, EOFError) as err:
        raise BundleError(f"{path} is not a whole compile bundle (truncated or damaged: "
                          f"{err})") from err


def _kernel_files(cache_dir: Path, names: Iterable[str]) -> list[Path]:
    """The files of the compiled kernels ``names`` (hashes) in the cache folder: inductor keeps
    a kernel's source and library as ``<cache>/<hash[1:3]>/<hash>*``."""
    found: list[Path] = []
    for name in sorted(set(names)):
        folder = cache_dir / name[1:3]
        if folder.name in _NOT_KERNELS or not folder.is_dir():
            continue
        found.extend(sorted(p for p in folder.glob(f"{name}*") if p.is_file()))
    return found


def loaded_kernel_names() -> list[str]:
    """The C++ kernels inductor built or loaded in this process (CPU code generation). Torch's
    portable artifacts hold the code that calls them but not the compiled libraries; Triton's
    GPU kernels need nothing here (they travel inside the artifacts)."""
    from torch._inductor import codecache

    cache = getattr(codecache.CppPythonBindingsCodeCache, "cache", None)
    return list(cache) if isinstance(cache, dict) else []


def compiled_cold(hits: int, misses: int) -> bool:
    """Whether a run's compile was a cold one (its time is what the code costs to compile
    from nothing, the figure a bundle carries for a later run's "saved"): most of its graphs
    missed the cache. Not "no hit at all": a cold REGIONAL run hits the cache for the odd
    graph it compiled once already (two blocks alike), and a warm run that meets a new shape
    misses for that shape's graphs alone."""
    return misses > hits


def write_bundle(folder: Path, fingerprint: Fingerprint, cache_dir: Path,
                 cold_seconds: float | None = None) -> Path | None:
    """Write this process's compiled code as ``folder/<fingerprint's file name>``, atomically
    (`atomic_file`: a reader never sees half a bundle and two writers leave one whole file).
    None when torch recorded nothing to carry. ``cold_seconds``: what compiling this code cold took, for a later run's "saved" figure."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    artifacts = saved[0]
    kernels = _kernel_files(cache_dir, loaded_kernel_names())
    header = {"format": BUNDLE_FORMAT, "fingerprint": asdict(fingerprint),
              "artifacts_bytes": len(artifacts),
              "artifacts_sha256": hashlib.sha256(artifacts).hexdigest(),
              "kernels": len(kernels), "cold_compile_seconds": cold_seconds}
    target = folder / fingerprint.file_name()
    with atomic_file(target) as tmp, zipfile.ZipFile(tmp, "w") as z:
        z.writestr(HEADER, json.dumps(header, indent=1))
        z.writestr(ARTIFACTS, artifacts, compress_type=zipfile.ZIP_DEFLATED)
        for path in kernels:
            z.write(path, KERNELS + path.relative_to(cache_dir).as_posix(),
                    compress_type=zipfile.ZIP_DEFLATED)
    return target


def load_bundle(bundle: BundleFile, cache_dir: Path) -> int:
    """Put the bundle's compiled code into ``cache_dir`` and torch's caches; returns how many
    entries torch took. Everything is checked before anything is written (BundleError)."""
    import torch

    try:
        with zipfile.ZipFile(bundle.path) as z:
            artifacts = z.read(ARTIFACTS)
            kernels = {name[len(KERNELS):]: z.read(name) for name in z.namelist()
                       if name.startswith(KERNELS)}
    except (OSError, zipfile.BadZipFile, KeyError, EOFError) as err:
        raise BundleError(f"{bundle.path} is damaged ({err})") from err
    if (len(artifacts) != bundle.header.get("artifacts_bytes")
            or hashlib.sha256(artifacts).hexdigest() != bundle.header.get("artifacts_sha256")):
        raise BundleError(f"{bundle.path} is damaged (its compiled code does not match its "
                          "header's checksum)")
    for relative, data in kernels.items():
        target = (cache_dir / relative).resolve()
        if cache_dir.resolve() not in target.parents:
            raise BundleError(f"{bundle.path} names a file outside the cache folder: {relative}")
        if not target.exists():  # a kernel already there is the same build (its name is its hash)
            atomic_write_bytes(target, data)
            if target.suffix == ".so":
                target.chmod(0o755)
    try:
        info = torch.compiler.load_cache_artifacts(artifacts)
    except Exception as err:  # torch's own reader: whatever it raises, the run goes on cold
        raise BundleError(f"{bundle.path}: torch could not read its compiled code "
                          f"({type(err).__name__}: {err})") from err
    if info is None:  # torch logs why (e.g. its own checksum) and returns nothing
        raise BundleError(f"{bundle.path}: torch could not read its compiled code (torch's "
                          "warning above says why)")
    return sum(len(v) for v in info.artifacts.values())


@dataclass(frozen=True)
class Lookup:
    """What a run found: ``status`` is hit, miss, mismatch or damaged; ``why`` says more."""
    status: str
    path: Path | None = None
    why: str = ""
    skipped: tuple[str, ...] = ()   # damaged or unreadable files passed over

    def describe(self) -> str:
        return f"{self.status} ({self.why})" if self.why else self.status


def bundle_cold_seconds(lookup: Lookup | None) -> float | None | bool:
    """For a compile ETA: False unless ``lookup`` found the bundle made for the settings;
    then the cold compile time it records (None where it records none or cannot be read)."""
    if lookup is None or lookup.status != "hit" or lookup.path is None:
        return False
    try:
        cold = read_header(lookup.path).header.get("cold_compile_seconds")
    except BundleError:
        return None
    return float(cold) if isinstance(cold, (int, float)) else None


def candidate_files(places: Sequence[Path]) -> list[Path]:
    """Every bundle file in ``places`` (each a bundle file or a folder of them), in order."""
    found: list[Path] = []
    for place in places:
        if place.is_dir():
            found.extend(sorted(place.glob(f"*{BUNDLE_SUFFIX}")))
        elif place.exists() or place.suffix == BUNDLE_SUFFIX:
            found.append(place)
    return found


def find_bundle(fingerprint: Fingerprint, places: Sequence[Path]) -> Lookup:
    """The bundle in ``places`` made for ``fingerprint``, or why none is used: the closest
    one's differences (fewest parts differing) when only other settings' bundles are there."""
    skipped: list[str] = []
    closest: tuple[int, list[str], Path] | None = None
    for path in candidate_files(places):
        try:
            found = read_header(path)
        except (BundleError, OSError) as err:
            skipped.append(str(err) if isinstance(err, BundleError) else f"{path}: {err}")
            continue
        diff = fingerprint.differences(found.fingerprint)
        if not diff:
            return Lookup("hit", path, skipped=tuple(skipped))
        if closest is None or len(diff) < closest[0]:
            closest = (len(diff), diff, path)
    if closest is not None:
        return Lookup("mismatch", closest[2], "; ".join(closest[1]), tuple(skipped))
    if skipped:
        return Lookup("damaged", None, skipped[0], tuple(skipped))
    return Lookup("miss", None, "no bundle for these settings yet")


class BundleKeeper:
    """One run's bundles: the one looked for (and loaded) before the first step, and the one
    written whenever the run has compiled something new since the last write.

    ``places`` are where to look (a file or folder the user named, then the cache folder's
    ``bundles/``); ``folder`` is where this run writes; ``write`` is False on every process but
    the main one of a multi-process run (one writer per run); ``ahead`` is the bundle this
    run's compile-ahead process wrote (a hit on it says so).
    """

    def __init__(self, fingerprint: Fingerprint, places: Sequence[Path], folder: Path,
                 write: bool = True, ahead: Path | None = None):
        self.fingerprint = fingerprint
        self.ahead = ahead
        self.places = list(places)
        self.folder = folder
        self.write = write
        self.lookup = Lookup("miss", why="not looked for yet")
        self.loaded_entries = 0
        self.cold_seconds: float | None = None  # the loaded bundle's cold compile, if known
        self.written: Path | None = None
        self.write_error: str | None = None
        self._compiles_written = 0

    def load(self, cache_dir: Path) -> Lookup:
        """Find this run's bundle and load it into ``cache_dir``; never raises for a bad one."""
        lookup = find_bundle(self.fingerprint, self.places)
        if lookup.status == "hit" and lookup.path is not None:
            try:
                found = read_header(lookup.path)
                self.loaded_entries = load_bundle(found, cache_dir)
                cold = found.header.get("cold_compile_seconds")
                self.cold_seconds = float(cold) if isinstance(cold, (int, float)) else None
            except BundleError as err:
                lookup = Lookup("damaged", lookup.path, str(err), lookup.skipped)
        if lookup.status == "hit" and self.from_ahead(lookup):
            lookup = Lookup("hit", lookup.path, AHEAD_WHY, lookup.skipped)
        self.lookup = lookup
        return lookup

    def from_ahead(self, lookup: Lookup) -> bool:
        """Whether ``lookup`` found the bundle this run's compile-ahead process wrote."""
        return (self.ahead is not None and lookup.path is not None
                and lookup.path.resolve() == self.ahead.resolve())

    def write_if_new(self, compiles_so_far: int, cache_dir: Path,
                     compile_seconds: float = 0.0, cold: bool = True) -> Path | None:
        """Write the bundle when graphs were compiled since the last write; the path written,
        or None. ``compile_seconds`` is this run's compile time so far, a cold compile's when
        ``cold`` (else the loaded bundle's cold time is carried on). A failed write (a full
        disk) is kept in ``write_error`` for the caller to report: it never stops training."""
        if not self.write or compiles_so_far <= self._compiles_written:
            return None
        self._compiles_written = compiles_so_far
        try:
            path = write_bundle(self.folder, self.fingerprint, cache_dir,
                                round(compile_seconds, 1) if cold else self.cold_seconds)
        except OSError as err:
            self.write_error = f"{self.folder}: {err.strerror or err}"
            return None
        if path is not None:
            self.written, self.write_error = path, None
        return path

    def record(self, compile_seconds: float | None = None) -> dict:
        """run.json's ``compile_bundle``; with this run's ``compile_seconds``, what a loaded
        bundle saved against the cold compile it was made by (when that was measured)."""
        saved = (round(self.cold_seconds - compile_seconds, 1)
                 if self.cold_seconds is not None and compile_seconds is not None
                 and self.lookup.status == "hit" else None)
        return {"lookup": self.lookup.status, "why": self.lookup.why or None,
                "cold_compile_seconds": self.cold_seconds, "seconds_saved": saved,
                "found": str(self.lookup.path) if self.lookup.path else None,
                "from_ahead": self.lookup.status == "hit" and self.from_ahead(self.lookup),
                "loaded_entries": self.loaded_entries,
                "skipped": list(self.lookup.skipped),
                "written": str(self.written) if self.written else None,
                "write_error": self.write_error,
                "fingerprint": asdict(self.fingerprint)}


def _copy_whole(source: Path, target: Path) -> Path:
    """Copy ``source`` to ``target`` through a temporary file beside it: never half a file."""
    with atomic_file(target) as tmp:
        shutil.copyfile(source, tmp)
    return target


def import_bundle(source: Path, folder: Path) -> BundleFile:
    """Copy a bundle (say, exported on another machine) into ``folder`` under its
    fingerprint's name, where runs look for it; refused (BundleError) unless it is a whole
    bundle. Returns the copy."""
    found = read_header(source)
    target = folder / found.fingerprint.file_name()
    if target.exists() and target.resolve() == source.resolve():
        return found
    try:
        _copy_whole(source, target)
    except OSError as err:
        raise BundleError(f"{target}: cannot be written ({err.strerror or err})") from err
    return BundleFile(target, found.fingerprint, found.header)


def export_bundle(source: Path, target: Path) -> Path:
    """Copy a bundle to ``target`` (another machine's, a cloud run's repository): whole or
    not at all; BundleError names what went wrong."""
    read_header(source)
    try:
        return _copy_whole(source, target)
    except OSError as err:
        raise BundleError(f"{target}: cannot be written ({err.strerror or err})") from err
