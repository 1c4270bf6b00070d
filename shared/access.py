"""How a process proves who it is to NATS: credentials and TLS, turned into nats-py's options.

Credentials are an nkey seed file (what `belayer up` and `belayer creds` write: the server holds
only public keys) or a `.creds` file with a user JWT (an operator-run cluster). A connection made
with an nkey uses an inbox prefix of its own, `_INBOX.<public key>.`, which the bus lets only that
key subscribe to: no client can read another's replies.

An HTTP client proves who it is to the gateway with a bearer API key. `belayer creds` (and `belayer
up`) write each key once, to `api-key-<name>` (mode 0600, for whoever calls), and its SHA-256 to
`api-keys.json`, which is all the gateway reads: a leaked gateway file gives no key away.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import nkeys

from belayer_rl.shared import files

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


# ---------------------------------------------------------------- the gateway's API keys

API_KEYS_FILE = "api-keys.json"
KEY_NAME = re.compile(r"^[a-z0-9_-]{1,32}\Z")  # one subject token: the router records it as the owner
KeyName = Annotated[str, msgspec.Meta(pattern=KEY_NAME.pattern)]
KeyDigest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")]


class ApiKeyFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`api-keys.json`: each key's name and the SHA-256 (hex) of the key itself."""

    keys: dict[KeyName, KeyDigest]


def api_key_path(folder: Path, name: str) -> Path:
    return folder / f"api-key-{name}"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_api_keys(folder: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """A key for each name the folder has none for yet (an existing key is kept: its holders keep
    their access); returns every new key's file."""
    bad = [name for name in names if not KEY_NAME.match(name)]
    if bad:
        raise AccessError(f"API key names are lowercase letters, digits, - and _ (at most 32): {bad}")
    path = folder / API_KEYS_FILE
    known = load_api_keys(path) if path.exists() else {}
    written = {}
    for name in names:
        if name in known.values() and api_key_path(folder, name).exists():
            continue
        key = "bk-" + secrets.token_urlsafe(32)
        written[name] = files.write_whole(api_key_path(folder, name), (key + "\n").encode(), mode=0o600)
        known = {d: n for d, n in known.items() if n != name} | {digest(key): name}
    table = ApiKeyFile(keys={name: d for d, name in known.items()})
    files.write_whole(path, msgspec.json.format(msgspec.json.encode(table)) + b"\n", mode=0o600)
    return written


def load_api_keys(path: Path) -> dict[str, str]:
    """The key file as digest -> key name; AccessError naming the file if it cannot be used."""
    try:
        table = msgspec.json.decode(path.read_bytes(), type=ApiKeyFile)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise AccessError(f"{path}: {exc}") from None
    return {d: name for name, d in table.keys.items()}


def key_owner(keys: dict[str, str], bearer: str) -> str | None:
    """The name of the key `bearer` is, or None. Looked up by digest: how long a lookup takes says
    nothing about any key."""
    return keys.get(digest(bearer))
