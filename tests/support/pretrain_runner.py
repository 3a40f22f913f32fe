"""Run a Megatron-LM training script and record what its iteration log lines print, at full precision.

    torchrun ... tests/support/pretrain_runner.py [--launch] SCRIPT.py [script flags...]

Megatron prints the grad norm with three decimals; to compare runs to rtol 1e-5 this runner wraps
`megatron.training.training.training_log` (Megatron's own logging function, which still runs and prints) and
appends one JSON line per call to `$BFPP_PRETRAIN_RECORD` on the last rank: iteration, the losses of
`loss_dict`, grad norm, params norm, num zeros, loss scale, skipped iteration. Then it runs SCRIPT as
`__main__` (a patched checkout) or, with `--launch`, through `python -m megatron_bfpp.run_megatron_script` (unpatched).

Fault injection (test-only, the same for stock and plugin runs): `BFPP_PRETRAIN_NAN_GRAD=ITER:NAME` turns the
first element of the gradient of every parameter whose name contains NAME into NaN during iteration ITER
(1-based, as logged; every run of that iteration, reruns included), through a tensor hook on the parameter:
autograd hands the NaN to whatever accumulates the gradient (Megatron's DDP, the sharded wrapper).

Test helper only; the CPU shim (`tests/support/cpu_shim`) is loaded separately through PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def _scalar(value):
    if value is None:
        return None
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None


def _record_training_log(path: str) -> None:
    import megatron.training.training as training

    original = training.training_log
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs):
        if rank == world - 1:
            losses = {}
            for key, value in (loss_dict or {}).items():
                if isinstance(value, (tuple, list)) and len(value) == 2:  # (sum, count)
                    value = _scalar(value[0]) / max(_scalar(value[1]), 1.0)
                losses[key] = _scalar(value)
            row = {"iteration": int(iteration), "losses": losses, "grad_norm": _scalar(grad_norm),
                   "params_norm": _scalar(params_norm), "num_zeros": _scalar(num_zeros_in_grad),
                   "loss_scale": _scalar(loss_scale), "skipped": int(skipped_iter or 0),
                   "lr": _scalar(learning_rate)}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                        skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs)

    training.training_log = training_log


def _nan_first(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def _inject_nan_grad(spec: str) -> None:
    import megatron.training.training as training

    target, name = spec.split(":", 1)
    original = training.train_step

    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        # train() passes the number of iterations done so far; the log line of this step says iteration + 1.
        handles = []
        if kwargs.get("iteration") is not None and kwargs["iteration"] + 1 == int(target):
            handles = [p.register_hook(_nan_first) for chunk in model for n, p in chunk.named_parameters()
                       if name in n]
            print(f"[pretrain_runner] NaN gradient injected into {len(handles)} parameter(s) matching {name!r}",
                  flush=True)
        try:
            return original(forward_step_func, data_iterator, model, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()

    training.train_step = train_step


def main() -> None:
    argv = sys.argv[1:]
    launch = bool(argv) and argv[0] == "--launch"
    if launch:
        argv = argv[1:]
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))  # the checkout's `megatron`, as `python script.py` would
    record = os.environ.get("BFPP_PRETRAIN_RECORD")
    if record:
        _record_training_log(record)
    if os.environ.get("BFPP_PRETRAIN_NAN_GRAD"):
        _inject_nan_grad(os.environ["BFPP_PRETRAIN_NAN_GRAD"])
    try:
        if launch:
            from megatron_bfpp.run_megatron_script import main as run_script

            rc = run_script([script, *argv[1:]])
            if rc:
                sys.exit(rc)
        else:
            sys.argv = [script, *argv[1:]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    _shut_down()


def _shut_down() -> None:
    """Tear the process groups down before the interpreter exits, as a training script should: Megatron's
    pretrain() leaves them up, and gloo's threads destroyed during interpreter shutdown can abort the process
    ("terminate called without an active exception") after a run that finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
