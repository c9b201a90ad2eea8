"""Real model layer shapes (one FSDP unit each), embedded with the package.

``layer_shapes("llama-3.1-70b")`` gives the parameter shapes of one decoder layer; the
benchmarks and tests shard them with :class:`~tide_triton.ShardLayout`.

``synthetic-moe-256e`` is not a published model: 256 experts x 3 matrices of [512, 1024]
(771 parameters, DeepSeek-V3's expert count at a size one GPU holds for several ranks).  It
exists because a collective's host cost grows with the number of parameters per FSDP unit
(copy descriptors, flag operations), and that is where it shows most.  Tests that iterate
:data:`MODELS` under the interpreter use :func:`scaled_shapes`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

MODELS = ("llama-3.1-70b", "qwen3-30b-a3b", "wan2.2-14b", "synthetic-moe-256e")


@lru_cache(maxsize=None)
def _data() -> dict:
    return json.loads(resources.files("tide_triton").joinpath("workloads.json").read_text())


def _model(name: str) -> dict:
    data = _data()
    if name not in data or name.startswith("_"):
        known = ", ".join(k for k in data if not k.startswith("_"))
        raise ValueError(f"model must be one of {known}, got {name!r}")
    return data[name]


def layer_shapes(name: str) -> tuple[tuple[int, ...], ...]:
    """Parameter shapes of one repeated unit (decoder layer / DiT block) of ``name``."""
    return tuple(tuple(s) for _, s in _model(name)["params"])


def layer_names(name: str) -> tuple[str, ...]:
    return tuple(n for n, _ in _model(name)["params"])


def scaled_shapes(name: str, factor: int) -> tuple[tuple[int, ...], ...]:
    """The layer's shapes with every dim divided by ``factor`` (at least 1): the same
    structure (1-D, 3-D, dim 0 smaller than the world size) at a size the Triton
    interpreter can run."""
    return tuple(tuple(max(1, d // factor) for d in s) for s in layer_shapes(name))
