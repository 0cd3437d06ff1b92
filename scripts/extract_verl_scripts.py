"""Extract the Hydra overrides of verl's example launch scripts into tests/fixtures/verl_scripts.tsv.

Why: the translation test (tests/unit/run/test_verl_scripts.py) checks that every verl example script ports by
changing the module name.  It needs each script's command line, and running the scripts (downloads, `ray job
submit`, `pip install`) is out of the question, so this reads them statically, the way a person would:

* backslash continuations are joined; `NAME=value` / `export NAME=value` assignments are evaluated in file order
  (the last one before the command wins; both branches of an `if` are read, in order), with `${NAME:-default}`,
  `${NAME:?message}` (`<NAME>`: a value the user must give), `${NAME}`, `$NAME` and `$(( arithmetic ))`
  expanded; `NAME=( ... )` arrays expand at `"${NAME[@]}"`;
  a variable never assigned (the script's arguments `$1` included) is empty or its `:-` default, as in bash;
  `$(pwd)` is /workspace and `$HOME` /home/user; other command substitutions stay as written;
* the command is the first line that runs a verl entry module (`-m verl.trainer.main_ppo`, `-m recipe....`,
  `-m verl.experimental....`), also behind `ray job submit ... --`; its `--config-path`/`--config-name` and
  `key=value` words are kept (up to a pipe or redirection), `$@` dropped.

Only commands of the entry modules in DEFAULT_CONFIG are read (a script that runs another module, e.g. the SFT
trainer, or one verl no longer has, is left out).  Two sets:

* `--set b178a3cd` (tests/fixtures/verl_scripts.tsv): examples/grpo_trainer and ppo_trainer, the fully-async and
  one-step-off recipes, and the DAPO recipe of verl's `recipe` submodule;
* `--set 0.9` (tests/fixtures/verl_scripts_0_9.tsv): every folder of examples/, the fully-async and one-step-off
  recipes, and the V1 async trainer's recipes (tests/special_e2e/run_v1_*.sh: separate_async, colocate_async).

Usage (a bare git dir, as `fetch github:verl-project/verl` gives; for the first set the recipe submodule's commit
is read from verl's tree and must exist in the verl-recipe mirror):

    python scripts/extract_verl_scripts.py --verl /work/.mirror/volcengine+verl/repo --commit b178a3cd \
        --recipe /work/.mirror/verl-project+verl-recipe/repo > tests/fixtures/verl_scripts.tsv
    python scripts/extract_verl_scripts.py --set 0.9 --verl /work/.mirror/verl-project+verl/repo \
        --commit 1dda039b > tests/fixtures/verl_scripts_0_9.tsv
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from typing import Optional

# (repository, folder) pairs read; the recipe folder is verl's `recipe` submodule at the commit verl pins
VERL_FOLDERS = ("examples/grpo_trainer", "examples/ppo_trainer", "verl/experimental/fully_async_policy/shell",
                "verl/experimental/one_step_off_policy/shell")
RECIPE_FOLDERS = ("dapo",)
# the 0.9 set: (folder, file-name prefix) pairs; verl 0.9's V1 trainer (trainer.v1.trainer_mode) has its async
# recipes among verl's end-to-end scripts only
VERL_09_FOLDERS = (("examples", ""), ("verl/experimental/fully_async_policy/shell", ""),
                   ("verl/experimental/one_step_off_policy/shell", ""), ("tests/special_e2e", "run_v1_"))
ENTRY = re.compile(r"-m\s+(verl\.[\w.]+|recipe\.[\w.]+)")
ASSIGN = re.compile(r"^\s*(?:export\s+|local\s+|readonly\s+)?([A-Za-z_]\w*)=(.*)$")
HOME = "/home/user"
# each entry module's own @hydra.main config_name (what runs without --config-name)
DEFAULT_CONFIG = {"verl.trainer.main_ppo": "ppo_trainer", "recipe.dapo.main_dapo": "dapo_trainer",
                  "verl.experimental.fully_async_policy.fully_async_main": "fully_async_ppo_trainer",
                  "verl.experimental.one_step_off_policy.main_ppo": "one_step_off_ppo_trainer"}


def git(gitdir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=True, capture_output=True,
                          text=True).stdout


def _strip_comment(value: str) -> str:
    out, quote = [], None
    for i, ch in enumerate(value):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or value[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).strip()


class Expander:
    """A small subset of bash parameter expansion over the script's own assignments."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {"HOME": HOME, "PWD": "/workspace", "USER": "user"}
        self.arrays: dict[str, list[str]] = {}

    def _arith(self, expr: str) -> str:
        expr = self.expand(expr)
        expr = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: self.env.get(m.group(1), "0") or "0", expr)
        if not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
            return "$((" + expr + "))"
        return str(int(eval(expr.replace("/", "//"))))  # noqa: S307 -- digits and operators only (checked above)

    def expand(self, text: str) -> str:
        for _ in range(20):
            new = self._once(text)
            if new == text:
                return new
            text = new
        return text

    def _once(self, text: str) -> str:
        text = re.sub(r"\$\(\((.*?)\)\)(?!\))|\$\(\(((?:[^()]|\([^()]*\))*)\)\)",
                      lambda m: self._arith(m.group(1) or m.group(2)), text)

        def brace(m: "re.Match[str]") -> str:
            name, op, word = m.group(1), m.group(2), m.group(3) or ""
            value = self.env.get(name, "")
            if op == ":+":
                return word if value else ""
            if op in (":-", "-", ":=", "=") and not value:
                return word
            if op in (":?", "?") and not value:     # a value the user must give: named, as a placeholder
                return f"<{name}>"
            return value

        text = text.replace("$(pwd)", self.env["PWD"]).replace("`pwd`", self.env["PWD"])
        text = re.sub(r"\$\{([A-Za-z_]\w*|\d)(?:(:-|-|:=|=|:\+|:\?|\?)([^{}]*))?\}", brace, text)
        return re.sub(r"\$([A-Za-z_]\w*)", lambda m: self.env.get(m.group(1), ""), text)

    def assign(self, name: str, raw: str) -> None:
        raw = _strip_comment(raw)
        try:
            words = shlex.split(self.expand(raw)) if raw else [""]
        except ValueError:
            words = [raw.strip("'\"")]
        self.env[name] = words[0] if len(words) == 1 else " ".join(words)


def _logical_lines(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


def extract(text: str) -> Optional[tuple[str, str, list[str]]]:
    """(module, config name, overrides) of the script's first verl command, or None when it runs none."""
    ex = Expander()
    lines = _logical_lines(text)
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        m = re.match(r"^\s*([A-Za-z_]\w*)=\($", line) or re.match(r"^\s*([A-Za-z_]\w*)=\((.*)\)\s*$", line)
        if m and m.re.pattern.endswith(r"\($"):
            body = []
            while i < len(lines) and lines[i].strip() != ")":
                body.append(lines[i])
                i += 1
            i += 1
            ex.arrays[m.group(1)] = [w for b in body for w in _words(ex, _strip_comment(b))]
            continue
        if m:
            ex.arrays[m.group(1)] = _words(ex, m.group(2))
            continue
        entry = ENTRY.search(line)
        if entry and entry.group(1) not in DEFAULT_CONFIG:      # not a training command (SFT, generation)
            return None
        if entry:
            module = entry.group(1)
            name, overrides = _command(ex, line[entry.end():], DEFAULT_CONFIG.get(module, "ppo_trainer"))
            return module, name, overrides
        a = ASSIGN.match(line)
        if a:
            ex.assign(a.group(1), a.group(2))
    return None


def _words(ex: Expander, text: str) -> list[str]:
    def arr(m: "re.Match[str]") -> str:
        return " ".join(shlex.quote(w) for w in ex.arrays.get(m.group(1), []))

    text = re.sub(r"\"?\$\{([A-Za-z_]\w*)\[@\]\}\"?", arr, text)
    text = ex.expand(text)
    try:
        return shlex.split(text, comments=True)
    except ValueError:       # an unbalanced quote somewhere: unquote word by word
        out = []
        for word in text.split():
            try:
                out.extend(shlex.split(word))
            except ValueError:
                out.append(word)
        return out


def _command(ex: Expander, rest: str, config_name: str) -> tuple[str, list[str]]:
    overrides: list[str] = []
    words = _words(ex, rest)
    k = 0
    while k < len(words):
        w = words[k]
        k += 1
        if w in ("|", "||", "&&", ";", "&") or re.match(r"^\d?>", w) or w.startswith(">"):
            break
        if w in ("$@", "${@}"):
            continue
        if w in ("--config-name", "--config-path"):
            if w == "--config-name" and k < len(words):
                config_name = words[k]
            k += 1
            continue
        if w.startswith("--config-name="):
            config_name = w.split("=", 1)[1]
            continue
        if w.startswith("--config-path=") or w.startswith("-"):
            continue
        if "=" in w:
            overrides.append(w)
    return config_name.strip("'\"").removesuffix(".yaml"), overrides


def _write_rows(out, source: str, gitdir: str, commit: str, folders: tuple[tuple[str, str], ...]) -> None:
    for folder, prefix in folders:
        for path in git(gitdir, "ls-tree", "-r", "--name-only", commit, folder).split():
            if not path.endswith(".sh") or not path.rsplit("/", 1)[-1].startswith(prefix):
                continue
            found = extract(git(gitdir, "show", f"{commit}:{path}"))
            if found is None:       # data preparation, or no training command of verl's RL entry modules
                continue
            module, name, overrides = found
            out.write(f"{source}\t{path}\t{module}\t{name}\t{json.dumps(overrides)}\n")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl", required=True, help="bare git dir of verl")
    ap.add_argument("--recipe", help="bare git dir of verl-project/verl-recipe (the b178a3cd set)")
    ap.add_argument("--commit", default="HEAD", help="verl commit (default HEAD)")
    ap.add_argument("--set", dest="which", choices=("b178a3cd", "0.9"), default="b178a3cd",
                    help="which folders (see the module's docstring)")
    args = ap.parse_args(argv)
    verl_commit = git(args.verl, "rev-parse", args.commit).strip()
    out = sys.stdout
    head = "# verl's example launch scripts, their overrides as scripts/extract_verl_scripts.py reads them.\n"
    if args.which == "0.9":
        version = git(args.verl, "show", f"{verl_commit}:verl/version/version").strip()
        date = git(args.verl, "log", "-1", "--format=%cs", verl_commit).strip()
        out.write(f"{head}# verl-project/verl {verl_commit} ({date}, version file {version}; --set 0.9).\n"
                  f"# Folders: {', '.join(f + ('/' + p + '*' if p else '') for f, p in VERL_09_FOLDERS)}.\n"
                  "source\tpath\tmodule\tconfig_name\toverrides\n")
        _write_rows(out, "verl", args.verl, verl_commit, VERL_09_FOLDERS)
        return 0
    if not args.recipe:
        ap.error("--recipe is required for --set b178a3cd")
    recipe_commit = git(args.verl, "ls-tree", verl_commit, "recipe").split()[2]
    out.write(f"{head}# volcengine/verl {verl_commit}; recipe/ = verl-project/verl-recipe {recipe_commit} (verl's "
              f"submodule pin).\n# Folders: {', '.join(VERL_FOLDERS)}; recipe/{', recipe/'.join(RECIPE_FOLDERS)}.\n"
              "source\tpath\tmodule\tconfig_name\toverrides\n")
    _write_rows(out, "verl", args.verl, verl_commit, tuple((f, "") for f in VERL_FOLDERS))
    _write_rows(out, "recipe", args.recipe, recipe_commit, tuple((f, "") for f in RECIPE_FOLDERS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
