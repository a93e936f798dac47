"""Credentials discovery (dinomo.credentials) follows the CLI's order: explicit insecure, then
$DINOMO_INSECURE, an explicit folder, $DINOMO_CREDENTIALS, .dinomo/credentials, else plain text."""
from __future__ import annotations

from pathlib import Path

import pytest

from dinomo import CredentialsError
from dinomo.credentials import Identity, discover

PEM_CERT = b"-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n"
PEM_KEY = b"-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n"


def folder(path: Path, layout: str = "ours") -> Path:
    path.mkdir(parents=True)
    if layout == "ours":
        files = {"client.pem": PEM_CERT, "client-key.pem": PEM_KEY, "ca.pem": PEM_CERT}
    else:
        files = {"tls.crt": PEM_CERT, "tls.key": PEM_KEY, "ca.crt": PEM_CERT}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_the_default_folder_is_dot_dinomo_credentials(tmp_path: Path) -> None:
    d = folder(tmp_path / ".dinomo" / "credentials")
    found = discover(env={}, cwd=tmp_path)
    assert found is not None and found.dir == d and found.key_pem == PEM_KEY


def test_nothing_found_is_plain_text(tmp_path: Path) -> None:
    assert discover(env={}, cwd=tmp_path) is None


def test_the_environment_variable_wins_over_the_default(tmp_path: Path) -> None:
    folder(tmp_path / ".dinomo" / "credentials")
    other = folder(tmp_path / "other")
    found = discover(env={"DINOMO_CREDENTIALS": str(other)}, cwd=tmp_path)
    assert found is not None and found.dir == other


def test_an_explicit_folder_wins_and_must_hold_the_identity(tmp_path: Path) -> None:
    env_dir = folder(tmp_path / "env")
    mine = folder(tmp_path / "mine", layout="secret")
    found = discover(credentials=mine, env={"DINOMO_CREDENTIALS": str(env_dir)}, cwd=tmp_path)
    assert found is not None and found.dir == mine
    with pytest.raises(CredentialsError, match="client.pem"):
        discover(credentials=tmp_path / "empty", env={})


@pytest.mark.parametrize("value,plain", [("1", True), ("true", True), ("yes", True), ("0", False), ("", False)])
def test_dinomo_insecure(tmp_path: Path, value: str, plain: bool) -> None:
    folder(tmp_path / ".dinomo" / "credentials")
    found = discover(env={"DINOMO_INSECURE": value}, cwd=tmp_path)
    assert (found is None) == plain


def test_explicit_insecure_overrides_everything_and_explicit_secure_ignores_the_variable(tmp_path: Path) -> None:
    d = folder(tmp_path / ".dinomo" / "credentials")
    assert discover(insecure=True, credentials=d, env={}) is None
    found = discover(insecure=False, env={"DINOMO_INSECURE": "1"}, cwd=tmp_path)
    assert found is not None and found.dir == d


def test_the_key_never_shows_in_repr(tmp_path: Path) -> None:
    i = Identity.load(folder(tmp_path / "c"))
    assert "PRIVATE" not in repr(i)
