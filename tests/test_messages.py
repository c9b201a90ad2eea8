"""Error messages say how to fix (issue: the first hour): a shape error shows the rule and
both accepted shapes, a non-contiguous input suggests ``.contiguous()``.  (The field-level
``ArgumentMismatchError`` is pinned in tests/test_faults.py and tests/test_hier_host.py.)"""
from __future__ import annotations

import pytest
import torch

import tide_triton as tt


@pytest.fixture(scope="module")
def group():
    g = tt.local_groups(1)[0]
    yield g
    g.close()


def test_shard_shape_error_shows_the_rule_and_both_shapes() -> None:
    layout = tt.ShardLayout([(10, 6), (7,)], world_size=4)
    rule = layout.shard_rule(0, 3)
    assert rule == ("parameter 0 has dim 0 = 10; FSDP2 gives each of the 4 ranks ceil(10 / 4) = 3 rows, and "
                    "rank 3 holds rows [9, 12) of which 1 are real (unpadded shard: 1 rows; padded: 3); shapes "
                    "come from ShardLayout(...).shard_shapes(3)")
    grads = [[torch.ones(s, dtype=torch.bfloat16) for s in layout.shapes]] * 4
    shards = [torch.empty(2, 6), torch.empty(1)]
    with pytest.raises(ValueError, match=r"shards\[0\] must have shape \(1, 6\) or padded \(3, 6\), got "
                                         r"\(2, 6\) \(parameter 0 has dim 0 = 10; .*ceil\(10 / 4\) = 3 rows"):
        tt.accumulate_shards(grads, shards, layout, 3)


def test_collective_shape_error_shows_the_rule(group) -> None:
    grads = [torch.ones(10, 6, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"shards\[0\] must have shape \(10, 6\), got \(3, 6\) \(parameter 0 "
                                         r"has dim 0 = 10; FSDP2 gives each of the 1 ranks"):
        tt.reduce_scatter(grads, [torch.empty(3, 6)], group=group)


def test_non_contiguous_input_suggests_contiguous(group) -> None:
    grads = [torch.ones(10, 6, dtype=torch.bfloat16).t()]
    with pytest.raises(ValueError, match=r"grads\[0\] must be contiguous, got strides \(1, 6\) for shape "
                                         r"\(6, 10\): pass grads\[0\]\.contiguous\(\)"):
        tt.reduce_scatter(grads, [torch.empty(6, 10)], group=group)
