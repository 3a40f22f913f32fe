"""The A/B driver (`scripts/ab_megatron.py`): stock Megatron-LM's `pretrain_gpt.py` against the plugin, side by side.

- `commands` the variants, the layout, the flags every variant shares, each run's command and environment (pure:
             nothing here starts a process);
- `plan_file` a `bfpp plan --json` file: a candidate's flags, its checks against the launch and the flags beside it
             (also the SLURM scripts' reader, `python -m megatron_bfpp.megatron.ab.plan_file`);
- `logs`     Megatron-LM's training log lines: iterations, memory, the plugin's deferral count;
- `report`   what counts as a run, the per-variant medians, ratios (per round too) and same-model check, the
             CSVs, the rounds' table and the PNG;
- `run`      what starts processes: the TransformerEngine probe, the project's flag check, the runs themselves;
- `cli`      the command line (`main(argv)`), whose `--help` is the driver's documentation.
"""
