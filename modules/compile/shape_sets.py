"""The compile cost of a run's batch shapes, said before the first step: how many shape sets
(batch, height, width) the denoiser meets, per resolution, and how many graphs REGIONAL and
FULL scope build for them.

Each listed resolution (data.resolutions) brings its own buckets, so its own shape sets. What
they cost follows from the rules the compile engine applies (modules/compile/dynamic_dims.py,
measured in tests/train/test_bucketed_training.py and test_resolution_training.py):

- STATIC: every shape set is compiled apart: one graph per shape set (FULL), one set of block
  graphs per shape set (REGIONAL).
- FULL with AUTO or DYNAMIC: the latents are marked dynamic up front: one graph for every shape
  set, unless the backend cannot take symbolic height and width
  (plan.SPATIAL_DYNAMIC_LIMITS: inductor's whole UNet), then one graph per (height, width).
  A batch of 1 (a bucket's short last batch) is a size torch always specialises: the shape
  sets of batch 1 get graphs of their own, counted the same way.
- REGIONAL with AUTO: the blocks see unmarked intermediate tensors, so the first shape set
  compiles static block graphs, and the first shape that changes height and width recompiles
  each block class once with them dynamic; the first that changes the batch (a bucket's short
  last batch), once more with it dynamic (one recompile when a shape changes both first). No
  recompile after that. With DYNAMIC one set of dynamic block graphs.

A pure function of the config, the shape sets and the compile plan, so `--check`, the GUI's
compile line and a test can ask it without a model. The REGIONAL count is in *sets of block
graphs* because the graphs in one set depend on the model's block classes, known only once it
is loaded.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modules.compile.plan import CompilePlan
from modules.config.data import DataConfig, trained_resolutions
from modules.config.schema import CompileScope, DynamicShapes
from modules.geometry import Size, bucket_sizes

Shape = tuple[int, int, int]  # (batch, height, width) in pixels


def possible_sizes(data: DataConfig) -> dict[int, list[Size]]:
    """Per trained resolution, every (height, width) its batches may have: each bucket the
    resolution allows (data.aspect_buckets), else its square. Needs no scan: the most a
    dataset can use, which the GUI shows before any image was read."""
    return {r: (bucket_sizes(r, data.bucket_max_aspect) if data.aspect_buckets else [(r, r)])
            for r in trained_resolutions(data)}


@dataclass(frozen=True)
class CompileCost:
    """The shape sets per resolution and the graphs each scope builds for the denoiser."""
    shapes_per_resolution: Mapping[int, Sequence[Shape]]
    dynamic: DynamicShapes
    static_spatial: bool  # the FULL plan keeps height and width static (one graph per size)
    upper_bound: bool = False  # sizes are every bucket allowed, not those a scan found

    @property
    def shapes(self) -> list[Shape]:
        return sorted({s for listed in self.shapes_per_resolution.values() for s in listed})

    @property
    def spatial(self) -> list[Size]:
        return sorted({(h, w) for _, h, w in self.shapes})

    def _by_batch_of_one(self) -> list[list[Shape]]:
        """The shape sets of batches above 1 and those of batch 1, each group non-empty."""
        groups = [[s for s in self.shapes if s[0] > 1], [s for s in self.shapes if s[0] == 1]]
        return [group for group in groups if group]

    def full_graphs(self) -> int:
        """Graphs a FULL-scope denoiser compiles over the whole run."""
        if self.dynamic == DynamicShapes.STATIC:
            return len(self.shapes)
        if self.static_spatial:
            return sum(len({(h, w) for _, h, w in g}) for g in self._by_batch_of_one())
        return len(self._by_batch_of_one())

    def regional_sets(self) -> int:
        """Sets of block graphs a REGIONAL denoiser compiles over the whole run (one set: a
        graph per block class and layout)."""
        if self.dynamic == DynamicShapes.STATIC:
            return len(self.shapes)
        if self.dynamic == DynamicShapes.DYNAMIC:
            return len(self._by_batch_of_one())
        # AUTO: static first, then dynamic in what changed (spatial, batch) when it first does
        return 1 + (len(self.spatial) > 1) + (len({b for b, _, _ in self.shapes}) > 1)

    def record(self) -> dict:
        """run.json's `compile_estimate`."""
        return {"shape_sets": {str(r): [list(s) for s in shapes]
                               for r, shapes in self.shapes_per_resolution.items()},
                "distinct_shape_sets": len(self.shapes), "full_graphs": self.full_graphs(),
                "regional_block_graph_sets": self.regional_sets(),
                "regional_recompiles_after_first_pass": 0, "upper_bound": self.upper_bound}

    def describe(self) -> str:
        """One line, e.g. "compile: 2 shape sets (64 px: 1, 128 px: 1): FULL builds 1 graph,
        REGIONAL 2 sets of block graphs (static, then dynamic at the first new shape)"."""
        most = "at most " if self.upper_bound else ""
        per = ", ".join(f"{r} px: {len(s)}" for r, s in self.shapes_per_resolution.items())
        sets = self.regional_sets()
        why = {DynamicShapes.STATIC: "one per shape set (compile.dynamic STATIC)",
               DynamicShapes.DYNAMIC: "dynamic from the start"}.get(
            self.dynamic, "static, then each block class recompiles dynamically when the size "
                          "or the batch first changes" if sets > 1 else "one shape set")
        return (f"compile: {most}{len(self.shapes)} shape set(s) ({per}): FULL builds "
                f"{most}{self.full_graphs()} denoiser graph(s), REGIONAL {most}{sets} set(s) of "
                f"block graphs ({why}); no recompile after the first pass over the shapes")


def compile_cost(shapes_per_resolution: Mapping[int, Sequence[Shape]],
                 dynamic: DynamicShapes, full_plan: CompilePlan,
                 upper_bound: bool = False) -> CompileCost:
    """The cost of these shape sets under compile.dynamic, with `full_plan` the denoiser's
    plan in FULL scope (whether it keeps height and width static)."""
    if full_plan.scope != CompileScope.FULL:
        raise ValueError("full_plan must be the denoiser's FULL-scope plan")
    return CompileCost(dict(shapes_per_resolution), dynamic, full_plan.static_spatial is not None,
                       upper_bound)


def possible_shapes(data: DataConfig, batch_size: int) -> dict[int, list[Shape]]:
    """Per resolution, the batch shapes its possible sizes give at full batches (the short
    last batch of a bucket depends on the image count, which only a scan knows)."""
    return {r: [(batch_size, h, w) for h, w in sizes]
            for r, sizes in possible_sizes(data).items()}
