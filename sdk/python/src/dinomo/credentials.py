"""How the SDK finds its TLS identity, the same way as the CLI and the Rust SDK
(security/src/transport.rs ``Security::for_sdk``/``for_client``, credentials.rs).

Order:

1. ``insecure=True``, or (when ``insecure`` is not given) ``$DINOMO_INSECURE`` set to
   ``1``/``true``/``yes``: plain text.
2. ``credentials=DIR``: the ``client`` identity in DIR, which must be there
   (:class:`~dinomo.errors.CredentialsError` otherwise).
3. ``$DINOMO_CREDENTIALS``, else ``.dinomo/credentials`` (relative to the working directory,
   where ``dinomo up`` keeps them): the ``client`` identity if the folder has it, else plain
   text (which a secured cluster refuses).

A folder holds ``ca.pem``, ``<name>.pem`` and ``<name>-key.pem`` (made by ``dinomo up`` or
``dinomo credentials init``), or a Kubernetes TLS Secret's ``tls.crt``, ``tls.key`` and
``ca.crt``. Servers present certificates for fixed DNS names (``kv.dinomo``,
``routing.dinomo``), which :data:`SERVICE_NAMES` lists and the channels check.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

from .errors import CredentialsError

CREDENTIALS_ENV = "DINOMO_CREDENTIALS"
INSECURE_ENV = "DINOMO_INSECURE"
DEFAULT_CLIENT_CREDENTIALS = ".dinomo/credentials"
#: The DNS name in each service's certificate (security/src/transport.rs ``Service::domain``).
SERVICE_NAMES = {"kv": "kv.dinomo", "routing": "routing.dinomo", "monitor": "monitor.dinomo"}

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Identity:
    """One loaded identity: the cluster CA to trust, the certificate and key to present."""

    dir: Path
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:  # never prints the key
        return f"Identity(dir={str(self.dir)!r})"

    @staticmethod
    def load(dir: PathLike, name: str = "client") -> "Identity":
        """Loads identity ``name`` from ``dir`` (our layout, else a Kubernetes TLS Secret's)."""
        d = Path(dir)
        ours = (d / f"{name}.pem", d / f"{name}-key.pem", d / "ca.pem")
        secret = (d / "tls.crt", d / "tls.key", d / "ca.crt")
        if ours[0].exists():
            files = ours
        elif secret[0].exists():
            files = secret
        else:
            raise CredentialsError(
                f"no credentials for {name!r} in {d}: expected {name}.pem, {name}-key.pem and "
                "ca.pem (made by `dinomo up` or `dinomo credentials init`), or a Kubernetes TLS "
                "Secret's tls.crt, tls.key and ca.crt"
            )
        try:
            cert, key, ca = (p.read_bytes() for p in files)
        except OSError as e:
            raise CredentialsError(f"reading credentials in {d}: {e}") from None
        if b"CERTIFICATE" not in cert or b"PRIVATE KEY" not in key or b"CERTIFICATE" not in ca:
            raise CredentialsError(f"{d}: the files of {name!r} are not PEM certificates and keys")
        return Identity(d, ca, cert, key)


def _env_true(value: Optional[str]) -> bool:
    return value in ("1", "true", "yes")


def discover(
    credentials: Optional[PathLike] = None,
    insecure: Optional[bool] = None,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[PathLike] = None,
) -> Optional[Identity]:
    """The identity to use, or None for plain text, by the order in the module doc.

    ``env`` and ``cwd`` default to the process's (tests pass their own).
    """
    environ = os.environ if env is None else env
    if insecure is True or (insecure is None and _env_true(environ.get(INSECURE_ENV))):
        return None
    if credentials is not None:
        return Identity.load(credentials)
    named = environ.get(CREDENTIALS_ENV)
    folder = Path(named) if named else Path(DEFAULT_CLIENT_CREDENTIALS)
    if cwd is not None and not folder.is_absolute():
        folder = Path(cwd) / folder
    try:
        return Identity.load(folder)
    except CredentialsError:
        # As the Rust SDK: no identity found means plain text (a secured cluster refuses it,
        # and the error then says so).
        return None
