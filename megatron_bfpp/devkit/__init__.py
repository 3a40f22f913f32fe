"""Device kit: one command that checks the CUDA/NCCL path on a borrowed one-GPU machine without a package index.

`scripts/device_check.sh` is its entry point. The subpackage:

- `plan`     the legs (what each runs and shows, estimated seconds per device), the time budget, the grouping of
             the legs' logs into at most 8 result files and the report's shape; pure Python, no torch.
- `prepare`  builds the kit on a machine with the package registry: the wheels a bare torch environment lacks,
             this project's wheel and a Megatron-LM source tarball, under a size cap; prints the paths to carry.
- `run`      installs the kit offline next to the machine's torch, runs the legs within the budget and writes
             `device_report.json` (rewritten before and after every leg) and the logs.
- `processes` a leg's processes: output straight to its log, a deadline on every wait, every process of the leg
             (torchrun's workers in their own sessions included) ended, none outliving the kit.
- `outputs`  what a leg's output says: NCCL's WARN lines as NCCL prints them, NCCL's refusals at initialisation,
             the workers' error lines (not torchrun's banner), iterations reached, ranks whose start-up passed.
- `judge`    a leg's verdict (pass, fail, refused) from how its processes ended and what they printed.
- `collectives` in the workers: torch.distributed's calls counted by group size and the start-up mark; in the
             kit: their summary for the report.
- `probe`    a stdlib-only script run by path: what the bare environment already has (with --device cuda, first
             the GPU's compute mode, then whether CUDA and NCCL work), and whether the legs can run on it.
- `iterations` Megatron-style iteration lines and the bf16 loss agreement with a reference run.
- `gpu_check` the Python side of the multi-GPU check (`scripts/gpu_check.sh`): its probe, layer benchmark and
             summary, on the kit's iteration lines, probes and memory prediction.

Every module but `workers` imports only the standard library at import time (`collectives` imports torch only
inside the worker's `instrument`), so the kit starts before anything is installed.
"""
