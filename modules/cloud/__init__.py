"""Cloud runs started by a git push: training repos, the post-receive hook, the run queue.

See docs/cloud.md. The flow: `init` a training repo, `install-hook` into a bare repository on
the GPU machine, `git push` (or `push-and-train`), then `status`. The GitHub Actions template
runs the same code path (`run-changed`).
"""
