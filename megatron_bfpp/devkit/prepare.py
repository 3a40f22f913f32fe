"""Build the device kit (on a machine that reaches the package registry) into devkit/kit.

    python -m megatron_bfpp.devkit.prepare [--megatron-lm DIR] [--max-mib 40]

What the device machine (python 3.12 with torch, no package index) cannot fetch:

- wheels/: megatron-core==0.19.2 for CPython 3.12 manylinux x86_64 and the pure or binary dependencies that a
  bare torch environment lacks and the legs import (numpy, packaging), all `pip download --no-deps
  --only-binary=:all:`; and this project's wheel, built from a copy of the checkout (the kit records a digest of
  megatron_bfpp/ so a run can tell a kit built from other sources). matplotlib is not needed: no leg draws.
- megatron-lm-<tag>.tar.gz: what pretrain_gpt.py needs of a Megatron-LM source tree at a supported tag
  (pretrain_gpt.py, gpt_builders.py, model_provider.py, the megatron package), with the dataset helpers'
  extension from the megatron-core wheel put where Megatron builds it (megatron/core/datasets/helpers_cpp*.so).
- manifest.json: the files, their versions, sizes and the digest.

The whole kit must stay under --max-mib (the device machine receives at most 64 MiB with the repository);
over it, prepare fails naming the sizes. Prints the `carry` list (paths relative to the repository root).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from .run import KIT, MANIFEST, ROOT, sources_digest

MEGATRON_CORE = "0.19.2"
# (project, module, pin, accepted importable version prefix: None = any)
DEPENDENCIES = (("megatron-core", "megatron.core", f"=={MEGATRON_CORE}", "0.19."),
                ("numpy", "numpy", "", None),
                ("packaging", "packaging", "", None))
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
DEFAULT_MAX_MIB = 40.0
TREE_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "LICENSE")
SUPPORTED_TAGS = ("core_v0.19.0", "core_v0.16.1")


def default_megatron_lm() -> Path:
    env = os.environ.get("MEGATRON_LM_DIR")
    return Path(env) if env else ROOT.parent / "shared" / "megatron-lm" / "core_v0.19.0"


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        raise SystemExit(f"device_check --prepare: error: {' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout


def download(python: str, dest: Path) -> list[dict]:
    """The dependency wheels for CPython 3.12 manylinux x86_64."""
    specs = [f"{project}{pin}" for project, _, pin, _ in DEPENDENCIES]
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *[x for p in PLATFORMS for x in ("--platform", p)], "--disable-pip-version-check", "-q", "-d", str(dest),
           *specs]
    _run(cmd)
    wheels = []
    for project, module, _, accept in DEPENDENCIES:
        key = project.replace("-", "_").lower()
        found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(key + "-"))
        if not found:
            raise SystemExit(f"device_check --prepare: error: pip download gave no wheel for {project}")
        wheels.append({"project": project, "module": module, "file": found[-1].name,
                       "version": found[-1].name.split("-")[1], "accept": accept})
    return wheels


def build_project_wheel(python: str, dest: Path) -> dict:
    """This project's wheel, built from a copy of the checkout's package (nothing is written into the clone)."""
    with tempfile.TemporaryDirectory(prefix="bfpp-kit-src-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "megatron_bfpp", src / "megatron_bfpp",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        _run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
              "-q", "-w", str(dest), str(src)])
    found = sorted(dest.glob("megatron_bfpp-*.whl"))
    if not found:
        raise SystemExit("device_check --prepare: error: the project's wheel was not built")
    return {"project": "megatron_bfpp", "module": "megatron_bfpp", "file": found[-1].name,
            "version": found[-1].name.split("-")[1], "accept": None}


def megatron_version(src: Path) -> tuple[str, str | None]:
    """(the checkout's version from megatron/core/package_info.py, the supported tag of its minor series or None),
    as scripts/apply_megatron_patches.sh matches a checkout without git."""
    info = (src / "megatron" / "core" / "package_info.py").read_text()
    major, minor, patch = (re.search(rf"^{k} *= *(\d+)", info, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    tag = next((t for t in SUPPORTED_TAGS if t.startswith(f"core_v{major}.{minor}.")), None)
    return f"{major}.{minor}.{patch}", tag


def pack_megatron_lm(src: Path, core_wheel: Path, dest: Path) -> dict:
    """megatron-lm-<tag>.tar.gz: pretrain_gpt.py and what it imports, plus the wheel's dataset helpers build."""
    if not (src / "pretrain_gpt.py").is_file():
        raise SystemExit(f"device_check --prepare: error: {src} has no pretrain_gpt.py (--megatron-lm DIR, or "
                         f"MEGATRON_LM_DIR, a Megatron-LM checkout at one of {', '.join(SUPPORTED_TAGS)})")
    version, tag = megatron_version(src)
    if tag is None:
        raise SystemExit(f"device_check --prepare: error: {src} is Megatron-LM {version}; supported: "
                         f"{', '.join(SUPPORTED_TAGS)}")
    top = f"megatron-lm-{version}"
    path = dest / f"{top}.tar.gz"

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if "__pycache__" in parts or info.name.endswith(".pyc") or ".git" in parts:
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(path, "w:gz") as tar:
        for name in TREE_FILES:
            if (src / name).exists():
                tar.add(src / name, arcname=f"{top}/{name}", filter=keep)
        tar.add(src / "megatron", arcname=f"{top}/megatron", filter=keep)
        with zipfile.ZipFile(core_wheel) as z:
            helpers = [n for n in z.namelist() if re.fullmatch(r"megatron/core/datasets/helpers_cpp\..*\.so", n)]
            for n in helpers:
                data = z.read(n)
                info = tarfile.TarInfo(f"{top}/{n}")
                info.size, info.mode, info.mtime = len(data), 0o755, int(time.time())
                tar.addfile(info, io.BytesIO(data))
    return {"file": path.name, "dir": top, "version": f"{version} ({tag} series)", "helpers": bool(helpers)}


def prepare(python: str, megatron_lm: Path, max_mib: float, kit: Path | None = None) -> dict:
    kit = ROOT / KIT if kit is None else kit
    shutil.rmtree(kit, ignore_errors=True)
    wheels_dir = kit / "wheels"
    wheels_dir.mkdir(parents=True)
    t0 = time.monotonic()
    wheels = download(python, wheels_dir)
    wheels.append(build_project_wheel(python, wheels_dir))
    core = wheels_dir / next(w["file"] for w in wheels if w["project"] == "megatron-core")
    tree = pack_megatron_lm(megatron_lm, core, kit)
    sizes = {f"wheels/{w['file']}": (wheels_dir / w["file"]).stat().st_size for w in wheels}
    sizes[tree["file"]] = (kit / tree["file"]).stat().st_size
    for w in wheels:
        w["bytes"] = sizes[f"wheels/{w['file']}"]
    tree["bytes"] = sizes[tree["file"]]
    manifest = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "wheels": wheels, "megatron_lm": tree,
                "sources_sha256": sources_digest(ROOT), "python": "3.12", "platform": "manylinux x86_64",
                "seconds": round(time.monotonic() - t0, 1)}
    (kit / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    manifest["total_bytes"] = total
    listing = "\n".join(f"  {n:<90} {b / 2**20:7.2f} MiB" for n, b in sizes.items())
    if total > max_mib * 2**20:
        raise SystemExit(f"device_check --prepare: error: the kit is {total / 2**20:.2f} MiB, over the "
                         f"{max_mib:g} MiB cap:\n{listing}")
    print(f"device kit in {kit} ({total / 2**20:.2f} MiB of {max_mib:g} MiB, {manifest['seconds']:.0f} s):\n{listing}")
    print(f"carry: {json.dumps([KIT])}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/device_check.sh --prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", type=Path, default=None, help="Megatron-LM checkout (default MEGATRON_LM_DIR, "
                   "else ../shared/megatron-lm/core_v0.19.0)")
    p.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB)
    p.add_argument("--python", default=sys.executable, help="the python whose pip downloads and builds")
    a = p.parse_args(argv)
    prepare(a.python, a.megatron_lm or default_megatron_lm(), a.max_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
