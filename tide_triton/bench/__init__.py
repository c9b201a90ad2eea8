"""Kernel benchmarks, ``python -m tide_triton.bench``: the command line (``__main__``), the
measurements (:mod:`.measure`), their tables and plots (:mod:`.report`) and the console
helpers (:mod:`.cli`).  Not imported by the library; the scripts of ``bench/`` build on it.
"""
