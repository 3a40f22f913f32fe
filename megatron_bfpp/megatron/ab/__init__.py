"""The A/B driver (`scripts/ab_megatron.py`): stock Megatron-LM's `pretrain_gpt.py` against the plugin, side by side.

- `commands` the variants, the layout, the flags every variant shares, each run's command and environment (pure:
             nothing here starts a process);
- `logs`     Megatron-LM's training log lines: iterations, memory, the plugin's deferral count;
- `report`   what counts as a run, the per-variant medians, ratios and same-model check, the CSVs and the PNG;
- `run`      what starts processes: the TransformerEngine probe, the project's flag check, the runs themselves;
- `cli`      the command line (`main(argv)`), whose `--help` is the driver's documentation.
"""
