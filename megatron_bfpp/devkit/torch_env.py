"""A bare torch environment for rehearsing the device kit: a new venv that sees torch and torch's own
dependencies from another environment, and nothing else (no megatron-core, numpy, packaging, this project).

It is what a borrowed GPU machine offers (a python with torch preinstalled), made in seconds from a cached
environment instead of downloading torch again: the distributions torch requires (transitively, read from their
metadata) are linked, file by file as their RECORD lists them, into a folder that a `.pth` file of the new venv
adds to its path. Standard library only.

usage: python -m megatron_bfpp.devkit.torch_env SOURCE_PYTHON DEST_VENV   (prints DEST_VENV/bin/python)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

# Run by the SOURCE python: every distribution in torch's requirement closure (extras and markers that do not
# apply are skipped) with the files its RECORD lists, relative to its site-packages.
_CLOSURE = r"""
import json, re
from importlib import metadata
from packaging.requirements import Requirement
""" + r"""
def closure(root):
    # (distribution, extra) pairs: a requirement like cuda-toolkit[cufile] pulls in what that extra lists.
    seen, todo, out, listed = set(), [(root, "")], [], set()
    while todo:
        raw, extra = todo.pop()
        name = re.sub(r"[-_.]+", "-", raw).lower()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if name not in listed:
            listed.add(name)
            out.append({"name": name, "base": str(dist.locate_file("")), "files": [str(f) for f in (dist.files or [])]})
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo.extend((req.name, e) for e in [""] + sorted(req.extras))
    return out
print(json.dumps(closure("torch")))
"""

# The same without `packaging` (a bare environment may lack it): names parsed loosely, markers ignored but for
# extras (a requirement under an extra is followed when that extra was asked for).
_CLOSURE_NO_PACKAGING = _CLOSURE.replace("from packaging.requirements import Requirement\n", "").replace(
    """            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo.extend((req.name, e) for e in [""] + sorted(req.extras))""",
    """            m = re.match(r"\\s*([A-Za-z0-9_.-]+)\\s*(?:\\[([^\\]]*)\\])?", spec)
            wants = re.search(r"extra\\s*==\\s*['\\"]([^'\\"]+)", spec)
            if wants is None or wants.group(1) == extra:
                extras = [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
                todo.extend((m.group(1), e) for e in [""] + extras)""")


def torch_closure(source_python: str) -> list[dict]:
    """The distributions of torch's requirement closure in SOURCE_PYTHON's environment, with their files."""
    for code in (_CLOSURE, _CLOSURE_NO_PACKAGING):
        r = subprocess.run([source_python, "-c", code], capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout)
    raise RuntimeError(f"{source_python} cannot list torch's distributions:\n{r.stderr[-2000:]}")


def make_torch_env(source_python: str, dest: Path) -> Path:
    """A new venv at `dest` whose only third-party distributions are torch's closure, linked from the source
    environment. Returns its python."""
    dists = torch_closure(source_python)
    if not any(d["name"] == "torch" for d in dists):
        raise RuntimeError(f"{source_python} has no torch")
    if dest.exists():
        shutil.rmtree(dest)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(dest)
    linked = dest / "torch-site"
    for dist in dists:
        base = Path(dist["base"])
        for rel in dist["files"]:
            if rel.startswith("..") or os.path.isabs(rel):  # console scripts and data outside site-packages
                continue
            src, dst = base / rel, linked / rel
            if src.is_file() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(src, dst)
    python = dest / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "torch_site.pth").write_text(str(linked) + "\n")
    return python


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    print(make_torch_env(args[0], Path(args[1]).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
