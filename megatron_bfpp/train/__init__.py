"""The standalone trainer (`bfpp train`): a GPT built from Megatron-Core layers, trained by the plugin's runtime
and sharded optimizer on N local processes, without Megatron-LM's training loop.

- `loop`: the `Trainer` (build, train steps, checkpoints) and `main`, one process's entry point;
- `config`: its flags (Megatron's argument parser plus ours) and their checks;
- `launcher`: `bfpp train`, which starts the processes under torchrun;
- `report`: what the run reports need from the live run (per-rank stats gathered to rank 0, configuration,
  prediction), handed to `trace.run_report`;
- `checkpoint`, `faults`, `data`, `model`, `parallel`: checkpoints, failure handling, data, the model chunks,
  the process groups.
"""

from .loop import Trainer, main

__all__ = ["Trainer", "main"]
