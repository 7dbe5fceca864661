"""Shared fixtures: one cache of built-in models/datasets per test session, and tiny configs."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# `make test` runs the suite on every core with pytest-xdist (one worker per core). Each worker
# would otherwise start as many torch threads as there are cores, so two workers on CI's two
# cores would fight over them: each worker gets its share, set in the environment before torch
# is imported (the training subprocesses the tests start inherit it) and in torch itself, so the
# test process and its children compute alike. Bit-for-bit comparisons between a run in the
# test process and one in a subprocess (tests/cli/test_resume_cli.py) depend on that: a sum
# over another number of threads differs in the last bit. `same_torch_threads` below fails the
# test that changes the count (a benchmark helper once set it to every core in-process).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
TORCH_THREADS: int | None = None
if _WORKERS > 1:
    TORCH_THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = str(TORCH_THREADS)


# Inductor's compiled code: one empty cache folder per test session, shared by its workers,
# as CI meets it. Without it the suite reads the machine's own cache (/tmp/torchinductor_<user>,
# warm from earlier runs), so a local run is faster than CI's and a graph that no longer
# compiles could pass from an old entry. A developer who wants warm reruns names a folder of
# their own in TORCHINDUCTOR_CACHE_DIR; it is then used as given.
INDUCTOR_CACHE_MADE: str | None = None
if "PYTEST_XDIST_WORKER" not in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    INDUCTOR_CACHE_MADE = tempfile.mkdtemp(prefix="tempera-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = INDUCTOR_CACHE_MADE

from modules.config import Config, apply_overrides  # noqa: E402  (after the thread share)

# The GPU machine's image has no customtkinter (../shared/gpu/README.md): the window tests are
# then not collected at all (their modules import it), and the header says so.
GUI_TOOLKIT_MISSING = importlib.util.find_spec("customtkinter") is None
collect_ignore = ["app"] if GUI_TOOLKIT_MISSING else []


@pytest.fixture(autouse=True)
def same_torch_threads():
    """A test leaves torch's thread count as it found it (see TORCH_THREADS above): under
    xdist each test starts at the worker's share and fails if it leaves another count."""
    if TORCH_THREADS is None:
        yield
        return
    import torch
    torch.set_num_threads(TORCH_THREADS)
    yield
    assert torch.get_num_threads() == TORCH_THREADS, (
        f"this test changed torch's thread count from {TORCH_THREADS} to "
        f"{torch.get_num_threads()}; set it in a subprocess, never in the test process")


# How `make test` spreads the tests over its xdist workers (the hooks below are the only place):
# a work unit is a test file, the known-long ones first (tests/work_units.py). xdist's own
# `loadgroup` cannot do this with pytest 9.2 (it renames items through `_nodeid`, which pytest
# 9.2 no longer reads).
from tests.work_units import UnitClock, slow_first, work_unit  # noqa: E402


def _child_processes() -> set[int]:
    """The live processes whose parent is this one (Linux's /proc; elsewhere none are seen)."""
    me, found = os.getpid(), set()
    proc = "/proc"
    if not os.path.isdir(proc):
        return found
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":  # a zombie holds no CPU
            found.add(int(entry))
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A process a test's body started and left running (a training run the test meant to
    stop, then failed before it did) is killed with its process group when the test ends: one
    such orphan trained on for 35 minutes beside the suite, on CI's two cores. Fixtures'
    processes (started in setup) are left to their fixtures; the test gets a warning."""
    before = _child_processes()
    yield
    import signal
    for pid in sorted(_child_processes() - before):
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else \
                os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        item.warn(pytest.PytestWarning(f"process {pid} the test started was still running at "
                                       "its end: killed"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFileSlowFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "slow_put_first", False):
                slow_first(self.workqueue)
                self.slow_put_first = True
            super()._assign_work_unit(node)

    return ByFileSlowFirst(config, log)


# Each work unit's wall time and worker, printed at the end of a run of more than one unit and
# written as JSON by --work-unit-times=PATH (`make test` writes test-times.json): the units on
# the critical path are what to cut next (docs/contributing.md "Tests and CI time").
_UNIT_CLOCK = UnitClock()


def pytest_runtest_logreport(report):
    if getattr(report, "start", None) is None:
        return
    node = getattr(report, "node", None)   # on xdist's controller: the worker that sent it
    worker = node.gateway.id if node is not None else "main"
    _UNIT_CLOCK.add(report.nodeid, worker, report.start, report.stop, report.duration)


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):   # an xdist worker: the controller reports
        return
    path = config.getoption("--work-unit-times")
    if path:
        _UNIT_CLOCK.write(Path(path))
    if len(_UNIT_CLOCK.units) > 1:
        terminalreporter.write_sep("=", "work units by wall time (tests/work_units.py)")
        for line in _UNIT_CLOCK.lines():
            terminalreporter.write_line(line)


def pytest_addoption(parser):
    parser.addoption("--work-unit-times", default="", metavar="PATH",
                     help="write each work unit's (test file's) wall time and worker, and the "
                          "critical path, to PATH as JSON")
    parser.addoption("--comfyui", default="", metavar="PATH",
                     help="a ComfyUI checkout: the tests that run ComfyUI's own loading code "
                          "(tests/models/comfyui_harness.py) are skipped without it")
    parser.addoption("--a1111", default="", metavar="PATH",
                     help="an A1111 harness folder (or a webui checkout with its repositories/): "
                          "the tests that run A1111's own LoRA and embedding loading code "
                          "(tests/models/a1111_harness.py) are skipped without it")


def opt_in_folder(request, option: str, what: str, see: str = ""):
    """The folder the opt-in `option` names, or skip saying how to give one."""
    path = request.config.getoption(option)
    if not path:
        pytest.skip(f"no {what} given (pytest {option}=PATH{'; ' + see if see else ''})")
    return Path(path)


@pytest.fixture(scope="session")
def comfyui(request):
    """ComfyUI's loading modules from the checkout `--comfyui` names (skipped without it)."""
    from tests.models.comfyui_harness import import_comfyui
    return import_comfyui(opt_in_folder(request, "--comfyui", "ComfyUI checkout"))


@pytest.fixture(scope="session")
def a1111(request):
    """A1111's LoRA loader and the ldm / sgm UNets from the folder `--a1111` names (skipped
    without it)."""
    from tests.models.a1111_harness import import_a1111
    return import_a1111(opt_in_folder(request, "--a1111", "A1111 harness folder",
                                      "docs/lora_tools.md"))


@pytest.fixture(scope="session")
def a1111_textual_inversion(request):
    """A1111's textual-inversion loader from the folder `--a1111` names (skipped without it)."""
    from tests.models.a1111_harness import import_a1111_textual_inversion
    folder = opt_in_folder(request, "--a1111", "A1111 harness folder", "docs/lora_tools.md")
    return import_a1111_textual_inversion(folder)


def pytest_report_header(config):
    lines = [f"inductor cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR')} ("
             + ("empty, this session's" if INDUCTOR_CACHE_MADE else "given, used as it is")
             + ")"]
    if GUI_TOOLKIT_MISSING:
        lines.append("tests/app not collected: customtkinter is not installed (the GUI tests "
                     "need it)")
    return lines


def pytest_unconfigure(config):
    if INDUCTOR_CACHE_MADE and not hasattr(config, "workerinput"):
        import shutil
        shutil.rmtree(INDUCTOR_CACHE_MADE, ignore_errors=True)


@pytest.fixture(scope="session")
def tempera_cache(tmp_path_factory):
    """A cache folder shared by the whole session, so each built-in model is built once."""
    return tmp_path_factory.mktemp("tempera-cache")


@pytest.fixture(scope="session")
def zimage_folder(tempera_cache):
    """The tiny Z-Image (builtin:tiny-zimage), built once per session into the cache."""
    from modules.model_types import MODEL_TYPES, ModelType
    from modules.models.tiny import ensure_builtin_model
    return ensure_builtin_model(MODEL_TYPES[ModelType.ZIMAGE].builtin, tempera_cache)


@pytest.fixture
def fresh_dynamo():
    """No compiled frames from earlier tests, before or after (dynamo's caches are
    process-global): for tests that count recompiles. tests/compile and tests/gpu use their own
    autouse one."""
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def tiny_config(tempera_cache, tmp_path):
    """A config that trains the tiny SD 1.5 model on the shapes dataset in a few seconds."""
    def make(*overrides: str) -> Config:
        base = [
            f"general.cache_dir={tempera_cache}",
            f"output.dir={tmp_path / 'out'}",
            "data.resolution=64",
            "training.max_steps=3",
            "training.batch_size=2",
            "training.learning_rate=1e-3",
            "sampling.prompts=[]",
            "logging.tensorboard=false",
        ]
        return apply_overrides(Config(), base + list(overrides))
    return make


class Pipelines:
    """Load a saved SD 1.x diffusers folder as a pipeline and render one fixed-seed image."""

    @staticmethod
    def load(model_folder):
        from diffusers import StableDiffusionPipeline
        pipe = StableDiffusionPipeline.from_pretrained(model_folder, safety_checker=None,
                                                       local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @staticmethod
    def image(pipe, prompt: str = "a red circle"):
        import torch
        out = pipe(prompt, height=64, width=64, num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0), output_type="pt")
        return out.images


@pytest.fixture
def pipelines() -> Pipelines:
    return Pipelines()
