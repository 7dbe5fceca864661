"""The compile cost of several resolutions' shape sets, said before a run (no model)."""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.compile import Capabilities
from modules.compile.shape_sets import possible_sizes
from modules.config import Config, apply_overrides
from modules.config.schema import DynamicShapes
from modules.data.buckets import batch_shapes
from modules.train.recipe.compile_guard import denoiser_compile_cost

CPU = Capabilities("cpu", False, None, False, "no triton", "/usr/bin/g++")
GPU = Capabilities.everything("cuda")

TWO = {64: [(2, 64, 64)], 128: [(2, 128, 128)]}
WITH_SHORT = {64: [(1, 64, 64), (2, 64, 64)], 128: [(2, 128, 128)]}


def config_with(*assignments: str) -> Config:
    return apply_overrides(Config(), list(assignments), cwd=Path("/nonexistent"))


@pytest.mark.parametrize("dynamic, shapes, full, regional", [
    ("AUTO", TWO, 1, 2),             # marked up front / static, then dynamic in H and W
    ("AUTO", WITH_SHORT, 2, 3),      # a batch of 1 is its own graph; the batch changes too
    ("DYNAMIC", WITH_SHORT, 2, 2),
    ("DYNAMIC", TWO, 1, 1),
    ("STATIC", WITH_SHORT, 3, 3),    # one per shape set
    ("AUTO", {64: [(2, 64, 64)]}, 1, 1),
])
def test_graphs_per_scope_follow_the_shape_sets(dynamic, shapes, full, regional):
    config = config_with("compile.backend=AOT_EAGER", f"compile.dynamic={dynamic}")
    cost = denoiser_compile_cost(config, shapes, CPU)
    assert cost is not None and cost.dynamic == DynamicShapes[dynamic]
    assert (cost.full_graphs(), cost.regional_sets()) == (full, regional)
    assert cost.record()["distinct_shape_sets"] == len({s for v in shapes.values() for s in v})


def test_inductor_keeps_a_whole_unets_size_static_one_graph_per_size():
    config = config_with("compile.backend=INDUCTOR")
    cost = denoiser_compile_cost(config, WITH_SHORT, GPU)
    # 64 and 128 px at batch 2, and 64 px at batch 1 (always specialised)
    assert cost is not None and cost.static_spatial and cost.full_graphs() == 3
    assert "FULL builds 3 denoiser graph(s)" in cost.describe()


def test_nothing_compiled_costs_nothing():
    assert denoiser_compile_cost(config_with("compile.backend=NONE"), TWO, CPU) is None
    assert denoiser_compile_cost(config_with("compile.backend=AOT_EAGER",
                                             "compile.denoiser=false"), TWO, CPU) is None


def test_before_a_scan_the_estimate_is_every_bucket_each_resolution_allows():
    config = config_with("compile.backend=AOT_EAGER", "data.resolution=512",
                         "data.resolutions=512,1024", "data.aspect_buckets=true",
                         "training.batch_size=4")
    assert {r: len(s) for r, s in possible_sizes(config.data).items()} == {512: 5, 1024: 9}
    cost = denoiser_compile_cost(config, capabilities=CPU)
    assert cost is not None and cost.upper_bound and len(cost.shapes) == 14
    assert cost.describe().startswith("compile: at most 14 shape set(s) (512 px: 5, 1024 px: 9)")


def test_batch_shapes_are_the_bucket_samplers():
    sizes = [(64, 64)] * 5 + [(64, 128)] * 2 + [(128, 64)]
    assert batch_shapes(sizes, 2) == [(1, 64, 64), (1, 128, 64), (2, 64, 64), (2, 64, 128)]
    assert batch_shapes(sizes, 2, world_size=2) == [(1, 64, 64), (1, 64, 128), (1, 128, 64),
                                                    (2, 64, 64)]
