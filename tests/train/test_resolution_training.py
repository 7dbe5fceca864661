"""Several resolutions through the real trainer (tiny SD 1.5, 64 and 128 px, AOT_EAGER
REGIONAL): one shared run, read by every assertion below."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from modules.config import Config, apply_overrides
from modules.events import RecordingCallbacks
from modules.train.trainer import train

IMAGES = 4


@pytest.fixture(scope="module")
def run(tempera_cache, tmp_path_factory):
    """Two epochs of 4 images at 64 and 128 px, batch 2, latents cached, compiled with
    AOT_EAGER in REGIONAL scope (compile.dynamic AUTO). About 10 s warm (the tiny model is
    the session's): the one training run of this file, shared by its tests."""
    import torch._dynamo
    torch._dynamo.reset()  # this run counts recompiles: no frames from earlier tests
    root = tmp_path_factory.mktemp("resolutions")
    folder = root / "data"
    folder.mkdir()
    for i in range(IMAGES):
        Image.effect_noise((80, 72), 40 + i).convert("RGB").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a noisy picture number {i}", encoding="utf-8")
    cache = root / "cache"
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={root / 'out'}",
        f"data.datasets[0].path={folder}", "data.resolution=64", "data.resolutions=64,128",
        "data.cache_latents=true", f"compile.cache_dir={cache / 'compile'}",
        "training.max_steps=0", "training.epochs=2", "training.batch_size=2",
        "training.learning_rate=1e-3", "sampling.prompts=[]", "logging.tensorboard=false",
        "compile.backend=AOT_EAGER"])
    callbacks = RecordingCallbacks()
    result = train(config, callbacks)
    record = json.loads((result.output_dir / "run.json").read_text())
    yield result, callbacks, record
    torch._dynamo.reset()


def test_every_image_trains_at_each_resolution_and_the_budget_counts_them(run):
    result, callbacks, record = run
    assert result.steps == IMAGES * 2 * 2 // 2  # images x resolutions x epochs / batch
    assert record["buckets"]["batches_per_epoch"] == 4
    assert record["buckets"]["resolutions"] == [
        {"resolution": 64, "items": 4, "sizes": [{"height": 64, "width": 64, "items": 4}]},
        {"resolution": 128, "items": 4, "sizes": [{"height": 128, "width": 128, "items": 4}]}]
    assert any("4 samples x 2 resolutions (64 px: 4, 128 px: 4) = 8 samples per epoch" in s
               for s in callbacks.statuses)
    assert all(torch.isfinite(torch.tensor(record["losses"])))


def test_batches_keep_one_shape_and_the_compile_cost_was_said_up_front(run):
    _, callbacks, record = run
    shapes = record["batch_shapes"]
    assert sorted((s["batch"], s["height"], s["width"]) for s in shapes["shapes"]) == [
        (2, 64, 64), (2, 128, 128)]
    estimate = record["compile_estimate"]
    assert estimate["shape_sets"] == {"64": [[2, 64, 64]], "128": [[2, 128, 128]]}
    assert estimate["distinct_shape_sets"] == shapes["distinct"] == 2
    assert estimate["full_graphs"] == 1  # the latents are marked dynamic up front
    said = [s for s in callbacks.statuses if s.startswith("compile: 2 shape set(s)")]
    assert said and "FULL builds 1 denoiser graph(s), REGIONAL 2 set(s)" in said[0]
    # REGIONAL, as estimated: the static block graphs of the first shape, one dynamic
    # recompile when the resolution first changes, and none after the first pass
    assert record["compile"]["unet"]["compiled_code_ran"]
    assert shapes["recompiles_after_first_pass"] == \
        estimate["regional_recompiles_after_first_pass"] == 0
    assert 1 + shapes["new_shapes_that_recompiled"] == estimate["regional_block_graph_sets"] == 2


def test_latents_are_cached_once_per_image_and_resolution(run):
    result, callbacks, _ = run
    config = json.loads((result.output_dir / "config.json").read_text())
    files = list((Path(config["general"]["cache_dir"]) / "latents").glob("*.safetensors"))
    sizes = []
    for path in files:
        with safe_open(str(path), framework="pt") as file:
            sizes.append(tuple(file.get_tensor("latent").shape[1:]))
    # the session's cache may hold other tests' latents; these are this run's
    assert sizes.count((8, 8)) >= IMAGES and sizes.count((16, 16)) >= IMAGES
    assert f"latent cache: 0 reused, {IMAGES * 2} encoded" in callbacks.statuses


def test_a_run_over_two_resolutions_resumes_bit_for_bit(tiny_config, tmp_path):
    """Stopped at step 2 of 4 and resumed: the sampler's batches (each of one resolution)
    continue exactly. About 10 s: two short runs at 64 and 128 px, eager."""
    from tests.train.test_resume import assert_resumes_bit_for_bit
    assert_resumes_bit_for_bit(tiny_config, tmp_path, (
        "data.resolutions=64,128", "training.max_steps=4", "compile.backend=NONE"), at=2)


def test_the_trainers_dataset_takes_each_samples_size(tmp_path: Path):
    """build_dataset (train/setup/start.py) over a scan: a dataset's own single resolution
    is its size even where data.resolution differs, and two resolutions give both."""
    from modules.data.folders import DatasetSource, scan_datasets
    from modules.train.setup.prepare import PreparedRun
    from modules.train.setup.start import build_dataset

    folder = tmp_path / "a"
    folder.mkdir()
    for i, size in enumerate([(90, 70), (70, 90)]):
        Image.effect_noise(size, 70 + i).convert("RGB").save(folder / f"img{i}.png")
    scan = scan_datasets([DatasetSource(folder)])

    def sizes(*overrides: str) -> list[tuple[int, ...]]:
        config = apply_overrides(Config(), [f"data.datasets[0].path={folder}",
                                            "data.resolution=64", *overrides])
        prepared = PreparedRun(config, torch.device("cpu"), tmp_path, None, scan)  # type: ignore[arg-type]
        dataset = build_dataset(prepared, RecordingCallbacks())
        return [tuple(dataset[i]["pixel_values"].shape[1:]) for i in range(len(dataset))]

    assert sizes() == [(64, 64)] * 2
    assert sizes("data.datasets[0].resolutions=[128]") == [(128, 128)] * 2
    assert sizes("data.resolutions=64,128") == [(64, 64)] * 2 + [(128, 128)] * 2
