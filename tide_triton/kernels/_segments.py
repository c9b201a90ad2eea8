"""Former name of :mod:`tide_triton.kernels.segments`, kept while ``tide_triton/bench.py``
(another owner's file) imports ``interpreting`` from here; new code imports the public module."""
from .segments import Binding, SegmentProgram, Span, interpreting, launch_config  # noqa: F401
