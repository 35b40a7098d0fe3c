"""Who may have written a checkpoint: its signing key, and the one opt-in to load what is not signed.

Resuming unpickles checkpoint files (torch DCP's ``.metadata``, DeepSpeed's loader), so a checkpoint
is only loaded when its manifest carries an HMAC-SHA256 made with this run's key. The key is, in order:

- ``FUSEFORGE_CHECKPOINT_KEY`` (the secret) or ``FUSEFORGE_CHECKPOINT_KEY_FILE`` (a file holding it, e.g. a
  Kubernetes Secret mounted into the training pods); at least 16 bytes;
- otherwise a per-user key, made once (32 random bytes, hex) at ``$XDG_CONFIG_HOME/fuseforge/checkpoint-key``
  (``~/.config/...``), mode 0600, its path logged: local runs sign and verify like cluster runs. None is
  made inside a Kubernetes pod (it would die with the pod, and a retry could no longer verify its own
  checkpoints) nor when ``FUSEFORGE_CHECKPOINT_REQUIRE_KEY=1`` asks for a configured key.

``allow_unsigned_checkpoints`` (TrainSpec, [checkpoint] in platform.toml, the workflows' input) is the only
way to load a checkpoint that is unsigned or signed with another key: a warning naming the checkpoint comes
before any of its bytes are loaded, and its files are still checked against the manifest's sha256 hashes
(integrity, not authenticity). With it and no key at all, checkpoints are also saved unsigned (said once).
A manifest signed with this run's key that no longer matches its signature is refused even then.

``SKIPPED.json`` (a checkpoint that failed and was passed over) is signed too, bound to the manifest it
judged: a mark without a valid signature is ignored, with a warning, so a planted one cannot make a run
fall back to an older checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

log = logging.getLogger("fuseforge.training")

KEY_ENV = "FUSEFORGE_CHECKPOINT_KEY"
KEY_FILE_ENV = "FUSEFORGE_CHECKPOINT_KEY_FILE"
# "1": a configured key is required (no per-user key), e.g. for a local copy of bucket data (Flyte's intra-task
# checkpoint restored from the bucket); the chart sets it in the training pods
REQUIRE_KEY_ENV = "FUSEFORGE_CHECKPOINT_REQUIRE_KEY"
OPT_IN = "allow_unsigned_checkpoints"  # the TrainSpec field, [checkpoint] key and workflow input
MIN_KEY_BYTES = 16
USER_KEY_NAME = "checkpoint-key"
_POD_ENV = "KUBERNETES_SERVICE_HOST"  # set by the kubelet in every container of a pod


class SigningError(ValueError):
    """No usable key: the message names where it looked and what to set."""


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True)
class CheckpointKey:
    secret: bytes
    source: str  # where it came from, for messages

    @property
    def key_id(self) -> str:
        """A short public name of the key, so that "signed with another key" can be told from "changed"."""
        return hashlib.sha256(b"fuseforge-checkpoint-key-id\0" + self.secret).hexdigest()[:12]

    def mac(self, body: Dict) -> str:
        return hmac.new(self.secret, _canonical(body), hashlib.sha256).hexdigest()


def _checked(secret: bytes, source: str) -> CheckpointKey:
    if len(secret) < MIN_KEY_BYTES:
        raise SigningError(f"the checkpoint key from {source} has {len(secret)} bytes; use at least {MIN_KEY_BYTES} "
                           f"random bytes (e.g. `openssl rand -hex 32`)")
    return CheckpointKey(secret, source)


def configured_key() -> Optional[CheckpointKey]:
    """The key from FUSEFORGE_CHECKPOINT_KEY or FUSEFORGE_CHECKPOINT_KEY_FILE; None if neither is set."""
    value, path = os.environ.get(KEY_ENV, ""), os.environ.get(KEY_FILE_ENV, "")
    if value and path:
        raise SigningError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: set one")
    if path:
        try:
            with open(path, "rb") as handle:
                return _checked(handle.read().strip(), f"{KEY_FILE_ENV}={path}")
        except OSError as err:
            raise SigningError(f"{KEY_FILE_ENV}={path!r}: cannot read the checkpoint key ({err})") from None
    if value:
        return _checked(value.strip().encode(), KEY_ENV)
    return None


def user_key_path() -> Path:
    """Where the per-user key lives: $XDG_CONFIG_HOME/fuseforge/checkpoint-key (default ~/.config)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "fuseforge" / USER_KEY_NAME


def _why_no_user_key() -> Optional[str]:
    if os.environ.get(REQUIRE_KEY_ENV, "").strip().lower() in ("1", "true", "yes"):
        return f"{REQUIRE_KEY_ENV} is set, so a configured key is required"
    if os.environ.get(_POD_ENV):
        return ("this runs in a Kubernetes pod, where a key made on the spot would die with the pod and a retry "
                "could not verify the checkpoints (the fuseforge chart mounts one into the training pods)")
    return None


def _read_user_key(path: Path) -> CheckpointKey:
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SigningError(f"the checkpoint key {path} must belong to you and be readable by you only (it is "
                           f"uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}): `chmod 600 {path}`, or "
                           f"delete it to have a new one made (checkpoints signed with it can then not be resumed)")
    return _checked(path.read_bytes().strip(), str(path))


def _create_user_key(path: Path) -> bool:
    """Write a new random key to `path` unless another process got there first; True if this one did.

    Written to a private temporary file, then hard-linked into place: a concurrent reader (another rank)
    sees either no key or the whole key, and only one key ever wins."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{USER_KEY_NAME}-")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_hex(32).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def user_key(log_it: bool = True) -> CheckpointKey:
    """The per-user key, made on first use (0600, path logged)."""
    path = user_key_path()
    try:
        created = not path.exists() and _create_user_key(path)
        key = _read_user_key(path)
    except OSError as err:
        raise SigningError(f"cannot make or read the per-user checkpoint key {path} ({err}): set {KEY_FILE_ENV} to a "
                           f"file holding a key (`openssl rand -hex 32`), or XDG_CONFIG_HOME to a writable "
                           f"directory") from None
    if log_it and created:
        log.warning("created the checkpoint key %s (mode 0600): this user's checkpoints are signed with it and "
                    "only checkpoints signed with it are resumed. Keep it; copy it (or set %s) where those "
                    "checkpoints must be resumed", path, KEY_FILE_ENV)
    elif log_it:
        log.info("checkpoints are signed with the per-user key %s", path)
    return key


class Signing:
    """One run's signing rule: the key it signs with, and whether unsigned checkpoints may be loaded."""

    def __init__(self, where: str, *, allow_unsigned: bool, log_it: bool = True):
        self.where = where
        self.allow_unsigned = bool(allow_unsigned)
        self.key = configured_key()
        if self.key is None:
            why_not = _why_no_user_key()
            if why_not is None:
                self.key = user_key(log_it)
            elif not self.allow_unsigned:
                raise SigningError(
                    f"checkpoint_dir {where!r}: no checkpoint key is set and {why_not}. Resuming loads files that are "
                    f"unpickled, so whoever can write the checkpoints could run code in the training processes. Set "
                    f"{KEY_ENV} (a secret of at least {MIN_KEY_BYTES} bytes, e.g. `openssl rand -hex 32`) or "
                    f"{KEY_FILE_ENV} (a file holding it, e.g. a mounted Kubernetes Secret) in the training "
                    f"environment; or set {OPT_IN}=true to save and load unsigned checkpoints")
            elif log_it:
                log.warning("no checkpoint key (%s) and %s is set: checkpoints in %s are saved unsigned and loaded "
                            "after an integrity check only, so anyone who can write there can make a resume run "
                            "code", why_not, OPT_IN, where)

    # ------------------------------------------------------------ manifests

    def sign(self, body: Dict) -> Dict:
        """The manifest as written: with the key's id and the HMAC over the rest, or as it is without a key."""
        if self.key is None:
            return body
        body = dict(body, key_id=self.key.key_id)
        return dict(body, hmac=self.key.mac(body))

    def problem(self, signed: Dict, what: str) -> Tuple[Optional[str], bool]:
        """(why `signed` (a manifest, the progress record) is not signed by this run's key, or None; whether it
        claims this run's key: then a mismatch means it was changed, which no opt-in lets through)."""
        mac = signed.get("hmac")
        if self.key is not None and isinstance(mac, str) and mac and signed.get("key_id") == self.key.key_id:
            body = {k: v for k, v in signed.items() if k != "hmac"}
            try:
                expected = self.key.mac(body)
            except ValueError as err:
                return f"{what} cannot be canonicalised ({err})", True
            if hmac.compare_digest(mac.encode("utf-8", "replace"), expected.encode()):
                return None, True
            return f"{what}'s signature does not match: it was changed after it was written", True
        if not isinstance(mac, str) or not mac:
            return "not signed", False
        if self.key is None:
            return f"signed with key id {signed.get('key_id')!r}, and this run has no key", False
        return (f"signed with another key (key id {signed.get('key_id')!r}; this run's key, from "
                f"{self.key.source}, has id {self.key.key_id!r})"), False

    def refusal(self, marker: Dict, checkpoint: str, warn: bool = True) -> Optional[str]:
        """Why the manifest of `checkpoint` must not be trusted, or None. An unsigned or foreign-key manifest
        passes only under the opt-in, and then (`warn`) with a warning logged here, before anything is loaded."""
        problem, own = self.problem(marker, "the manifest")
        if problem is None or own:
            return problem
        if not self.allow_unsigned:
            return (f"{problem}: it cannot be authenticated, so it is not loaded (set {OPT_IN}=true to load it "
                    f"anyway, checked for integrity only)")
        if warn:
            log.warning("checkpoint %s is %s; loading it anyway because %s is set: its files are checked against "
                        "the manifest's hashes only, so whoever could write it can run code in this run",
                        checkpoint, problem, OPT_IN)
        return None

    # ------------------------------------------------------------ skip marks

    def _skip_body(self, checkpoint_name: str, marker: Dict, reason: str) -> Dict:
        return {"checkpoint": checkpoint_name, "manifest_sha256": hashlib.sha256(_canonical(marker)).hexdigest(),
                "reason": reason}

    def skip_mark(self, checkpoint_name: str, marker: Any, reason: str) -> Optional[Dict]:
        """The SKIPPED.json of a checkpoint passed over, bound to its manifest; None without a key (then
        none is written and the checkpoint is simply checked again next time)."""
        if self.key is None or not isinstance(marker, dict):
            return None
        try:
            body = self._skip_body(checkpoint_name, marker, reason)
            return dict(body, key_id=self.key.key_id, hmac=self.key.mac(body))
        except ValueError:  # a manifest JSON cannot restate (NaN): nothing to bind the mark to
            return None

    def skip_reason(self, checkpoint_name: str, marker: Any, mark: Any) -> Tuple[Optional[str], Optional[str]]:
        """(the recorded reason if `mark` is a valid skip mark of this manifest, why it is not)."""
        if self.key is None:
            return None, "this run has no key to verify it with"
        if not isinstance(mark, dict) or not isinstance(marker, dict) or not isinstance(mark.get("reason"), str):
            return None, "it is not a skip mark this code wrote"
        try:
            expected = self.key.mac(self._skip_body(checkpoint_name, marker, mark["reason"]))
        except ValueError as err:
            return None, f"it cannot be canonicalised ({err})"
        mac = mark.get("hmac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac.encode("utf-8", "replace"), expected.encode()):
            return None, "its signature does not match this checkpoint's manifest and this run's key"
        return mark["reason"], None
