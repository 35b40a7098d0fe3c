"""`pyflyte run --remote` of this checkout's workflows ships the whole source root, not only loaded modules.

Its default `--copy auto` uploads the modules loaded at registration that lie under the source root, and the
task pod puts that archive first on sys.path. Run from this checkout, the archive then holds a partial
`fuseforge_flyte` (no lazily imported module such as the training engine or data fingerprints, no package
data such as the builtin tokenizer) that hides the image's whole one: the first task fails with "No module
named fuseforge_flyte.data.fingerprint". `pyflyte register` copies everything by default and is unaffected;
a user's own source root without fuseforge_flyte in it (examples/flyte) is left as the user chose.
"""

from __future__ import annotations

from pathlib import Path

import fuseforge_flyte


def ship_whole_source_root() -> None:
    """Turn `--copy auto` into `--copy all` for a `pyflyte run --remote` whose source root holds this package.

    Runs while pyflyte loads the workflow file (click's context is there), before it packs the archive."""
    import click
    from flytekit.constants import CopyFileDetection

    ctx = click.get_current_context(silent=True)
    params = ctx.obj if ctx is not None else None
    if getattr(params, "is_remote", False) is not True or getattr(params, "copy", None) != CopyFileDetection.LOADED_MODULES:
        return
    root = getattr(getattr(params, "computed_params", None), "project_root", None)
    package = Path(fuseforge_flyte.__file__).resolve().parent
    if root and package.is_relative_to(Path(root).resolve()):
        params.copy = CopyFileDetection.ALL
