"""How bytes move between ranks (copy engines, NCCL, host shared memory)."""
__all__: list[str] = []
