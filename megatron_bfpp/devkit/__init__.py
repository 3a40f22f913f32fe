"""Device kit: one command that checks the CUDA/NCCL path on a borrowed one-GPU machine without a package index.

`scripts/device_check.sh` is its entry point. The subpackage:

- `plan`     the legs (what each runs and shows, estimated seconds per device), the time budget, the grouping of
             the legs' logs into at most 8 result files and the report's shape; pure Python, no torch.
- `prepare`  builds the kit on a machine with the package registry: the wheels a bare torch environment lacks,
             this project's wheel and a Megatron-LM source tarball, under a size cap; prints the paths to carry.
- `run`      installs the kit offline next to the machine's torch, runs the legs within the budget and writes
             `device_report.json` and the logs.
- `workers`  what the legs run besides the trainer: the Megatron-LM script runner with the kit's dataset
             helpers, the host-synchronisation count, peak memory against the simulator, the environment facts.
- `probe`    a stdlib-only script run by path: what the bare environment already has.
- `iterations` Megatron-style iteration lines and the bf16 loss agreement with a reference run.
- `gpu_check` the Python side of the multi-GPU check (`scripts/gpu_check.sh`): its probe, layer benchmark and
             summary, on the kit's iteration lines, probes and memory prediction.

Every module but `workers` imports only the standard library at import time, so the kit starts before anything
is installed.
"""
