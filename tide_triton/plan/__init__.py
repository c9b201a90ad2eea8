"""Plans: which bytes go where and in what order, in pure Python (no torch, Triton or CUDA).

FSDP2's dim-0 sharding (:mod:`.layout`), nodes x local ranks (:mod:`.topology`), the node-local
ring and its flags (:mod:`.schedule`), the across-nodes schedules (:mod:`.across_nodes`) and
their checker (:mod:`.check`), every rank's heap byte layout (:mod:`.heap`), real model layer
shapes (:mod:`.workloads`).  Internal: the public names are re-exported by :mod:`tide_triton`.
"""
