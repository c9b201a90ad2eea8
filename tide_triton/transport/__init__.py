"""How bytes move between ranks (copy engines, NCCL, host shared memory).  Internal."""
