"""What the runtime keeps between calls of its forward_backward functions, on one owner per process.

`RuntimeState` holds the settings callers give (the action recorder, the p2p wait timeout), what each pipeline
group has set up (the p2p transfer objects, the schedules every rank agreed on) and what the last call ran (its
schedule and statistics). `runtime_state` is the process's instance; `megatron_bfpp.runtime`'s functions
(`set_recorder`, `set_wait_timeout`, `reset_runtime_groups`, `last_schedule`, `last_run_stats`) read and write it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedule import Schedule, ScheduleSpec
from .executor import PipelineError
from .p2p import PipelineP2P, channel_groups, pipeline_ranks
from .recorder import ActionRecorder


class RuntimeState:
    """The runtime's state in one process. Everything tied to process groups (the p2p objects, the agreed
    handshakes, and `channel_groups`' groups they use) is forgotten together by `reset`."""

    def __init__(self) -> None:
        self.recorder: ActionRecorder | None = None  # records the executed actions of the following calls
        self.wait_timeout_s: float | None = None  # bounds every p2p wait (None: the process group's timeout)
        self.last_schedule: Schedule | None = None
        self.last_run: dict[str, int] = {}
        self._p2p: dict[tuple[tuple[int, ...], torch.device], PipelineP2P] = {}
        self._agreed: set[tuple] = set()

    def p2p(self, pp_group: dist.ProcessGroup | None, device: torch.device) -> PipelineP2P:
        """The transfer object of the pipeline over `pp_group`'s ranks on `device`, created on the first request
        (with the wait timeout of that moment): its channel groups are created collectively, once."""
        key = (tuple(pipeline_ranks(pp_group)), device)
        if key not in self._p2p:
            self._p2p[key] = PipelineP2P(pp_group, device, self.wait_timeout_s)
        return self._p2p[key]

    def handshake(self, spec: ScheduleSpec, groups: dict[str, dist.ProcessGroup | None],
                  device: torch.device) -> None:
        """All ranks of the pipeline and data-parallel groups must execute the same schedule: compare the
        fingerprints of their specs (every field of `ScheduleSpec`); PipelineError names the first mismatch.

        Once per distinct (spec, groups): the exchange syncs the host, so it must not run every iteration.
        Every rank of a group sees the same sequence of schedules, so all of them skip or exchange together.
        """
        names, fields = (list(x) for x in zip(*spec.fingerprint()))
        key = (tuple(fields),
               tuple(tuple(dist.get_process_group_ranks(g)) if g is not None else () for g in groups.values()))
        if key in self._agreed:
            return
        mine = torch.tensor(fields, dtype=torch.int64, device=device)
        for kind, group in groups.items():
            if group is None or dist.get_world_size(group) == 1:
                continue
            n = dist.get_world_size(group)
            out = torch.empty(n * len(fields), dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(out, mine, group=group)
            rows = out.view(n, len(fields)).tolist()
            ranks = dist.get_process_group_ranks(group)
            for r, row in zip(ranks, rows):
                if row != fields:
                    diff = ", ".join(f"{nm} {a} vs {b}" for nm, a, b in zip(names, fields, row) if a != b)
                    raise PipelineError(
                        f"rank {dist.get_rank()}: {kind}-parallel rank {r} runs a different schedule ({diff}); every "
                        "rank must get the same --pipeline-schedule, micro-batch counts, group size and --zero-stage"
                    )
        self._agreed.add(key)

    def reset(self) -> None:
        """Forget the channel groups, the transfer objects and the agreed schedules (their process groups are being
        destroyed); the recorder, the timeout and the last call's results stay."""
        channel_groups.forget()
        self._p2p.clear()
        self._agreed.clear()


runtime_state = RuntimeState()
