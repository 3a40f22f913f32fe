"""Checks of Megatron-LM's `--pipeline-model-parallel-layout`, before any process group exists.

A layout such as `E|tt|t|t|t|L` lists the stages in order, separated by `|`: `E` the embedding, `t` a decoder
layer, `L` the output layer and loss (`m` an MTP layer). Stage s runs on pipeline rank s mod P as its virtual chunk
s // P, so V = stages / P (Megatron-LM's `validate_args` sets `args.virtual_pipeline_model_parallel_size` from
it and refuses a stage count that is not a multiple of P). A stage may hold no decoder layer (`E` or `L` alone) or
nothing at all; the plugin's runtime and sharded data parallelism run every such stage as Megatron builds it.

Megatron-Core checks the rest of the layout only when it builds the model's config, after the process groups
exist (`PipelineParallelLayerLayout.validate_layer_layout`: `E` first, `L` last, as many `t` as --num-layers;
`TransformerConfig`: no other layer split beside it);
`layout_problem` runs that check on the arguments instead, so that `install` and the check command
(`validation.validate_args`) refuse a bad layout at once, with Megatron's own parser and validator.
"""

from __future__ import annotations

import argparse

from ..schedule.kinds import KINDS, ScheduleKind

FLAG = "--pipeline-model-parallel-layout"
# The other ways to split layers over stages: (argument name, flag)
_OTHER_SPLIT_FLAGS = (("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
                      ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
                      ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
                      ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"))


def _stages(layout: str) -> list[str]:
    """Each stage of `layout` as a string of layer characters (Megatron's parser: `(tt|)*3` unrolled, commas
    dropped)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    symbols = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}
    return ["".join(symbols.get(layer.name, "?") for layer in stage)
            for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)]


def _where_megatron_builds(stages: list[str]) -> list[str]:
    """`stages` with `E` moved to the start of the first stage and `L` to the end of the last: where Megatron
    builds the embedding and the output layer whatever the layout says (pre_process on the first pipeline rank's
    first chunk, post_process on the last rank's last chunk; megatron/training/training.py get_model)."""
    moved = [s.replace("E", "").replace("L", "") for s in stages]
    moved[0], moved[-1] = "E" + moved[0], moved[-1] + "L"
    return moved


def layout_problem(args: argparse.Namespace, runtime: bool) -> str | None:
    """What is wrong with `--pipeline-model-parallel-layout` (the message, naming the flag and what to change), or
    None: a layout Megatron-Core would refuse once it builds the model; under the plugin's runtime (`runtime`) also
    one whose `E` or `L` is not where Megatron builds the embedding and loss (after an empty first stage, or
    before an empty last one), since the stages it states are not the ones that run."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if not layout:
        return None
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    # Megatron-Core's TransformerConfig refuses these beside a layout (which places every layer itself).
    others = [flag for name, flag in _OTHER_SPLIT_FLAGS if getattr(args, name, None) not in (None, False)]
    if others:
        return (f"{FLAG} {layout!r} with {' and '.join(others)}: Megatron-Core refuses them together when it builds "
                f"the model (the layout places every layer itself); drop {' and '.join(others)}")
    try:
        stages = _stages(layout)
    except AssertionError as e:  # a character Megatron's parser does not know (its validate_args says so first)
        return f"{FLAG} {layout!r}: {e}"
    decoders = sum(s.count("t") for s in stages)
    num_layers = getattr(args, "num_layers", None)
    if num_layers is not None and decoders != int(num_layers):
        return (f"{FLAG} {layout!r} places {decoders} decoder layers ('t') and --num-layers is {num_layers}: give "
                f"the layout exactly {num_layers} 't' or set --num-layers {decoders}")
    try:
        parsed = PipelineParallelLayerLayout(layout, int(args.pipeline_model_parallel_size))
        mtp_standalone = parsed.validate_layer_layout(num_layers=decoders,
                                                      mtp_num_layers=getattr(args, "mtp_num_layers", None))
    except (AssertionError, ValueError, NotImplementedError) as e:
        return f"{FLAG} {layout!r}: Megatron-Core refuses it when it builds the model: {e}"
    if runtime and mtp_standalone:
        # The MTP stage sends its hidden states and the MTP layers' concatenated along the sequence (GPTModel's
        # _postprocess), so Megatron exchanges each p2p tensor's shape first (p2p_communication.py,
        # `config.mtp_standalone`); the plugin's p2p sends every stage boundary one activation shape.
        return (f"{FLAG} {layout!r} puts the MTP layers ('m') on a pipeline rank before the last (standalone MTP): "
                "that stage sends (1 + --mtp-num-layers) sequences of hidden states, another shape than the other "
                "stage boundaries, and the plugin's schedule runtime sends one shape; put the 'm' in the last stage, "
                "before its 'L', or use --pipeline-schedule default")
    built = _where_megatron_builds(stages)
    if runtime and built != stages:
        return (f"{FLAG} {layout!r}: 'E' must open the first stage and 'L' close the last ({len(stages)} stages): "
                "Megatron builds the embedding on the first stage and the output layer and loss on the last "
                f"whatever the layout says, so this one does not state the stages that run; write "
                f"{'|'.join(built)!r}")
    return None


def _alternatives(kind: ScheduleKind, vp: int) -> str:
    """The --pipeline-schedule values that run V stages per rank, with a split backward where `kind` has one."""
    names = [k.name for k in KINDS.values()
             if k.megatron_choice and k.fits_stages(vp) and k.split_backward == kind.split_backward]
    return " or ".join(names)


def layout_stage_count_problem(args: argparse.Namespace, kind: ScheduleKind, vp: int) -> str | None:
    """Where the layout's V breaks the rule of schedule `kind` (V >= 2, or V = 1): the message, which says how many
    stages the layout needs in place of the flags that set V without a layout (Megatron refuses them beside one);
    None otherwise."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if not layout or kind.fits_stages(vp):
        return None
    pp = int(args.pipeline_model_parallel_size)
    have = f"{FLAG} {layout!r} has {len(_stages(layout))} stages for P={pp} (V = {vp})"
    if kind.virtual_stages:
        need = f"needs virtual stages: {have}; split it into a multiple of {pp} stages, at least {2 * pp}"
    else:
        need = f"runs one stage per rank: {have}; give it {pp} stages"
    return f"--pipeline-schedule {kind.name} {need}, or use --pipeline-schedule {_alternatives(kind, vp)} at V = {vp}"
