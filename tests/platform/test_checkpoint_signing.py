"""Checkpoint keys and the signing rule (issue 35): the per-user key made once, where no key may be made,
the single opt-in for unsigned checkpoints, and signed skip marks. Training-level tests of the same rules
(pickle payloads, planted SKIPPED.json) are in test_checkpoint.py."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fuseforge_flyte.training.checkpoint.signing import (KEY_ENV, KEY_FILE_ENV, REQUIRE_KEY_ENV, Signing,
                                                          SigningError, user_key_path)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_key(tmp_path, monkeypatch):
    """No key configured, outside a pod, and a fresh config directory: the per-user key's home."""
    for name in (KEY_ENV, KEY_FILE_ENV, REQUIRE_KEY_ENV, "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "fuseforge" / "checkpoint-key"


def test_the_per_user_key_is_made_once_private_and_logged(no_key, caplog):
    assert user_key_path() == no_key
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        first = Signing("/ckpt", allow_unsigned=False)
    assert first.key is not None and first.key.source == str(no_key)
    assert stat.S_IMODE(no_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(no_key.parent.stat().st_mode) == 0o700
    assert len(no_key.read_bytes().strip()) == 64  # 32 random bytes, hex
    created = [r for r in caplog.records if r.levelno == logging.WARNING and str(no_key) in r.getMessage()]
    assert len(created) == 1 and "created the checkpoint key" in created[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fuseforge.training"):
        again = Signing("/ckpt", allow_unsigned=False)
    assert again.key == first.key  # made once: the next run signs and verifies with the same key
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(str(no_key) in r.getMessage() for r in caplog.records)  # its path, at INFO
    assert list(no_key.parent.iterdir()) == [no_key]  # no temporary files left


def test_concurrent_ranks_end_up_with_one_key(no_key):
    """Ranks of one host start together: exactly one key may win, and nobody reads a half-written one."""
    code = ("from fuseforge_flyte.training.checkpoint.signing import Signing; "
            "print(Signing('/ckpt', allow_unsigned=False, log_it=False).key.key_id)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "kernels"), str(ROOT / "workflows")]))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for _ in range(4)]
    ids = set()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        ids.add(out.strip())
    assert len(ids) == 1
    assert list(no_key.parent.iterdir()) == [no_key]


def test_a_key_others_can_read_is_refused_with_the_fix(no_key):
    Signing("/ckpt", allow_unsigned=False, log_it=False)
    no_key.chmod(0o644)
    with pytest.raises(SigningError, match=rf"{no_key} must belong to you and be readable by you only .*mode "
                                           rf"0644.*chmod 600 {no_key}"):
        Signing("/ckpt", allow_unsigned=False)


def test_a_configured_key_wins_and_no_user_key_is_made(no_key, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "a-configured-key-0123456789")
    signing = Signing("/ckpt", allow_unsigned=False)
    assert signing.key.source == KEY_ENV and not no_key.exists()


@pytest.mark.parametrize("where, variable", [("a pod", "KUBERNETES_SERVICE_HOST"), ("required", REQUIRE_KEY_ENV)])
def test_no_user_key_where_it_could_not_last_or_a_configured_one_is_required(no_key, monkeypatch, caplog, where,
                                                                             variable):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(SigningError, match=rf"checkpoint_dir '/ckpt': no checkpoint key is set and .*{KEY_ENV}.*"
                                           rf"{KEY_FILE_ENV}.*set allow_unsigned_checkpoints=true"):
        Signing("/ckpt", allow_unsigned=False)
    assert not no_key.exists()
    with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
        unsigned = Signing("/ckpt", allow_unsigned=True)
    assert unsigned.key is None and not no_key.exists()
    assert any("saved unsigned" in r.getMessage() and "/ckpt" in r.getMessage() for r in caplog.records)
    body = {"format": 2, "files": {}}
    assert unsigned.sign(body) == body


def _signed(signing, **body):
    return signing.sign(dict({"format": 2, "step": 2, "files": {}}, **body))


def test_only_the_opt_in_lets_an_unsigned_or_foreign_manifest_through_and_says_so_first(no_key, monkeypatch, caplog):
    ours = Signing("/ckpt", allow_unsigned=False, log_it=False)
    monkeypatch.setenv(KEY_ENV, "another-key-0123456789abcdef")
    foreign = _signed(Signing("/ckpt", allow_unsigned=False, log_it=False))
    monkeypatch.delenv(KEY_ENV)
    unsigned = {"format": 2, "step": 2, "files": {}}
    assert ours.refusal(_signed(ours), "step_2") is None
    assert "not signed: it cannot be authenticated" in ours.refusal(unsigned, "step_2")
    assert "signed with another key" in ours.refusal(foreign, "step_2")
    opted_in = Signing("/ckpt", allow_unsigned=True, log_it=False)
    for manifest, problem in ((unsigned, "not signed"), (foreign, "signed with another key")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fuseforge.training"):
            assert opted_in.refusal(manifest, "/ckpt/step_2") is None
        (record,) = caplog.records
        assert "/ckpt/step_2" in record.getMessage() and problem in record.getMessage()
        assert "allow_unsigned_checkpoints" in record.getMessage()
    # Changed after it was signed with this very key: tampering, refused even under the opt-in.
    tampered = dict(_signed(ours), step=3)
    assert "signature does not match" in opted_in.refusal(tampered, "step_2")


def test_skip_marks_are_signed_and_bound_to_their_manifest(no_key):
    signing = Signing("/ckpt", allow_unsigned=False, log_it=False)
    manifest = _signed(signing)
    mark = signing.skip_mark("step_00000002", manifest, "file model.pt is truncated")
    assert signing.skip_reason("step_00000002", manifest, mark) == ("file model.pt is truncated", None)
    planted = {"reason": "looks official", "time": 0}
    assert signing.skip_reason("step_00000002", manifest, planted)[0] is None
    assert signing.skip_reason("step_00000004", manifest, mark)[0] is None  # another checkpoint's mark
    rewritten = dict(manifest, time=1.0)  # the checkpoint was written again since it was judged
    assert signing.skip_reason("step_00000002", rewritten, mark)[0] is None
    assert signing.skip_reason("step_00000002", manifest, dict(mark, reason="other"))[0] is None
    assert signing.skip_reason("step_00000002", manifest, [1, 2])[0] is None
    unsigned = Signing("/ckpt", allow_unsigned=True, log_it=False)
    unsigned.key = None
    assert unsigned.skip_mark("step_00000002", manifest, "x") is None  # nothing to sign it with: none written
