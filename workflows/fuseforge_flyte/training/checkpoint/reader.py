"""Reading a checkpoint root, trusting only what verifies: signed manifests, hashed trainer states, signed skip marks.

Before any checkpoint byte reaches a loader (FSDP's DCP unpickles ``.metadata``; DeepSpeed's engine would use
``torch.load(weights_only=False)``; both are read through allow-lists (dcp_metadata.py), and still: whoever can
rewrite a checkpoint must not choose what is loaded), the manifest's HMAC is checked (signing.py), then its shape; the trainer state is read only once its bytes
match the manifest's sha256.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

from fuseforge_flyte.training.checkpoint.errors import CheckpointUserError
from fuseforge_flyte.training.checkpoint.integrity import check_bytes
from fuseforge_flyte.training.checkpoint.layout import (FORMAT_VERSION, MARKER, SKIPPED, STATE, Entry,
                                                        manifest_shape_problem)
from fuseforge_flyte.training.checkpoint.signing import Signing, SigningError
from fuseforge_flyte.training.checkpoint.storage import Store

log = logging.getLogger("fuseforge.training")


def newest_verified(readers: "List[CheckpointReader]") -> "Optional[Tuple[CheckpointReader, Entry, Dict]]":
    """(its root, checkpoint, trainer state) of the newest verified checkpoint of any of `readers` (the first
    reader's on a tie), or None."""
    found = []
    for index, reader in enumerate(readers):
        newest = next(reader.verified_states(), None)
        if newest is not None:
            found.append((newest[0].step, -index, reader, newest[0], newest[1]))
    if not found:
        return None
    _, _, reader, entry, state = max(found, key=lambda item: item[:2])
    return reader, entry, state


class CheckpointReader:
    """Reads a checkpoint root and trusts only what verifies: signed manifests, hashed trainer states, signed
    skip marks. The workers' CheckpointManager builds on it; the launching process uses it alone to look at a
    run's checkpoints before any worker starts (compatibility.check_resume_settings)."""

    def __init__(self, root: str, *, allow_unsigned: bool, log_it: bool):
        self.store = Store(root)
        try:
            self.signing = Signing(root, allow_unsigned=allow_unsigned, log_it=log_it)
        except SigningError as err:
            raise CheckpointUserError(str(err)) from None

    def verified_states(self) -> Iterator[Tuple[Entry, Dict]]:
        """(checkpoint, trainer state) of each complete, unskipped checkpoint that verifies, newest first."""
        for entry in reversed([e for e in self._entries(log_it=False) if e.complete and not e.skipped]):
            _, state, reason = self._read_verified(entry, warn=False)
            if reason is None:
                yield entry, state

    def _entries(self, log_it: bool) -> List[Entry]:
        """Rank 0: the store's checkpoints; a skip mark counts only when it is signed for its manifest."""
        entries = self.store.list()
        for entry in entries:
            if entry.complete and entry.marked:
                entry.skip_reason = self._trusted_skip_reason(entry, log_it)
        return entries

    def _trusted_skip_reason(self, entry: Entry, log_it: bool) -> Optional[str]:
        try:
            marker = json.loads(self.store.fs.cat_file(self.store.path(entry.name, MARKER)))
            mark = json.loads(self.store.fs.cat_file(self.store.path(entry.name, SKIPPED)))
        except (OSError, ValueError) as err:
            reason, problem = None, f"it cannot be read ({type(err).__name__}: {err})"
        else:
            reason, problem = self.signing.skip_reason(entry.name, marker, mark)
        if problem and log_it:
            log.warning("ignoring %s in checkpoint %s: %s", SKIPPED, self.store.path(entry.name), problem)
        return reason

    def _read_verified(self, entry: Entry, warn: bool) -> Tuple[Any, Optional[Dict], Optional[str]]:
        """(manifest, trainer state, None) once the manifest authenticates and the state matches its hash;
        (manifest or None, None, why not) otherwise. `warn`: log the opt-in warning for an unsigned one."""
        marker, reason = self._read_manifest(entry)
        if reason:
            return None, None, reason
        reason = self._authenticate(marker, entry, warn)
        if reason:
            return marker, None, reason
        try:
            data = self.store.fs.cat_file(self.store.path(entry.name, STATE))
        except OSError as err:
            return marker, None, f"file {STATE} is unreadable ({type(err).__name__}: {err})"
        reason = check_bytes(STATE, data, marker["files"][STATE])
        if reason:
            return marker, None, reason
        try:
            state = json.loads(data)
        except ValueError as err:
            return marker, None, f"file {STATE} is not JSON ({err})"
        if not isinstance(state, dict) or state.get("step") != entry.step or state.get("format") != FORMAT_VERSION:
            return marker, None, f"{STATE} does not belong to step {entry.step} in format {FORMAT_VERSION}"
        return marker, state, None

    def _read_manifest(self, entry: Entry) -> Tuple[Any, Optional[str]]:
        """(the manifest's JSON, None), or (None, why it cannot be read), said as what it is: unreadable,
        binary garbage, not JSON."""
        try:
            data = self.store.fs.cat_file(self.store.path(entry.name, MARKER))
        except OSError as err:
            return None, f"its manifest {MARKER} cannot be read ({type(err).__name__}: {err})"
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None, f"its manifest {MARKER} is not text ({len(data)} bytes of binary data): it was overwritten"
        try:
            return json.loads(text), None
        except ValueError as err:
            return None, f"its manifest {MARKER} is not valid JSON ({err}): it was cut short or overwritten"

    def _authenticate(self, marker: Any, entry: Entry, warn: bool = True) -> Optional[str]:
        """Why the manifest cannot be trusted, or None: its signature (signing.Signing), then its shape."""
        if not isinstance(marker, dict) or not marker:
            return (f"its manifest {MARKER} is {json.dumps(marker)[:40]}, not a checkpoint manifest: no save writes "
                    f"that (it was emptied or overwritten)")
        if "format" not in marker and isinstance(marker.get("files"), dict):
            return (f"manifest format 1, this code reads {FORMAT_VERSION} (written by an older fuseforge without "
                    f"content hashes: it cannot be verified)")
        if marker.get("format") != FORMAT_VERSION:
            return (f"its manifest {MARKER} has format {marker.get('format')!r}, this code reads {FORMAT_VERSION}: "
                    f"not a manifest this fuseforge writes")
        reason = self.signing.refusal(marker, self.store.path(entry.name), warn=warn)
        if reason:
            return reason
        if marker.get("step") != entry.step:
            return f"the manifest is for step {marker.get('step')!r}, not {entry.step}"
        return manifest_shape_problem(marker)
