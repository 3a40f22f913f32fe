"""megatron_bfpp: breadth-first pipeline parallelism with schedule-placed sharded data parallelism for Megatron."""

__version__ = "0.1.0"
