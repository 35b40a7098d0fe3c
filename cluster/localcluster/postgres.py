"""PostgreSQL from the machine's packages, for Flyte's metadata: a fresh cluster in the state dir."""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path

from .layout import HOST, PORTS

USER = "postgres"  # the OS account the server runs as (it refuses to run as root)
DATABASE = "flyte"
ROLE = "flyte"


def bin_dir() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not candidates:
        raise RuntimeError("PostgreSQL is not installed: apt-get install -y postgresql (Debian's package)")
    return Path(candidates[-1]).parent


def _as_postgres() -> list[str]:
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(USER)
    except KeyError:
        raise RuntimeError(f"no OS user {USER!r}: install Debian's postgresql package") from None
    return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--init-groups", "--"]


def init(data: Path, password_file: Path) -> None:
    """initdb with scram authentication; the `flyte` role's password is generated into password_file."""
    if (data / "PG_VERSION").exists():
        return
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    password_file.parent.mkdir(parents=True, exist_ok=True)
    password_file.write_text(secrets.token_urlsafe(24))
    password_file.chmod(0o600)
    if os.geteuid() == 0:
        shutil.chown(data, USER, USER)
    subprocess.run(
        [*_as_postgres(), str(bin_dir() / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
         "--no-sync", "-E", "UTF8", "--locale=C"],
        check=True, capture_output=True,
    )
    # Only the local socket trusts; TCP (what Flyte uses) needs the password.
    (data / "pg_hba.conf").write_text(
        "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
    )


def server(data: Path, socket_dir: Path) -> list[str]:
    socket_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(socket_dir, USER, USER)
    return [
        *_as_postgres(), str(bin_dir() / "postgres"), "-D", str(data), "-k", str(socket_dir),
        "-c", f"listen_addresses={HOST}", "-p", str(PORTS.postgres), "-c", "fsync=off",
        "-c", "max_connections=200",
    ]


def create_database(socket_dir: Path, password_file: Path) -> None:
    """The `flyte` role and database (idempotent)."""
    password = password_file.read_text().strip()
    sql = (
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ROLE}') THEN "
        f"CREATE ROLE {ROLE} LOGIN PASSWORD '{password}'; END IF; END $$;"
    )
    psql = [*_as_postgres(), str(bin_dir() / "psql"), "-h", str(socket_dir), "-p", str(PORTS.postgres), "-U", "postgres",
            "-v", "ON_ERROR_STOP=1", "-q"]
    subprocess.run([*psql, "-c", sql], check=True, capture_output=True)
    exists = subprocess.run([*psql, "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"],
                            check=True, capture_output=True, text=True).stdout.strip()
    if exists != "1":
        subprocess.run([*psql, "-c", f"CREATE DATABASE {DATABASE} OWNER {ROLE}"], check=True, capture_output=True)


def ready(socket_dir: Path) -> bool:
    return subprocess.run(
        [str(bin_dir() / "pg_isready"), "-h", str(socket_dir), "-p", str(PORTS.postgres), "-q"]
    ).returncode == 0
