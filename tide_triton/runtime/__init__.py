"""Process-wide services every layer may use: environment variables (:mod:`.envs`), argument
checks (:mod:`.checks`), the host's stand-in for a CUDA graph capture (:mod:`.host_capture`),
profiler ranges (:mod:`.profiling`), the stall watcher (:mod:`.stall_watch`) and the
device-wide settle before driver calls that wait for every stream (:mod:`.device_wide`).
Internal.
"""
