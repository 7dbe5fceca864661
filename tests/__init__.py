"""Tempera's tests. A regular package (not a namespace one), so that a stray `tests` package
installed on a machine (the GPU image's site-packages, say) cannot shadow this one."""
