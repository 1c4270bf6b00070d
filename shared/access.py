"""How a process proves who it is to NATS: credentials and TLS, turned into nats-py's options.

Credentials are an nkey seed file (what `belayer up` and `belayer creds` write: the server holds
only public keys) or a `.creds` file with a user JWT (an operator-run cluster). A connection made
with an nkey uses an inbox prefix of its own, `_INBOX.<public key>.`, which the bus lets only that
key subscribe to: no client can read another's replies.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

JWT_MARKER = "-----BEGIN NATS USER JWT-----"
INBOX = "_INBOX"


class AccessError(ValueError):
    """Credentials or TLS files that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Access:
    creds: Path | None = None
    ca: Path | None = None  # the CA the server's certificate chains to
    cert: Path | None = None  # client certificate and its key, for servers that verify clients
    key: Path | None = None

    @property
    def client(self) -> str:
        """Who this is as a client of the router: its credential's user, as `belayer creds` names
        the file (cli, cli-<name>, trainer, admin). The bus lets it call the router under that name
        only, and the router lets a client follow or cancel its own requests only. "cli" on an open
        bus, where nobody is told apart."""
        return self.creds.stem if self.creds is not None else "cli"

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's `connect`."""
        options: dict[str, Any] = {}
        if self.creds is not None:
            text = read(self.creds)
            if JWT_MARKER in text:
                options["user_credentials"] = str(self.creds)
            else:
                seed = text.strip()
                options["nkeys_seed_str"] = seed
                options["inbox_prefix"] = inbox_prefix(public_key(seed, self.creds))
        if self.ca is not None or self.cert is not None:
            options["tls"] = self.tls_context()
        return options

    def tls_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        try:
            if self.ca is not None:
                context.load_verify_locations(cafile=str(self.ca))
            if self.cert is not None:
                context.load_cert_chain(str(self.cert), str(self.key) if self.key else None)
        except (OSError, ssl.SSLError) as exc:
            raise AccessError(f"TLS files unusable: {exc}") from exc
        return context


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise AccessError(f"cannot read NATS credentials {path}: {exc.strerror}") from exc


def public_key(seed: str, source: Path | str = "seed") -> str:
    """The user public key (U...) of an nkey seed (SU...)."""
    try:
        key: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
        return key.decode()
    except (nkeys.NkeysError, ValueError, TypeError) as exc:
        raise AccessError(f"{source} is neither an nkey seed nor a .creds file ({exc!r})") from exc


def inbox_prefix(public: str) -> str:
    return f"{INBOX}.{public}"
