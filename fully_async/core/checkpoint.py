"""Checkpoint folders: atomic writes, discovery for resume, retention (layer 0: files only).

A checkpoint is `<default_local_dir>/global_step_<v>/` where v is the param version; each actor writes
its own part and reads it back on resume:
  actor/                 trainer: the model as a Hugging Face folder (save_pretrained)
  actor_optim.pt         trainer: optimizer, LR scheduler, RNG states (FSDP2: per-rank shard files)
  trainer_state.json     trainer: step, version, ids of every sample trained so far
  rollout_state.json     rollouter: data-stream position, staleness counters, in-flight groups with
                         their partial responses (tokens, log-probs, versions); sync mode: the stream
  queue_state.json       queue: the groups generated but not yet trained
The driver orchestrates it (launcher.take_checkpoint): every part goes into `.tmp_global_step_<v>`
(`begin_checkpoint`), which is renamed when all are in (`commit_checkpoint`), so a crash mid-save never
leaves a folder that looks finished; `latest_checkpointed_iteration.txt` (verl's name) names the
newest complete one.

Integrity: the driver writes `config.json` (the run's resolved config) and then `manifest.json` (every
file's relative path, size and sha256, signed with this user's key: `write_manifest`) as the last files before the
rename.  Resume verifies the manifest
of the checkpoint it picks (`find_resume_path`): a checkpoint that fails (a truncated or missing file) is
set aside as `global_step_<v>.broken` and the newest intact older one is used; none intact: CheckpointError
before Ray starts.  A checkpoint without a manifest is not used (nothing says its files are complete): auto sets
it aside like a damaged one, resume_from_path refuses it naming the command that writes its manifest.  Reading
never runs code: weights are safetensors, optimizer files are read with `torch.load(weights_only=True)`, the
rollouter's and the queue's state are JSON (`state_files.py`).  `check_resume_config` refuses changes, between
the saved config and the new one, of the keys that give the saved state its meaning (config.RESUME_STATE_KEYS)
unless trainer.resume_allow_config_change names them.  Resuming from an older step moves the newer checkpoints
(another timeline) aside (`retire_abandoned`); retention keeps the one just written (`prune`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any, Callable, Optional

from fully_async.core import safe_write
from fully_async.core.state_files import CheckpointError, read_state, write_state  # noqa: F401 - part of this API

logger = logging.getLogger("fully_async")

LATEST = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
ROLLOUT_STATE = "rollout_state.json"
QUEUE_STATE = "queue_state.json"
CONFIG = "config.json"
MANIFEST = "manifest.json"
HASH_CHUNK = 8 << 20  # bytes read at a time: files are hashed streaming, never loaded whole
_STEP_RE = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, version: int) -> str:
    return os.path.join(root, f"global_step_{version}")


def begin_checkpoint(root: str, version: int) -> str:
    """A fresh, empty temporary folder for the parts of checkpoint `version` (invisible to resume)."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp_global_step_{version}")
    safe_write.refuse_link(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def atomic_save(root: str, version: int, write: Callable[[str], None], keep: Optional[int] = None) -> str:
    """Call `write(tmp_dir)`, then make it global_step_<version> (commit_checkpoint)."""
    tmp = begin_checkpoint(root, version)
    write(tmp)
    return commit_checkpoint(root, version, tmp, keep)


def commit_checkpoint(root: str, version: int, tmp: str, keep: Optional[int] = None,
                      config: Optional[dict] = None) -> str:
    """Every part is in `tmp`: write `config` (the run's resolved config, if given) and the manifest (last),
    rename it to global_step_<version> (one step: the folder appears complete or not at all), point the
    latest marker at it, and drop all but the newest `keep` checkpoints."""
    if not os.path.isfile(os.path.join(tmp, TRAINER_STATE)):
        raise RuntimeError(f"checkpoint folder {tmp} has no {TRAINER_STATE}: not committed")
    if config is not None:
        safe_write.write_json(os.path.join(tmp, CONFIG), config, indent=1, default=str)
    write_manifest(tmp)
    final = step_dir(root, version)
    safe_write.refuse_link(final)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    safe_write.write_text(os.path.join(root, LATEST), str(version))
    if keep is not None:
        prune(root, version, keep)
    return final


def prune(root: str, version: int, keep: int) -> list[int]:
    """Retention along the timeline being trained: keep checkpoint `version` (the one just written, which the
    marker names) and the newest `keep - 1` older ones; delete the other older ones.  A newer folder is never
    deleted here (it can only be another timeline's, which `retire_abandoned` moved away at start)."""
    older = [v for v in list_checkpoints(root) if v < version]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for old in doomed:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return doomed


def checkpoint_version(path: str) -> int:
    """The param version a checkpoint folder holds (its trainer_state.json)."""
    return int(read_json(os.path.join(path, TRAINER_STATE))["version"])


def retire_abandoned(root: str, resumed_version: int) -> Optional[str]:
    """Resuming from version `resumed_version` (0: a fresh start) abandons every checkpoint of `root` newer than it:
    the run trains another timeline from there, and retention or the next `resume_mode=auto` must not mix the two.
    They are moved (never deleted) into `root/abandoned_after_<resumed_version>[_k]/` and the latest marker points at
    the resumed one (or is removed on a fresh start); returns that folder, None when nothing was newer."""
    newer = [v for v in list_checkpoints(root) if v > resumed_version]
    if not newer:
        return None
    target, k = os.path.join(root, f"abandoned_after_{resumed_version}"), 1
    while os.path.exists(target):
        k += 1
        target = os.path.join(root, f"abandoned_after_{resumed_version}_{k}")
    os.makedirs(target)
    for v in newer:
        os.replace(step_dir(root, v), os.path.join(target, f"global_step_{v}"))
    marker = os.path.join(root, LATEST)
    left = [v for v in list_checkpoints(root) if v <= resumed_version]
    if left:
        safe_write.write_text(marker, str(left[-1]))
    elif os.path.exists(marker):
        os.remove(marker)
    logger.warning("checkpoints %s of %s are newer than the step this run starts from (%d): they belong to the "
                   "abandoned timeline and were moved to %s (delete it when you no longer need them)",
                   ", ".join(f"global_step_{v}" for v in newer), root, resumed_version, target)
    return target


def list_checkpoints(root: str) -> list[int]:
    """Versions of the complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, TRAINER_STATE)):
            found.append(int(m.group(1)))
    return sorted(found)




def _files(folder: str) -> list[str]:
    out = []
    for d, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(d, n), folder) for n in names]
    return sorted(out)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(HASH_CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


def _hash_all(folder: str, rels: list[str]) -> list[str]:
    """sha256 of each file, a few files at a time (hashlib releases the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    paths = [os.path.join(folder, r) for r in rels]
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(4, len(paths))) as pool:
        return list(pool.map(sha256_file, paths))


KEY_ENV = "FULLY_ASYNC_CHECKPOINT_KEY"   # path of the signing key; default ~/.config/fully_async/checkpoint.key


def key_path() -> str:
    return os.environ.get(KEY_ENV) or os.path.join(os.path.expanduser("~"), ".config", "fully_async",
                                                   "checkpoint.key")


def signing_key(create: bool) -> Optional[bytes]:
    """This user's checkpoint signing key (32 random bytes, a file only its owner can read), made on first use when
    `create`; None when there is none and `create` is false."""
    path = key_path()
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        if not create:
            return None
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    key = os.urandom(32)
    safe_write.write_bytes(path, key, perm=0o600)
    logger.info("checkpoint signing key created: %s (keep it with your checkpoints' machine; %s names another)",
                path, KEY_ENV)
    return key


MANIFEST_FORMAT = 2   # 2: the signature covers the format and the file list; 1 (older): the file list only
READ_FORMATS = (1, 2)


def _signature(key: bytes, files: dict, fmt: int = MANIFEST_FORMAT) -> dict:
    import hmac

    signed: Any = files if fmt == 1 else {"format": fmt, "files": files}
    body = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()
    return {"hmac_sha256": hmac.new(key, body, hashlib.sha256).hexdigest(),
            "key_id": hashlib.sha256(key).hexdigest()[:16]}


def _signature_problem(manifest: dict, folder: str) -> Optional[str]:
    """Why the manifest's signature does not hold (None: it does), with what to do."""
    import hmac

    fmt = manifest.get("format")
    if type(fmt) is not int or fmt not in READ_FORMATS:
        return (f"{MANIFEST} has format {fmt!r}, which this version does not read (it reads "
                f"{', '.join(map(str, READ_FORMATS))}): written by a newer version or altered; resume with the version "
                f"that wrote it, or {NO_MANIFEST_FIX.format(path=folder)}")
    sig = manifest.get("signature")
    if not isinstance(sig, dict) or "hmac_sha256" not in sig:
        return (f"{MANIFEST} is not signed (written by hand or by an older version): nothing says this user's runs "
                f"wrote it; {NO_MANIFEST_FIX.format(path=folder)}")
    key = signing_key(create=False)
    if key is None:
        return (f"{MANIFEST} is signed with key {sig.get('key_id')} but there is no key at {key_path()} (copy the key "
                f"of the machine that wrote it there, or point {KEY_ENV} at it)")
    want = _signature(key, manifest["files"], fmt)
    if not hmac.compare_digest(want["hmac_sha256"], str(sig["hmac_sha256"])):
        return (f"{MANIFEST} signature does not verify with the key at {key_path()} (key id {want['key_id']}, the "
                f"manifest's {sig.get('key_id')}): its file list was altered, or another key signed it; "
                f"{NO_MANIFEST_FIX.format(path=folder)}")
    return None


def write_manifest(folder: str) -> dict:
    """manifest.json: {"format", "files": {relative path: {"size", "sha256"}}, "signature"} of every other file in
    `folder`; written last (through a temporary name), so its presence says every file it lists was complete.  The
    signature (HMAC-SHA256 of the format and the file list with this user's key, `signing_key`) says this user's run
    wrote it: someone who can write into the checkpoint folder but cannot read the key cannot make a resume load
    altered files, nor change the format a resume reads them as."""
    rels = [r for r in _files(folder) if r not in (MANIFEST, MANIFEST + ".tmp")]
    files = {r: {"size": os.path.getsize(os.path.join(folder, r)), "sha256": h}
             for r, h in zip(rels, _hash_all(folder, rels))}
    manifest = {"format": MANIFEST_FORMAT, "files": files, "signature": _signature(signing_key(create=True), files)}
    safe_write.write_json(os.path.join(folder, MANIFEST), manifest, indent=1)
    return manifest


def verify_checkpoint(folder: str) -> Optional[list[str]]:
    """Problems of the files of `folder` against its manifest ([]: intact); None when it has no manifest.
    Sizes are compared first (a truncated file costs no hashing), then every checksum."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        manifest = read_json(path)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{MANIFEST} unreadable ({exc})"]
    unsigned = _signature_problem(manifest, folder)
    if unsigned:
        return [unsigned]
    problems, to_hash = [], []
    for rel, meta in sorted(files.items()):
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            problems.append(f"{rel}: missing")
        elif os.path.getsize(full) != meta["size"]:
            problems.append(f"{rel}: {os.path.getsize(full)} bytes, the manifest says {meta['size']}")
        else:
            to_hash.append(rel)
    for rel, digest in zip(to_hash, _hash_all(folder, to_hash)):
        if digest != files[rel]["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    return problems


def _set_aside(folder: str) -> str:
    target, i = folder + ".broken", 1
    while os.path.exists(target):
        i += 1
        target = f"{folder}.broken{i}"
    os.replace(folder, target)
    return target


NO_MANIFEST_FIX = ("if you trust its files, write (and sign) its manifest with `python -c \"from "
                   "fully_async.core.checkpoint import write_manifest; write_manifest('{path}')\"`")


def find_resume_path(trainer_cfg: Any) -> Optional[str]:
    """The checkpoint to resume from according to trainer.resume_mode (None: start fresh), its manifest
    verified.  auto: a newest checkpoint that is damaged or has no manifest (an interrupted or foreign folder:
    nothing says its files are complete) is set aside (renamed global_step_<v>.broken, never deleted) with a warning
    naming the problem, and the newest intact older one is used; none intact, or a resume_from_path that is
    damaged or has no manifest: CheckpointError naming the files and what to do."""
    mode = trainer_cfg.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = trainer_cfg.resume_from_path
        problems = verify_checkpoint(path)
        if problems is None:
            raise CheckpointError(f"checkpoint {path} (trainer.resume_from_path) has no {MANIFEST}, so nothing says "
                                  f"its files are complete and unchanged; {NO_MANIFEST_FIX.format(path=path)}, "
                                  "or resume from another checkpoint")
        if problems:
            raise CheckpointError(f"checkpoint {path} (trainer.resume_from_path) is damaged: "
                                  f"{'; '.join(problems)}")
        return path
    root = trainer_cfg.default_local_dir
    broken: list[str] = []
    for version in reversed(list_checkpoints(root)):
        path = step_dir(root, version)
        problems = verify_checkpoint(path)
        if problems == []:
            return path
        problems = problems or [f"no {MANIFEST}"]
        aside = _set_aside(path)
        broken.append(f"{path}: {'; '.join(problems)}")
        logger.warning("checkpoint %s is damaged (%s); set aside as %s, trying the previous one", path,
                       "; ".join(problems), aside)
    if broken:
        raise CheckpointError(f"no intact checkpoint in {root} to resume from (trainer.resume_mode=auto): "
                              f"{' | '.join(broken)}; the folders were renamed *.broken (one without a manifest "
                              f"can be trusted by hand: {NO_MANIFEST_FIX.format(path='<folder>')}, then rename it "
                              "back); or start fresh with trainer.resume_mode=disable or another "
                              "trainer.default_local_dir")
    return None


def flatten(tree: Any, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _backend_of(flat: dict, strategy: Any) -> Any:
    """strategy=fsdp is what config.fsdp_backend makes of the trainer's devices and dtype, so a checkpoint written
    under `torch` resumes under verl's default `fsdp` on one float32 device."""
    from fully_async.core.config import fsdp_backend

    if strategy != "fsdp":
        return strategy
    world = int(flat.get("trainer.nnodes") or 1) * int(flat.get("trainer.n_gpus_per_node") or 1)
    return fsdp_backend(world, str(flat.get("actor_rollout_ref.actor.dtype") or "float32"))


ASYNC_INERT_KEYS = ("data.train_batch_size",)  # RESUME_STATE_KEYS that async mode does not use


def _check_backend_files(path: str, backend: Any) -> None:
    """The trainer's part of the checkpoint is in the format of the backend that will load it: plain torch writes
    actor_optim.pt, fsdp2 its shards (fsdp/).  verl's `fsdp` on one bf16/fp16 device was plain torch before it kept
    float32 masters there (config.fsdp_backend), so such a checkpoint names the strategy that reads it."""
    has_shards = os.path.isdir(os.path.join(path, "fsdp"))
    has_plain = os.path.isfile(os.path.join(path, "actor_optim.pt"))
    if backend == "fsdp2" and has_plain and not has_shards:
        raise CheckpointError(f"cannot resume from {path}: its trainer state was written by the plain torch backend "
                              "(actor_optim.pt, parameters in the actor's dtype), and this config trains with fsdp2 "
                              "(float32 master weights; verl's fsdp on one bf16/fp16 device is fsdp2 now).  Resume "
                              "it with actor_rollout_ref.actor.strategy=torch, or start fresh "
                              "(trainer.resume_mode=disable or another trainer.default_local_dir)")
    if backend == "torch" and has_shards and not has_plain:
        raise CheckpointError(f"cannot resume from {path}: its trainer state is fsdp2 shards (fsdp/), and this config "
                              "trains with the plain torch backend.  Resume it with "
                              "actor_rollout_ref.actor.strategy=fsdp2, or start fresh (trainer.resume_mode=disable "
                              "or another trainer.default_local_dir)")


def check_resume_config(path: str, new_config: dict, allow: Any = ()) -> None:
    """Refuse to resume from `path` when a key of config.RESUME_STATE_KEYS differs between the config saved
    there and `new_config` (both resolved, nested dicts) and is not named in `allow`
    (trainer.resume_allow_config_change); other keys may change freely."""
    from fully_async.core.config import RESUME_STATE_KEYS, as_file_list

    saved_path = os.path.join(path, CONFIG)
    if not os.path.isfile(saved_path):
        logger.warning("checkpoint %s has no %s (written by an older version): config changes since it was "
                       "saved cannot be checked", path, CONFIG)
        return
    old, new = flatten(read_json(saved_path)), flatten(json.loads(json.dumps(new_config, default=str)))
    changed, accepted = [], []
    for key in RESUME_STATE_KEYS:
        if key in ASYNC_INERT_KEYS and old.get("mode") == new.get("mode") == "async":
            continue
        a, b = old.get(key), new.get(key)
        if key.endswith("_files"):
            a, b = (as_file_list(v) if v else v for v in (a, b))
        if key == "actor_rollout_ref.actor.strategy":  # verl's fsdp is the backend it selects (config.actor_strategy)
            a, b = _backend_of(old, a), _backend_of(new, b)
        if a != b:
            (accepted if key in set(allow or ()) else changed).append(f"{key}: {a!r} -> {b!r}")
    _check_backend_files(path, _backend_of(new, new.get("actor_rollout_ref.actor.strategy")))
    if accepted:
        logger.warning("resuming from %s with changed keys accepted by trainer.resume_allow_config_change: %s",
                       path, "; ".join(accepted))
    if changed:
        keys = [c.split(":", 1)[0] for c in changed]
        raise CheckpointError(
            f"cannot resume from {path}: these keys changed since the checkpoint was saved and would change the "
            f"meaning of its saved state: {'; '.join(changed)}.  Restore the old values, start fresh "
            "(trainer.resume_mode=disable or another trainer.default_local_dir), or accept the change with "
            f"trainer.resume_allow_config_change=[{','.join(keys)}]")


STATE_KEYS = {TRAINER_STATE: ("step", "version", "trained_sample_ids"),
              ROLLOUT_STATE: {"async": ("stream", "staleness", "groups", "pending"), "sync": ("stream",)}}


def check_resume_state(path: str, mode: str, total_steps: int, trains: bool = True) -> int:
    """Before Ray starts: the checkpoint's state files hold what this version's `mode` continues from (an older
    format is refused naming the file and the keys it lacks), and, for a run that `trains` (not trainer.val_only),
    it is short of the run's `total_steps` (a run resumed at or past its end would train nothing).  Returns the
    checkpoint's step."""
    def keys_of(name: str, want: tuple) -> dict:
        full = os.path.join(path, name)
        try:
            state = read_json(full) if name == TRAINER_STATE else read_state(full)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot resume from {path}: {full} is unreadable ({exc})") from None
        missing = [k for k in want if not isinstance(state, dict) or k not in state]
        if missing:
            raise CheckpointError(
                f"cannot resume from {path}: {full} lacks {', '.join(map(repr, missing))} (it was written by an older "
                f"version, whose {mode}-mode state this one cannot continue exactly).  Resume it with the version "
                "that wrote it, start fresh from its weights (actor_rollout_ref.model.path="
                f"{os.path.join(path, 'actor')} trainer.resume_mode=disable), or start fresh")
        return state

    step = int(keys_of(TRAINER_STATE, STATE_KEYS[TRAINER_STATE])["step"])
    if os.path.exists(os.path.join(path, ROLLOUT_STATE)) or os.path.exists(os.path.join(path, "rollout_state.pkl")):
        keys_of(ROLLOUT_STATE, STATE_KEYS[ROLLOUT_STATE].get(mode, ()))
    if trains and step >= total_steps:
        raise CheckpointError(
            f"cannot resume from {path}: it was saved after step {step}, and this run trains {total_steps} steps "
            "(trainer.total_training_steps, or what the data and trainer.total_epochs fill), so nothing is left to "
            f"train.  Raise trainer.total_training_steps above {step} to train on from it, or start fresh "
            "(trainer.resume_mode=disable or another trainer.default_local_dir)")
    return step


def write_json(path: str, data: Any) -> None:
    safe_write.write_json(path, data)


def read_json(path: str) -> Any:
    with open(path) as fh:
        return json.load(fh)


def dir_size_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

