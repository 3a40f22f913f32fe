"""The GPU check's Python side (`scripts/gpu_check.py`, driven by `scripts/gpu_check.sh`, which plans, runs and
times the legs).

- `layer`    per-op times of one transformer layer measured on the device, next to the simulator's cost model;
- `summary`  each run against its reference (bf16 losses, step time) and its peak memory against the planner;
             the table and gpu_check.json;
- `cli`      the command line: `probe`, `layer`, `summary`.

Like the device kit, these modules import only the standard library at import time (torch, Megatron-Core and the
simulator inside the functions that need them).
"""
