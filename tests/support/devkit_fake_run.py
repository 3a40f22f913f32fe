"""A device-kit run whose one training leg is a stand-in worker under the real torchrun (CPU): what the kit's
process handling, teardown and report writing meet, without a kit to install or a model to train.

    python tests/support/devkit_fake_run.py WORKER OUT BUDGET MARKER

WORKER (what each of the leg's two ranks does, after printing "stand-in worker up" and the kit's start-up mark):
  stubborn   ignores SIGTERM and sleeps, holding the output it inherited (and nothing ties it to its parent)
  dies-with-parent   the same, but ends when its parent does, as the kit's own workers do
  exit-hang  prints every iteration line of a finished run, then ignores SIGTERM and sleeps
MARKER is an argument of every process of the leg, so a test can find what is left of them.

The install is a stand-in (it passes at once), the leg's command is the real `torchrun` launch through
scripts/shared_gpu_rank.sh; the work folder lies beside OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_bfpp.devkit import plan, processes, run  # noqa: E402
from megatron_bfpp.devkit.outputs import STARTUP_MARK  # noqa: E402
from tests.support.paths import subprocess_pythonpath  # noqa: E402

# Each rank says it is up, as the kit's workers do once their process group is (collectives.instrument).
UP = ("import os\nprint('stand-in worker up', flush=True)\n"
      f"print('{STARTUP_MARK} rank ' + os.environ['RANK'] + ' of 2 (gloo) in 0.0 s', flush=True)\n")
IGNORE_TERM = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
WORKERS = {
    "stubborn": IGNORE_TERM + UP + "time.sleep(600)\n",
    "dies-with-parent": ("from megatron_bfpp.devkit.processes import die_with_parent\ndie_with_parent()\n"
                         + IGNORE_TERM + UP + "time.sleep(600)\n"),
    "exit-hang": (IGNORE_TERM + UP + "if os.environ['RANK'] == '1':\n"
                  "    for i in (1, 2, 3):\n"
                  "        print(f' iteration {i:8d}/{3:8d} | elapsed time per iteration (ms): 10.0 | "
                  "lm loss: {10.0 - i:.6E} |', flush=True)\n"
                  "time.sleep(600)\n"),
}


def main(argv: list[str]) -> int:
    worker, out, budget, marker = argv[0], Path(argv[1]), float(argv[2]), argv[3]
    legs = [plan.plan_legs("cpu")[0],
            plan.Leg("stand-in-P2", "bfpp", "stand-in", "a stand-in worker on two ranks", {"cuda": 5, "cpu": 5},
                     ranks=2)]

    def install(self, leg):
        self.tree = self.work
        return plan.LegResult(leg.name, "pass", 0.0, "stand-in install")

    def command(self, leg):
        env = self.env()
        env["PYTHONPATH"] = subprocess_pythonpath()
        launch = self.launch(leg.ranks, ["-c", WORKERS[worker], marker])
        return launch, env

    run.plan_legs = lambda device: legs
    run.Driver.install = install
    run.Driver.command = command
    driver = run.Driver("cpu", out, budget, sys.executable, root=out.parent / "root")
    (driver.root / "scripts").mkdir(parents=True, exist_ok=True)
    link = driver.root / "scripts" / "shared_gpu_rank.sh"
    if not link.exists():
        os.symlink(ROOT / "scripts" / "shared_gpu_rank.sh", link)
    processes.become_subreaper()  # as the kit's main() does
    return driver.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
