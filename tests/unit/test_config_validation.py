"""Bad trainer configurations are rejected before any process group exists, each with one line naming the flag.

Every case runs `parse_trainer_args(argv, world_size=N)` in this process (the checks need no torch.distributed)
and expects a TrainerConfigError (the trainer's `main` turns it into exit code 2, checked below) or argparse's
own exit 2 for values outside a flag's choices.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from megatron_bfpp.train.config import TrainerConfigError, parse_trainer_args

BASE = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3"]
GPIPE = ["--pipeline-schedule", "gpipe"]
GROUP = ["--microbatch-group-size-per-virtual-pipeline-stage"]


def _with(base: list[str], **flags: str | None) -> list[str]:
    """BASE with flags replaced or added (--flag-name from flag_name; None value: a bare switch)."""
    argv = list(base)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
        argv += [flag] if value is None else [flag, str(value)]
    return argv


def _dirs(tmp_path) -> dict[str, str]:
    empty = tmp_path / "empty"
    empty.mkdir()
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "latest_checkpointed_iteration.txt").write_text("7")
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "latest_checkpointed_iteration.txt").write_text("seven")
    return {"empty": str(empty), "dangling": str(dangling), "garbled": str(garbled),
            "missing": str(tmp_path / "nope"), "data": str(tmp_path / "corpus")}


# (id, argv builder, world size, text the message must contain)
CASES = [
    ("layers-by-P", lambda d: _with(BASE + GPIPE, num_layers=6, pipeline_model_parallel_size=4), 4,
     "--num-layers 6"),
    ("layers-by-P-x-layers-per-virtual-stage",
     lambda d: _with(BASE, num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
     2, "--num-layers-per-virtual-pipeline-stage 3"),
    ("world-by-P", lambda d: _with(BASE + GPIPE, pipeline_model_parallel_size=2), 3,
     "--pipeline-model-parallel-size 2"),
    ("global-batch-by-micro-batch-x-D", lambda d: _with(BASE + GPIPE, global_batch_size=6, micro_batch_size=2), 2,
     "--global-batch-size 6"),
    ("heads-by-T", lambda d: _with(BASE + GPIPE, num_attention_heads=3, hidden_size=18,
                                   tensor_model_parallel_size=2), 2, "--num-attention-heads 3"),
    ("T-unsupported", lambda d: _with(BASE + GPIPE, tensor_model_parallel_size=2), 2,
     "--tensor-model-parallel-size"),
    ("hidden-by-heads", lambda d: _with(BASE + GPIPE, hidden_size=18, num_attention_heads=4), 1, "--hidden-size 18"),
    ("query-groups-by-heads", lambda d: _with(BASE + GPIPE, group_query_attention=None, num_query_groups=3), 1,
     "--num-query-groups 3"),
    ("seq-beyond-positions", lambda d: _with(BASE + GPIPE, max_position_embeddings=8), 1, "--seq-length 16"),
    ("interleaved-M-below-P", lambda d: _with(BASE, pipeline_schedule="interleaved-1f1b", num_layers=8,
                                              pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1,
                                              global_batch_size=2), 4, "--global-batch-size"),
    ("group-size-below-P", lambda d: _with(BASE, pipeline_schedule="interleaved-1f1b", pipeline_model_parallel_size=2,
                                           num_layers_per_virtual_pipeline_stage=1) + GROUP + ["1"], 2,
     "--microbatch-group-size-per-virtual-pipeline-stage"),
    ("group-size-above-M", lambda d: _with(BASE, pipeline_schedule="interleaved-1f1b", pipeline_model_parallel_size=2,
                                           num_layers_per_virtual_pipeline_stage=1) + GROUP + ["16"], 2,
     "--microbatch-group-size-per-virtual-pipeline-stage"),
    # V = 1 in groups smaller than M: not GPipe (which V = 1 without groups runs, see below), refused.
    ("breadth-first-groups-need-V", lambda d: _with(BASE, pipeline_schedule="breadth-first",
                                                    microbatch_group_size_per_virtual_pipeline_stage=2), 1,
     "--pipeline-schedule"),
    ("interleaved-needs-V", lambda d: _with(BASE, pipeline_schedule="interleaved-1f1b",
                                            pipeline_model_parallel_size=2), 2, "--pipeline-schedule"),
    ("fp16-without-loss-scaling", lambda d: _with(BASE + GPIPE, fp16=None, loss_scale=1), 1, "--loss-scale"),
    ("fp16-and-bf16", lambda d: _with(BASE + GPIPE, fp16=None, bf16=None), 1, "--bf16"),
    ("missing-data-files", lambda d: _with(BASE + GPIPE, data_path=d["data"]), 1, "--data-path"),
    ("load-missing-dir", lambda d: _with(BASE + GPIPE, load=d["missing"]), 1, "--load"),
    ("load-empty-dir", lambda d: _with(BASE + GPIPE, load=d["empty"]), 1, "--load"),
    ("load-dangling-tracker", lambda d: _with(BASE + GPIPE, load=d["dangling"]), 1, "--load"),
    ("load-garbled-tracker", lambda d: _with(BASE + GPIPE, load=d["garbled"]), 1, "--load"),
    ("load-empty-exit-on-missing", lambda d: _with(BASE + GPIPE, load=d["empty"], save=d["empty"],
                                                   exit_on_missing_checkpoint=None), 1, "--exit-on-missing-checkpoint"),
    ("ckpt-step-without-load", lambda d: _with(BASE + GPIPE, ckpt_step=3), 1, "--ckpt-step"),
    ("save-interval-without-save", lambda d: _with(BASE + GPIPE, save_interval=2), 1, "--save-interval"),
    ("save-interval-zero", lambda d: _with(BASE + GPIPE, save=d["empty"], save_interval=0), 1, "--save-interval"),
    ("exit-interval-zero", lambda d: _with(BASE + GPIPE, exit_interval=0), 1, "--exit-interval"),
    ("checkpoint-format", lambda d: _with(BASE + GPIPE, save=d["empty"], ckpt_format="torch"), 1, "--ckpt-format"),
    ("async-save", lambda d: _with(BASE + GPIPE, save=d["empty"], async_save=None), 1, "--async-save"),
    ("timeout-seconds", lambda d: _with(BASE + GPIPE, distributed_timeout_seconds=0), 1,
     "--distributed-timeout-seconds"),
    ("timeout-minutes", lambda d: _with(BASE + GPIPE, distributed_timeout_minutes=0), 1,
     "--distributed-timeout-minutes"),
    ("distributed-optimizer-flag", lambda d: _with(BASE + GPIPE, use_distributed_optimizer=None), 1,
     "--use-distributed-optimizer"),
    ("weight-buffers-without-zero-3", lambda d: _with(BASE + GPIPE, bfpp_weight_buffers=2), 1,
     "--bfpp-weight-buffers"),
    ("grad-buffers-with-zero-1", lambda d: _with(BASE + GPIPE, bfpp_grad_buffers=2), 1, "--bfpp-grad-buffers"),
    ("timeline-iteration-range", lambda d: _with(BASE + GPIPE, timeline="t.json", timeline_iterations="9"), 1,
     "--timeline-iterations 9"),
    ("timeline-iterations-without-timeline", lambda d: _with(BASE + GPIPE, timeline_iterations="2"), 1,
     "--timeline"),
    ("train-iters-zero", lambda d: _with(BASE + GPIPE, train_iters=0), 1, "--train-iters"),
    ("context-parallel", lambda d: _with(BASE + GPIPE, context_parallel_size=2), 2, "--context-parallel-size"),
]


@pytest.fixture(autouse=True)
def _no_fault_env(monkeypatch):
    monkeypatch.delenv("BFPP_FAULT_INJECT", raising=False)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_configuration_is_rejected_before_process_groups(case, tmp_path):
    _, build, world, needle = case
    with pytest.raises(TrainerConfigError) as info:
        parse_trainer_args(build(_dirs(tmp_path)), world_size=world)
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message.strip(), message
    assert not dist.is_initialized()


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_choice_outside_range_exits_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        parse_trainer_args(_with(BASE + GPIPE, zero_stage=4), world_size=1)
    assert info.value.code == 2
    assert "--zero-stage" in capsys.readouterr().err


def test_unsupported_megatron_core_version(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.18.0")
    with pytest.raises(TrainerConfigError) as info:
        parse_trainer_args(BASE + GPIPE, world_size=1)
    assert "megatron-core 0.18" in str(info.value) and "0.19" in str(info.value)
    assert not dist.is_initialized()


def test_malformed_fault_injection_spec(monkeypatch):
    monkeypatch.setenv("BFPP_FAULT_INJECT", "rank=1,point=somewhere")
    with pytest.raises(TrainerConfigError) as info:
        parse_trainer_args(BASE + GPIPE, world_size=1)
    assert "BFPP_FAULT_INJECT" in str(info.value)


def test_trainer_main_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    from megatron_bfpp.train import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    rc = main(_with(BASE + GPIPE, load=str(tmp_path / "nope")))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: --load ") and "no such directory" in err[0]
    assert not dist.is_initialized()


def test_valid_configurations_pass(tmp_path):
    # The same checks accept the layouts the checkpoint tests use, and --save DIR --load DIR on an empty DIR
    # (a restartable job's first run).
    ckpt = str(tmp_path / "ckpt")
    for argv, world in (
        (_with(BASE, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
               pipeline_schedule="breadth-first", zero_stage=3), 4),
        (_with(BASE, num_layers_per_virtual_pipeline_stage=2, pipeline_schedule="breadth-first", zero_stage=3), 4),
        (_with(BASE + GPIPE, pipeline_model_parallel_size=2, save=ckpt, load=ckpt, save_interval=2), 2),
        (_with(BASE + GPIPE, fp16=None), 1),
    ):
        args = parse_trainer_args(argv, world_size=world)
        assert args.global_batch_size == 8
    assert not os.path.exists(ckpt)
    assert not dist.is_initialized()


@pytest.mark.parametrize("pp, world", [(1, 1), (1, 2), (2, 2)])
def test_breadth_first_with_one_stage_per_rank_runs_gpipe(pp, world, monkeypatch):
    """The default schedule (breadth-first) with V = 1 is GPipe: run as gpipe, said in one note, on rank 0."""
    notes = []
    argv = _with(BASE, pipeline_model_parallel_size=pp)
    args = parse_trainer_args(argv, world_size=world, log=notes.append)
    assert args.pipeline_schedule == "gpipe" and args.virtual_pipeline_model_parallel_size is None
    assert args.microbatch_group_size_per_vp_stage is None
    assert len(notes) == 1 and "is GPipe" in notes[0] and "breadth-first" in notes[0], notes
    # A group size covering all M micro-batches is the same schedule.
    args = parse_trainer_args(_with(argv, microbatch_group_size_per_virtual_pipeline_stage=8 * pp // world),
                              world_size=world, log=None)
    assert args.pipeline_schedule == "gpipe"
    # With virtual stages breadth-first stays breadth-first, silently.
    notes.clear()
    args = parse_trainer_args(_with(argv, num_layers_per_virtual_pipeline_stage=1), world_size=world,
                              log=notes.append)
    assert args.pipeline_schedule == "breadth-first" and not notes


def test_gpipe_note_is_printed_by_rank_0_only(monkeypatch, capsys):
    for rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        parse_trainer_args(BASE, world_size=2)
        out = capsys.readouterr().out
        assert out.count("is GPipe: running gpipe") == expected, out
