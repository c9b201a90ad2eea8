"""Executors: how a collective runs once its arguments are checked and agreed.

The node-local ring, written once (:mod:`.ring`), run eagerly (:mod:`.node_local`) or as a
prepared run (:mod:`.prepared`, prepared by :mod:`.prepare`, recorded and replayed by
:mod:`.recorded`); across declared nodes (:mod:`.across_nodes`); over NVSwitch multicast
(:mod:`.multicast`).  Shared parts: ``Work`` and streams (:mod:`.work`), copy plans
(:mod:`.copy_plan`), the executors' per-group state (:mod:`.state`), the all-gather block
(:mod:`.ag_block`), held tensors' checks (:mod:`.held`).  Internal.
"""
