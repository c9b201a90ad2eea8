"""A group of ranks and the parts it owns: bootstrap through the process group's store
(:mod:`.bootstrap`), call identity, agreement and aborts (:mod:`.calls`, :mod:`.signatures`),
options, named heap regions, caches and pacing (:mod:`.options`, :mod:`.regions`,
:mod:`.parts`), the group itself (:mod:`.core`), the process-group glue and the single-process
mode (:mod:`.process_groups`, :mod:`.single_process`).  Internal: the public names
(``init``, ``local_groups``, ``Group``, ``GroupOptions``) are re-exported by :mod:`tide_triton`.
"""
