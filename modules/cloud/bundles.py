"""Compile bundles in cloud runs: carried in the training repository, brought back by fetch.

A training repository has a `bundles/` folder (`tempera-cloud init`). The worker points a
run's `compile.bundle` at the pushed commit's `bundles/` when neither the config nor the
machine's local.json names one (`repo_bundle_override`, an ordinary `--set` in the run's
command, kept in its config.json); the run loads the bundle whose fingerprint matches its GPU
and reports the others as mismatches (modules/compile/bundle.py). The bundle a run writes lives
in the GPU machine's compile cache folder: when the run ends the worker copies it into the
run's output folder (`outputs/<run-id>/bundles/`), `tempera-cloud fetch --what bundle` brings
it back and `tempera-cloud add-bundle` commits it into the repository's `bundles/`, so the next
push carries it. `status.json` keeps how each run started (`compile_start_summary`), which
`status`, the run list and the GUI's Cloud tab show (`describe_compile_start`).
"""
from __future__ import annotations

import json
from pathlib import Path

from modules.cloud.git import CloudError, git, git_text
from modules.compile.bundle import (BundleError, Fingerprint, export_bundle, import_bundle,
                                    read_header)
from modules.config import Config

REPO_BUNDLES = "bundles"   # the training repository's folder of compile bundles
OUTPUT_BUNDLES = "bundles"  # where the worker puts a run's written bundle in its output folder


def repo_bundle_override(checkout: Path, config: Config) -> list[str]:
    """`--set compile.bundle=<checkout>/bundles` for a run of this checkout, or nothing: when
    the checkout has no bundles/ folder, bundles are off, or the config (or the machine's
    local.json, applied to `config` already) names a bundle itself."""
    folder = Path(checkout) / REPO_BUNDLES
    if not folder.is_dir() or not config.compile.bundles or config.compile.bundle:
        return []
    return [f"compile.bundle={folder}"]


def read_compile_bundle(output_dir: Path) -> tuple[bool, dict | None]:
    """(whether run.json says anything yet, its `compile_bundle`): the trainer writes the key
    before the first step, None where bundles are off or nothing compiles with inductor."""
    try:
        record = json.loads((Path(output_dir) / "run.json").read_text("utf-8"))
    except (OSError, ValueError):
        return False, None
    if not isinstance(record, dict) or "compile_bundle" not in record:
        return False, None
    value = record["compile_bundle"]
    return True, value if isinstance(value, dict) else None


def compile_start_summary(compile_bundle: dict | None) -> dict:
    """What status.json keeps of run.json's `compile_bundle`: how the run started."""
    if compile_bundle is None:
        return {"lookup": "off"}
    found, written = compile_bundle.get("found"), compile_bundle.get("written")
    return {"lookup": compile_bundle.get("lookup"), "why": compile_bundle.get("why"),
            "found": Path(found).name if found else None,
            "loaded_entries": compile_bundle.get("loaded_entries"),
            "seconds_saved": compile_bundle.get("seconds_saved"),
            "written": Path(written).name if written else None,
            "write_error": compile_bundle.get("write_error")}


def describe_compile_start(summary: dict | None) -> str:
    """One phrase for the run list: warm from which bundle, cold and why, or '' (not known yet,
    or nothing compiled with inductor)."""
    if not summary or summary.get("lookup") in (None, "off"):
        return ""
    lookup, why = summary["lookup"], summary.get("why") or ""
    if lookup == "hit":
        saved = summary.get("seconds_saved")
        tail = f" (saved {saved:.0f} s)" if isinstance(saved, (int, float)) else ""
        return f"compile: warm from bundle {summary.get('found')}{tail}"
    if lookup == "miss":
        return "compile: cold (no bundle for this GPU)"
    if lookup == "mismatch":
        return f"compile: cold, bundle mismatch: {why}"
    return f"compile: cold, bundle {lookup}: {why}"


def collect_written_bundle(output_dir: Path) -> str | None:
    """Copy the bundle the run wrote (run.json's compile_bundle.written, in this machine's
    cache folder) into `<output_dir>/bundles/`, so fetch brings it back; one line for the run's
    notes, or None when the run wrote none."""
    _, record = read_compile_bundle(output_dir)
    written = (record or {}).get("written")
    if not written:
        return None
    source, target = Path(written), Path(output_dir) / OUTPUT_BUNDLES / Path(written).name
    if not source.is_file():  # the cache folder cleaned since, or another machine's path
        return f"compile bundle {source} not copied to the outputs: it is not there"
    try:
        export_bundle(source, target)
    except BundleError as exc:
        return f"compile bundle not copied to the outputs: {exc}"
    return f"compile bundle {source.name} copied to {target.parent}"


def read_fingerprint(file: Path) -> Fingerprint:
    """A bundle file's fingerprint; CloudError naming the file when it is not a whole bundle."""
    try:
        return read_header(file).fingerprint
    except BundleError as exc:
        raise CloudError(str(exc)) from None


def add_bundle(file: Path, repo: Path, commit: bool = True) -> list[str]:
    """Put a compile bundle into the training repository's bundles/ under its fingerprint's
    name (replacing the older one made for the same settings) and commit it; the next push
    carries it. A file that is not a whole bundle is refused (CloudError)."""
    repo = Path(repo).resolve()
    if not (repo / ".git").exists():
        raise CloudError(f"{repo} is not a training repository (tempera-cloud init {repo})")
    target = repo / REPO_BUNDLES / read_fingerprint(Path(file)).file_name()
    replaced = target.exists()
    try:
        fp = import_bundle(Path(file), target.parent).fingerprint
    except BundleError as exc:
        raise CloudError(str(exc)) from None
    made_for = f"{fp.family} on {fp.device}" + (f" (capability {fp.capability})"
                                                if fp.capability else "") + f", torch {fp.torch}"
    done = [f"{'replaced' if replaced else 'added'} {target.relative_to(repo)}: {made_for}"]
    if commit:
        rel = target.relative_to(repo).as_posix()
        git(["add", "--", rel], cwd=repo)
        if git(["diff", "--cached", "--quiet", "--", rel], cwd=repo, check=False).returncode:
            git(["commit", "-q", "-m", f"Compile bundle {rel} ({made_for})", "--", rel],
                cwd=repo)
            done.append(f"committed it ({git_text(['rev-parse', '--short', 'HEAD'], cwd=repo)});"
                        " the next push (push-and-train) carries it")
        else:
            done.append("the same file is committed already; nothing to commit")
    return done
