"""The environment of a child Python process that a test starts (tempera-train, the worker):
the repository first on PYTHONPATH, every entry it already had kept. The one definition is in
`modules.util.process`, which the GPU validation's jobs use too."""
from modules.util.process import REPO, with_repo_on_pythonpath

__all__ = ["REPO", "with_repo_on_pythonpath"]
