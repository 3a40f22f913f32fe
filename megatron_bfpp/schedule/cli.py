"""`bfpp schedule`: build, lower and validate a schedule and print it as text, JSON or CSV."""

from __future__ import annotations

import argparse
import sys

from .formats import to_csv, to_json
from .ir import ScheduleError
from .kinds import SCHEDULE_NAMES
from .spec import ScheduleSpec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bfpp schedule", description=__doc__)
    p.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size P")
    p.add_argument("--vp", type=int, default=1, help="stages per pipeline rank V (default 1)")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step M")
    p.add_argument("--group-size", type=int, default=None,
                   help="interleaved: Megatron's micro-batch group size (default P); breadth-first: micro-batches "
                        "per breadth-first group (default M)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=None,
                   help="add data-parallel GATHER/RELEASE/REDUCE for this ZeRO stage and, for training, the step "
                        "boundary: STEP per stage and the all-gathers after it (implies --lowered)")
    p.add_argument("--weight-buffers", type=int, default=2)
    p.add_argument("--grad-buffers", type=int, default=2)
    p.add_argument("--w-needs-weights", choices=("yes", "no"), default="yes",
                   help="no: a W computes weight gradients from kept activations alone, so ZeRO-3 may release a "
                        "stage's weights after its last F/B/I (the runtime on Megatron-Core's local linears)")
    p.add_argument("--i-writes-grads", choices=("yes", "no"), default="no",
                   help="yes: an I writes its stage's gradient buffer (layers with gradient-accumulation fusion that "
                        "run their backward whole at I), so ZeRO-2/3 hold a stage's gradient buffer from its first I "
                        "instead of its first W")
    p.add_argument("--optimizer-step", choices=("yes", "no"), default="yes",
                   help="no: leave the optimizer step out of the schedule (an optimizer that steps outside it, as "
                        "stock Megatron's)")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--lowered", action="store_true", help="include p2p (and data-parallel) actions")
    p.add_argument("--format", choices=("text", "json", "csv"), default="text")
    return p


def spec_from_args(args: argparse.Namespace) -> ScheduleSpec:
    """The schedule the parsed flags name."""
    return ScheduleSpec(
        args.schedule, args.pp, args.vp, args.microbatches, args.group_size, zero_stage=args.zero_stage,
        forward_only=args.forward_only, weight_buffers=args.weight_buffers, grad_buffers=args.grad_buffers,
        w_needs_weights=args.w_needs_weights == "yes", i_writes_grads=args.i_writes_grads == "yes",
        optimizer_step=args.optimizer_step == "yes",
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        sched = spec_from_args(args).build(lowered=args.lowered or args.zero_stage is not None)
    except ScheduleError as e:
        print(f"bfpp schedule: error: {e}", file=sys.stderr)
        return 2
    out = {"text": sched.to_text, "json": lambda: to_json(sched) + "\n", "csv": lambda: to_csv(sched)}[args.format]()
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
