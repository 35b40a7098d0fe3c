"""Whether the Hugging Face hub can be reached, asked once per process, so that an input naming a hub id fails in
seconds with its name instead of after half a minute of retries.

Without a network, transformers, datasets and huggingface_hub each retry every request (27-50 s per input) and
then raise a traceback that does not say which input was at fault. One short probe of the hub endpoint (bounded,
DNS included) answers for the whole process; when it fails, HF_HUB_OFFLINE is set so that the libraries use their
local cache at once (an id cached earlier still loads), and what is not cached fails naming the input.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from typing import Optional

PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")
_reachable: Optional[bool] = None
_why_unreachable = ""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline_by_setting() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def _probe(url: str, timeout: float) -> bool:
    """An HTTP answer of any status within `timeout` (name resolution included; proxies from the environment)."""
    answered = threading.Event()

    def ask() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            answered.set()
        except urllib.error.HTTPError:  # the hub answered, with an error status: it is reachable
            answered.set()
        except Exception:
            pass

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return answered.is_set()


def reachable() -> bool:
    """True when the hub answers; asked once per process. False also sets HF_HUB_OFFLINE=1 (cache only)."""
    global _reachable, _why_unreachable
    if _reachable is None:
        if offline_by_setting():
            _reachable, _why_unreachable = False, "HF_HUB_OFFLINE is set"
        else:
            _reachable = _probe(endpoint(), PROBE_TIMEOUT_S)
            _why_unreachable = f"{endpoint()} did not answer within {PROBE_TIMEOUT_S:g} s"
        if not _reachable:
            os.environ["HF_HUB_OFFLINE"] = "1"
            _apply_offline_to_loaded_libraries()
    return _reachable


def _apply_offline_to_loaded_libraries() -> None:
    """huggingface_hub reads HF_HUB_OFFLINE at import; a process that imported it already is told directly."""
    import sys

    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True


def unreachable_message(option: str, hub_id: str, what: str) -> str:
    return (f"--{option}: {hub_id!r} is a Hugging Face hub {what} id, but the hub cannot be reached "
            f"({_why_unreachable}) and it "
            f"is not in the local cache: give a local path to the {what} instead, or run where the hub is reachable")


def load_hub_id(load, *, option: str, hub_id: str, what: str):
    """`load()` of a hub id. With the hub unreachable it reads the local cache at once (no retries), and a miss
    is a ValueError naming the option, the id and the fix."""
    if reachable():
        return load()
    try:
        return load()
    except Exception as err:
        raise ValueError(unreachable_message(option, hub_id, what)) from err
