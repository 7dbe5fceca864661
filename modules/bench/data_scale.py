"""How scanning, bucketing and latent caching grow with a dataset's size (issue: datasets of
real size). `scripts/benchmark_data.py --sizes 1000,5000,20000` generates folders of mixed
sizes and aspect ratios, measures each pass in a fresh process (so its peak memory is its
own), kills one latent-cache build part way and resumes it, and writes the table into
docs/benchmarks.md between the data-scale markers. Numbers are measured, never asserted.
"""
from __future__ import annotations

import json
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from modules.util.process import with_repo_on_pythonpath
from modules.util.cores import usable_cores

BEGIN, END = "<!-- data-scale:begin -->", "<!-- data-scale:end -->"
RESOLUTION = 256  # bucketed; the images below are 192 to 768 px on their long side
SHAPES = ((1, 1), (2, 3), (3, 2), (3, 4), (4, 3), (9, 16), (16, 9), (1, 2), (2, 1))


def make_images(folder: Path, count: int, seed: int = 0) -> None:
    """`count` JPEGs of mixed aspect ratios and sizes with captions (a gradient each: quick to
    write, decoded like a photo)."""
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        w_part, h_part = rng.choice(SHAPES)
        long_side = rng.randrange(192, 769, 32)
        scale = long_side / max(w_part, h_part)
        size = (max(32, int(w_part * scale)), max(32, int(h_part * scale)))
        colour = tuple(rng.randrange(256) for _ in range(3))
        image = Image.linear_gradient("L").resize(size).convert("RGB")
        image = Image.blend(image, Image.new("RGB", size, colour), 0.6)
        image.save(folder / f"{i:06d}.jpg", quality=85)
        (folder / f"{i:06d}.txt").write_text(f"image {i}, colour {colour[0]}", encoding="utf-8")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def measure(folder: Path, cache: Path, with_cache: bool = True) -> dict[str, Any]:
    """In this process: scan, assign buckets, cache latents with the tiny model's VAE (when
    `with_cache`)."""
    import torch
    from modules.data.buckets import assign_buckets
    from modules.data.dataset import expand_repeats
    from modules.data.folders import DatasetSource, scan_datasets
    from modules.data.latent_cache import LatentCache, cache_latents, vae_fingerprint
    from modules.model_types import BUILTIN_DEMO
    from modules.models.tiny import ensure_builtin_model

    started = time.perf_counter()
    scan = scan_datasets([DatasetSource(folder)], resolution=RESOLUTION)
    scan_s = time.perf_counter() - started
    scan_rss = peak_rss_mib()
    items = expand_repeats(scan)
    started = time.perf_counter()
    targets = assign_buckets(items, RESOLUTION, 2.0)
    bucket_s = time.perf_counter() - started
    row = {"images": scan.num_images, "scan_seconds": round(scan_s, 2),
           "scan_images_per_s": round(scan.num_images / scan_s, 1),
           "scan_peak_rss_mib": round(scan_rss), "bucket_seconds": round(bucket_s, 3)}
    if not with_cache:
        return {**row, "peak_rss_mib": round(peak_rss_mib())}
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(ensure_builtin_model(BUILTIN_DEMO, cache) / "vae")
    vae.eval()

    @torch.no_grad()
    def encode(pixels):
        return vae.encode(pixels).latent_dist.mean.float()

    latent_cache = LatentCache(cache / "latents", vae_fingerprint(vae))
    started = time.perf_counter()
    stats = cache_latents(items, encode, latent_cache, RESOLUTION, target_sizes=targets)
    cache_s = time.perf_counter() - started
    return {**row, "cache_seconds": round(cache_s, 2), "encoded": stats.misses,
            "reused": stats.hits,
            "cache_images_per_s": round(stats.misses / cache_s, 1) if cache_s else None,
            "peak_rss_mib": round(peak_rss_mib())}


def _child(folder: Path, cache: Path, timeout: float | None = None,
           with_cache: bool = True) -> dict[str, Any] | None:
    """`measure` in a fresh process; None when it was killed at `timeout` seconds."""
    code = ("import json, sys; from pathlib import Path; from modules.bench.data_scale import "
            "measure; print(json.dumps(measure(Path(sys.argv[1]), Path(sys.argv[2]), "
            "sys.argv[3] == '1')))")
    # every core, whatever share of them the parent runs with (a test worker's, say)
    env = {**with_repo_on_pythonpath(), "OMP_NUM_THREADS": str(usable_cores())}
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder), str(cache),
                             "1" if with_cache else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"the measurement of {folder} failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def run(sizes: list[int], work: Path, kill_after: float, cache_up_to: int) -> dict[str, Any]:
    """Measure each size (generated images are kept in `work` for a rerun; caches are not).
    Latent caching is measured up to `cache_up_to` images (on a CPU it runs at a few images a
    second, so 20,000 would take hours), and the kill-and-resume on the largest of those."""
    import shutil
    if not any(count <= cache_up_to for count in sizes):
        raise ValueError(f"no size is at most {cache_up_to}: latent caching and its resume "
                         "need one (lower a size or raise --cache-up-to)")
    for old in work.glob("cache-*"):
        shutil.rmtree(old)
    load_before = os.getloadavg()[0]
    rows = []
    for count in sizes:
        folder = work / f"images-{count}"
        started = time.perf_counter()
        if not folder.is_dir():
            make_images(folder, count)
        generated = time.perf_counter() - started
        row = _child(folder, work / f"cache-{count}", with_cache=count <= cache_up_to)
        assert row is not None  # None only when killed at a timeout, and there is none
        rows.append({**row, "generate_seconds": round(generated, 1)})
    cached = [count for count in sizes if count <= cache_up_to]
    largest = work / f"images-{max(cached)}"
    resume_cache = work / "cache-resume"
    killed = _child(largest, resume_cache, timeout=kill_after)
    resumed = _child(largest, resume_cache)
    assert resumed is not None  # as above: no timeout
    return {"machine": f"{platform.processor() or platform.machine()}, {usable_cores()} CPU "
                       f"cores, Python {platform.python_version()}, load average "
                       f"{load_before:.1f} before and {os.getloadavg()[0]:.1f} after",
            "date": time.strftime("%Y-%m-%d"), "resolution": RESOLUTION, "rows": rows,
            "resume": {"images": max(cached), "killed_after_seconds": kill_after,
                       "killed": killed is None, "reused_after_kill": resumed["reused"],
                       "encoded_after_kill": resumed["encoded"]}}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Measured on {result['machine']} ({result['date']}), `scripts/benchmark_data.py`;"
             f" bucketed at {result['resolution']} px, the tiny model's VAE on the CPU.", "",
             "| images | scan (images/s) | scan peak RSS | buckets | latent cache (images/s) | "
             "peak RSS |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        cache = (f"{r['cache_seconds']} s ({r['cache_images_per_s']})" if "cache_seconds" in r
                 else "not measured")
        lines.append(f"| {r['images']:,} | {r['scan_seconds']} s ({r['scan_images_per_s']:,}) | "
                     f"{r['scan_peak_rss_mib']} MiB | {r['bucket_seconds']} s | {cache} | "
                     f"{r['peak_rss_mib']} MiB |")
    resume = result["resume"]
    lines += ["", f"Killed after {resume['killed_after_seconds']} s while caching "
              f"{resume['images']:,} images (SIGKILL: {'yes' if resume['killed'] else 'no, it had finished'}), "
              f"the rerun reused {resume['reused_after_kill']:,} cached latents and encoded "
              f"{resume['encoded_after_kill']:,}: a killed cache build resumes where it stopped."]
    return "\n".join(lines)


def write_docs(result: dict[str, Any], docs: Path) -> None:
    from modules.bench.gpu_report import replace_block
    page = docs.read_text(encoding="utf-8")
    docs.write_text(replace_block(page, markdown(result), BEGIN, END), encoding="utf-8")
