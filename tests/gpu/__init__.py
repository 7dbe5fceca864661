"""CUDA-only tests (tests/gpu/conftest.py skips them without a GPU). A regular package, as
`tests` is: `tests.gpu.scenarios` must be this folder's."""
