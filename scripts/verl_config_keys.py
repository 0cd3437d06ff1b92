"""Write docs/verl_config_keys.tsv: every leaf key of verl's resolved trainer configs, for one or more verl versions.

A version is read from a wheel, an unpacked source tree or a git commit: its `ppo_trainer` and `ppo_megatron_trainer`
(verl/trainer/config/_generated_*.yaml, verl's own flattened `--cfg job` output) and its fully-async configs
(verl/experimental/fully_async_policy/config/fully_async_ppo[_megatron]_trainer.yaml, an overlay on one of those two:
its keys that the base lacks are added under the fully-async config's name; a key the base has keeps the base's
default).  Columns: key, default (JSON), the configs that have it, the versions that have it.  Versions are given
newest first: a key's default and configs are those of the first version that has it, so a key removed later keeps
its older default and its `versions` cell names only the older release.

    python scripts/verl_config_keys.py 0.9.1=pypi b178a3cd=/work/.mirror/verl-project+verl/repo@b178a3cd \
        > docs/verl_config_keys.tsv
    # a version's SPEC: pypi (pip download --no-deps verl==LABEL), a .whl, a source folder, or GIT_DIR@COMMIT

tests/unit/scripts/test_gen_verl_compat.py checks the flattening on tiny configs (a folder and a wheel).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, Callable, Optional

import yaml

BASES = {"ppo_trainer": "verl/trainer/config/_generated_ppo_trainer.yaml",
         "ppo_megatron_trainer": "verl/trainer/config/_generated_ppo_megatron_trainer.yaml"}
OVERLAYS = {"fully_async_ppo_trainer": "verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml",
            "fully_async_ppo_megatron_trainer":
                "verl/experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml"}
HEADER = ("# Every leaf key of verl's resolved trainer configs, written by scripts/verl_config_keys.py: ppo_trainer\n"
          "# and ppo_megatron_trainer (verl/trainer/config/_generated_*.yaml) plus the fully-async overrides\n"
          "# (verl/experimental/fully_async_policy/config/*.yaml), of verl {versions} (newest first).\n"
          "# Columns: key, default (JSON, the newest version's that has it), configs that have it, versions that "
          "have it.\n")
Reader = Callable[[str], Optional[str]]


def reader(spec: str, label: str, tmp: str) -> Reader:
    """A function reading a file of the verl tree (path inside the repository) from SPEC, or None if absent."""
    if spec == "pypi":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from verl_release import download_wheel

        spec = download_wheel(label, tmp)
    if spec.endswith(".whl"):
        zf = zipfile.ZipFile(spec)
        names = set(zf.namelist())
        return lambda path: zf.read(path).decode() if path in names else None
    if os.path.isdir(spec):
        return lambda path: open(os.path.join(spec, path)).read() if os.path.exists(os.path.join(spec, path)) else None
    if "@" in spec:
        git_dir, commit = spec.rsplit("@", 1)

        def read_git(path: str) -> Optional[str]:
            done = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], capture_output=True,
                                  text=True)
            return done.stdout if done.returncode == 0 else None
        return read_git
    raise SystemExit(f"{spec!r} is none of: pypi, a .whl file, a folder, GIT_DIR@COMMIT")


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf; an empty dict is a leaf ({}), a list is a leaf."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def version_keys(read: Reader, label: str) -> dict[str, tuple[Any, list[str]]]:
    """{key: (default, [configs that have it])} of one verl version."""
    base_keys: dict[str, dict[str, Any]] = {}
    for name, path in BASES.items():
        text = read(path)
        if text is None:
            raise SystemExit(f"verl {label} has no {path}")
        base_keys[name] = leaves(yaml.safe_load(text))
    out: dict[str, tuple[Any, list[str]]] = {}
    for name, keys in base_keys.items():
        for key, value in keys.items():
            out.setdefault(key, (value, []))[1].append(name)
    for name, path in OVERLAYS.items():
        text = read(path)
        if text is None:
            continue
        overlay = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k not in ("hydra", "defaults")}
        for key, value in leaves(overlay).items():
            if any(key in keys for keys in base_keys.values()):
                continue
            out.setdefault(key, (value, []))[1].append(name)
    return out


def table(versions: list[tuple[str, dict[str, tuple[Any, list[str]]]]]) -> str:
    """The TSV text of several versions (newest first)."""
    rows: dict[str, tuple[Any, list[str], list[str]]] = {}
    for label, keys in versions:
        for key, (default, configs) in keys.items():
            rows.setdefault(key, (default, configs, []))[2].append(label)
    lines = [HEADER.format(versions=", ".join(label for label, _ in versions)), "key\tdefault\tconfigs\tversions\n"]
    for key in sorted(rows):
        default, configs, labels = rows[key]
        lines.append(f"{key}\t{json.dumps(default)}\t{','.join(configs)}\t{','.join(labels)}\n")
    return "".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", metavar="LABEL=SPEC",
                        help="newest first; SPEC: pypi, a wheel, a source folder or GIT_DIR@COMMIT")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    read: list[tuple[str, dict[str, tuple[Any, list[str]]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.versions:
            if "=" not in item:
                parser.error(f"{item!r} is not LABEL=SPEC (e.g. 0.9.1=pypi)")
            label, spec = item.split("=", 1)
            read.append((label, version_keys(reader(spec, label, tmp), label)))
    text = table(read)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
