"""A leg's verdict from how its processes ended (processes.Outcome) and what they printed (outputs).

- refused: NCCL refused the set-up while making a communicator (outputs.INIT_REFUSALS, or invalid usage before any
  rank's first barrier), with no iteration run; or a multi-rank leg hung at start-up (killed before every rank
  had its process group up). The set-up, not the code under test.
- fail: anything else that exited non-zero or was killed, with the first-hand error line (not torchrun's banner,
  not a rank's complaint that its peer went away when the peer's own error is there) and NCCL's WARN lines; a
  run with missing iterations, losses off the reference, ZeRO collectives that did not communicate where D > 1;
  every iteration run but the processes hanging at exit (said so).
- pass: the rest.

Standard library only at import (the sync and memory verdicts import workers' pure helpers when called).
"""

from __future__ import annotations

from pathlib import Path

from .collectives import summarize, summary_text, zero_collectives_on
from .iterations import ELAPSED_RE, ITERATION_RE, LOSS_RE, losses_agree, relative_differences
from .outputs import (all_iterations_ran, error_lines, init_refusal, iterations_reached, last_lines, nccl_warnings,
                      ranks_up, root_error)
from .plan import ALL_ITERATIONS_RTOL, FIRST_ITERATION_RTOL, Leg, LegResult, consecutive_ws
from .processes import EXIT_GRACE_S, Outcome


def leg_losses(output: str) -> tuple[list[float], list[float]]:
    """lm losses and per-iteration seconds of Megatron-style iteration lines (the trainer prints the same)."""
    losses, times = [], []
    for line in output.splitlines():
        if ITERATION_RE.search(line) and "lm loss" in line:
            if (m := LOSS_RE.search(line)) is not None:
                losses.append(float(m.group(1)))
            if (e := ELAPSED_RE.search(line)) is not None:
                times.append(float(e.group(1)) / 1e3)
    return losses, times


def compare_losses(losses: list[float], ref: list[float]) -> tuple[bool, str]:
    """bf16 agreement with the reference: relative difference within FIRST_ITERATION_RTOL at iteration 1 and
    ALL_ITERATIONS_RTOL at every iteration, same number of iterations, all finite."""
    if not losses or not ref:
        return False, "no losses to compare" if not losses else "the reference has no losses"
    rel = relative_differences(losses, ref)
    return losses_agree(losses, ref), (
        f"losses {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} iterations; relative difference to the "
        f"reference {rel[0]:.1e} at iteration 1 (<= {FIRST_ITERATION_RTOL:g}), max {max(rel):.1e} "
        f"(<= {ALL_ITERATIONS_RTOL:g})" + ("" if len(losses) == len(ref) else
                                          f"; {len(losses)} iterations against {len(ref)}"))


def _nccl_clause(warnings: list[str]) -> str:
    return f" | NCCL: {' | '.join(warnings[:3])}"[:700] if warnings else ""


def judge(leg: Leg, o: Outcome, device: str, results: dict[str, LegResult], work: Path) -> LegResult:
    """The leg's result (see the module docstring). `results`: the legs judged so far (references); `work`: where
    the workers wrote their reports and collective counts."""
    losses, times = leg_losses(o.output)
    warnings = nccl_warnings(o.output)
    up = ranks_up(o.output)
    reached = iterations_reached(o.output)
    extra = {"losses": losses, "times": times, "complete": all_iterations_ran(o.output)}
    if o.rc != 0 and o.ended != "exit-hang":
        if o.ended == "limit" and not losses and leg.ranks > 1 and len(up) < leg.ranks:
            return LegResult(leg.name, "refused", o.seconds, (
                f"hung at start-up: {len(up)} of {leg.ranks} ranks had their process group up (its first barrier "
                f"passed) when the kit ended the leg at its {o.limit:.0f} s limit: the set-up ({leg.ranks} ranks on "
                f"one {'GPU over NCCL sockets on loopback' if device == 'cuda' else 'CPU over gloo'}), before any "
                f"communication of the code under test; last output: {last_lines(o.output, 2)}"
                + _nccl_clause(warnings))[:1200], dict(extra, startup_hang=True))
        refusal = init_refusal(o.output, len(up)) if device == "cuda" else None
        if refusal and not losses:
            others = [w for w in warnings if w != refusal and not w.endswith(refusal)]
            return LegResult(leg.name, "refused", o.seconds, (f"NCCL refused the set-up at initialisation: {refusal}"
                                                               + _nccl_clause(others))[:1200], extra)
        why = f"killed at its {o.limit:.0f} s limit" if o.ended == "limit" else f"exit {o.rc}"
        errors = error_lines(o.output)
        first = root_error(errors)
        text = first if first else f"no error printed; last output: {last_lines(o.output)}"
        if first and errors[-1] != first:
            text += f" (last error line: {errors[-1]})"
        where = f"; iteration {reached[0]} of {reached[1]} printed" if reached else ""
        if leg.ranks > 1 and len(up) == leg.ranks and not losses:
            where += f"; all {leg.ranks} ranks had their process group up"
        return LegResult(leg.name, "fail", o.seconds, f"{why}: {text[:700]}{where}{_nccl_clause(warnings)}", extra)
    result = _verdict(leg, o, device, results, work, losses, times, reached, extra)
    if o.ended == "exit-hang":
        result.status = "fail"
        result.detail = (f"all {reached[1] if reached else '?'} iterations ran, then the processes hung at exit: "
                         f"the kit ended them {EXIT_GRACE_S:.0f} s after the last iteration line; " + result.detail)
    if o.left_behind:
        result.detail += (f"; {o.left_behind} process(es) of the leg still ran after its torchrun exited (the kit "
                          f"ended them)")
    if o.survivors:
        result.detail += f"; processes {o.survivors} outlived SIGKILL (stuck in the kernel)"
    return result


def _verdict(leg: Leg, o: Outcome, device: str, results: dict[str, LegResult], work: Path, losses: list[float],
             times: list[float], reached: tuple[int, int] | None, extra: dict) -> LegResult:
    """The verdict of a leg whose processes finished their work (exit 0, or every iteration run)."""
    result = LegResult(leg.name, "pass", o.seconds, "", extra)
    if leg.kind in ("bfpp", "megatron"):
        if not losses:
            return LegResult(leg.name, "fail", o.seconds, "no iteration with an lm loss in the output", extra)
        if not extra["complete"]:
            return LegResult(leg.name, "fail", o.seconds, f"exit 0 after iteration {reached[0] if reached else '?'} "
                             f"of {reached[1] if reached else '?'}", extra)
        step = sorted(times[1:] or times)[len(times[1:] or times) // 2] if times else None
        parts = [f"{len(losses)} iterations, lm loss {losses[0]:.4f} -> {losses[-1]:.4f}"]
        if step is not None:
            parts.append(f"median step {step * 1e3:.0f} ms")
        if leg.reference:
            ref = results.get(leg.reference)
            if ref is None or not ref.extra.get("complete"):
                result.status = "fail"
                parts = [f"the reference {leg.reference} did not run all its iterations: nothing to compare with"
                         ] + parts
            else:
                ok, text = compare_losses(losses, ref.extra.get("losses", []))
                result.status = "pass" if ok else "fail"
                parts = [text] + parts[1:]
        cw = consecutive_ws(leg, device)
        if cw is not None:
            parts.append(f"{cw} consecutive W's on a chunk in the schedule")
        if leg.ranks > 1:
            parts.append(f"{leg.ranks} ranks sharing the "
                         f"{'GPU over NCCL sockets' if device == 'cuda' else 'CPU over gloo'}")
        counts = summarize(work / f"{leg.name}.collectives")
        if leg.data_parallel > 1:
            missing = zero_collectives_on(counts, leg.data_parallel)
            if missing:
                result.status = "fail"
                parts.insert(0, f"ZeRO's {' and '.join(missing)} did not run on {leg.data_parallel}-rank "
                                f"data-parallel groups")
        parts.append(summary_text(counts, leg.ranks))
        result.detail = "; ".join(parts)
    elif leg.kind == "sync":
        import json

        from .workers import sync_detail  # stdlib-only at import: torch is imported inside its functions

        path = work / f"{leg.name}.json"
        if not path.exists():
            return LegResult(leg.name, "fail", o.seconds, "the sync worker wrote no result", extra)
        result.detail = sync_detail(json.loads(path.read_text()))
    elif leg.kind == "memory":
        import json

        from .workers import memory_verdict

        path = work / f"{leg.name}.json"
        if not path.exists():
            return LegResult(leg.name, "fail", o.seconds, "the memory worker wrote no result", extra)
        ok, text = memory_verdict(json.loads(path.read_text()),
                                  "torch.cuda.max_memory_allocated" if device == "cuda"
                                  else "CPU: the runtime's own count of what it holds")
        result.status, result.detail = ("pass" if ok else "fail"), text
    return result
