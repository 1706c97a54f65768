"""Tenants: the gateway's API keys, each naming a tenant with its quotas and cache scope.

The keys file (JSON, written by `qvl-trt keys add|list|remove`; deploy's Secret holds it):

    {"version": 1,
     "tenants": {"team-a": {"requests_per_minute": 600, "tokens_per_minute": 200000,
                            "max_streams": 8, "cache_scope": "team-a"}},
     "keys": [{"id": "3f9c2a1b0d4e", "tenant": "team-a", "sha256": "<64 hex digits>",
               "created": "2026-12-07T16:00:00Z"}]}

A key is stored as the sha256 of its text only; a tenant may have several (rotation: add the
new one, move the clients, remove the old). Every quota is optional (absent: no limit).
`cache_scope` names whose caches the tenant's requests use (contract.CACHE_SCOPE): absent, the
tenant's own name; tenants that give the same scope share their caches; "" is the scope of
requests that carry none. The gateway checks the file every KEYS_POLL_S and loads it again
when its inode, size or mtime changed (a Kubernetes Secret's update swaps a symlink: the
path then names a new inode); a file it cannot read keeps the keys it had.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import write_json_atomic
from ..errors import ConfigError

FORMAT_VERSION = 1
# Tenants are a metric label (gateway/metrics.py): their number is bounded by the file.
MAX_TENANTS = 64
KEYS_POLL_S = 1.0
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The tenant of QVL_TRT_API_KEY's one key, and of every request where no key is asked.
DEFAULT_TENANT = "default"
ANONYMOUS = "-"
QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_streams")
KEY_BYTES = 32  # a generated key's randomness


@dataclass(frozen=True)
class Quotas:
    """A tenant's limits; None: none."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens
    max_streams: int | None = None  # requests in flight (answered or waiting for a slot)


@dataclass(frozen=True)
class Tenant:
    name: str
    quotas: Quotas = Quotas()
    cache_scope: str = ""


ANONYMOUS_TENANT = Tenant(ANONYMOUS)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return f"qvl-{secrets.token_urlsafe(KEY_BYTES)}"


@dataclass(frozen=True)
class KeyEntry:
    id: str  # the digest's first 12 hex digits: how `qvl-trt keys remove` names it
    tenant: str
    sha256: str
    created: str = ""


@dataclass(frozen=True)
class KeyRing:
    """The tenants and their keys' digests."""

    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    keys: tuple[KeyEntry, ...] = ()

    def tenant_of(self, key: str) -> Tenant | None:
        """The tenant whose key this is. Every entry is compared, each in constant time
        (hmac.compare_digest), so the time taken says nothing about which key matched."""
        digest = key_digest(key).encode()
        found = None
        for entry in self.keys:
            if hmac.compare_digest(entry.sha256.encode(), digest):
                found = entry.tenant
        return None if found is None else self.tenants[found]

    @classmethod
    def single(cls, key: str) -> KeyRing:
        """QVL_TRT_API_KEY's one key: the default tenant, no quotas, the shared cache scope
        (one tenant has nobody to keep its caches from)."""
        digest = key_digest(key)
        return cls({DEFAULT_TENANT: Tenant(DEFAULT_TENANT)},
                   (KeyEntry(digest[:12], DEFAULT_TENANT, digest),))

    @classmethod
    def from_json(cls, data: Any, where: str) -> KeyRing:
        """From the keys file's JSON; a ConfigError names the faulty field and the fix."""
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ConfigError(f"{where} is not a version {FORMAT_VERSION} keys file; write it "
                              "with `qvl-trt keys add`")
        unknown = sorted(set(data) - {"version", "tenants", "keys"})
        if unknown:
            raise ConfigError(f"{where}: unknown field {unknown[0]!r}; a keys file holds "
                              "version, tenants and keys")
        tenants_data = data.get("tenants", {})
        if not isinstance(tenants_data, dict):
            raise ConfigError(f"{where}: tenants must be an object of tenant name -> settings")
        if len(tenants_data) > MAX_TENANTS:
            raise ConfigError(f"{where} has {len(tenants_data)} tenants, above the "
                              f"{MAX_TENANTS} a gateway serves (each is a metric label); "
                              "merge tenants")
        tenants = {name: _tenant(name, value, f"{where}: tenants.{name}")
                   for name, value in tenants_data.items()}
        keys, seen = [], set()
        for i, item in enumerate(data.get("keys", [])):
            at = f"{where}: keys[{i}]"
            try:
                entry = KeyEntry(**item)
            except TypeError:
                raise ConfigError(f"{at} must hold id, tenant, sha256 and created only") \
                    from None
            if entry.tenant not in tenants:
                raise ConfigError(f"{at} names tenant {entry.tenant!r}, which tenants does not "
                                  "have; add it with `qvl-trt keys add --tenant NAME`")
            if not re.fullmatch(r"[0-9a-f]{64}", str(entry.sha256)):
                raise ConfigError(f"{at}.sha256 is not 64 lowercase hex digits (the sha256 of "
                                  "the key); write it with `qvl-trt keys add`")
            if entry.sha256 in seen:
                raise ConfigError(f"{at} repeats a key another entry has; remove one")
            seen.add(entry.sha256)
            keys.append(entry)
        return cls(tenants, tuple(keys))

    def to_json(self) -> dict[str, Any]:
        def settings(t: Tenant) -> dict[str, Any]:
            quotas = {k: v for k, v in asdict(t.quotas).items() if v is not None}
            return {**quotas, **({} if t.cache_scope == t.name else
                                 {"cache_scope": t.cache_scope})}

        return {"version": FORMAT_VERSION,
                "tenants": {n: settings(t) for n, t in sorted(self.tenants.items())},
                "keys": [asdict(k) for k in self.keys]}


def _tenant(name: str, value: Any, where: str) -> Tenant:
    if not NAME.fullmatch(name):
        raise ConfigError(f"{where}: a tenant's name is 1 to 64 letters, digits, '.', '_' or "
                          "'-', starting with a letter or digit")
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be an object of quotas and cache_scope")
    unknown = sorted(set(value) - {*QUOTA_FIELDS, "cache_scope"})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]} is not a tenant setting; use "
                          f"{', '.join(QUOTA_FIELDS)} or cache_scope")
    for quota in QUOTA_FIELDS:
        v = value.get(quota)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{where}.{quota} = {json.dumps(v)} must be a whole number >= 1 "
                              "(leave it out for no limit)")
    scope = value.get("cache_scope", name)
    if not isinstance(scope, str) or len(scope.encode()) > 256:
        raise ConfigError(f"{where}.cache_scope must be a string of at most 256 bytes")
    return Tenant(name, Quotas(**{q: value.get(q) for q in QUOTA_FIELDS}), scope)


def read_keys(path: Path) -> KeyRing:
    """The keys file at `path` (a missing one: no tenants, no keys)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return KeyRing()
    except OSError as exc:
        raise ConfigError(f"cannot read the keys file {path} ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the keys file {path} is not JSON ({exc}); write it with "
                          "`qvl-trt keys add`") from None
    return KeyRing.from_json(data, str(path))


def write_keys(path: Path, ring: KeyRing) -> None:
    write_json_atomic(path, ring.to_json())


def add_key(path: Path, tenant: str, quotas: Quotas | None = None,
            cache_scope: str | None = None) -> tuple[str, KeyEntry]:
    """A new key for `tenant` (created, or its settings replaced where given) written to the
    keys file: (the key, which is shown once and stored nowhere, its entry)."""
    ring = read_keys(path)
    old = ring.tenants.get(tenant)
    settings: dict[str, Any] = {} if old is None else {
        **{k: v for k, v in asdict(old.quotas).items() if v is not None},
        "cache_scope": old.cache_scope}
    if quotas is not None:
        settings.update({k: v for k, v in asdict(quotas).items() if v is not None})
    if cache_scope is not None:
        settings["cache_scope"] = cache_scope
    tenants = {**ring.tenants, tenant: _tenant(tenant, settings, f"tenant {tenant}")}
    key = new_key()
    digest = key_digest(key)
    entry = KeyEntry(digest[:12], tenant, digest,
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    new = KeyRing(tenants, (*ring.keys, entry))
    KeyRing.from_json(new.to_json(), str(path))  # the limits a gateway checks (MAX_TENANTS)
    write_keys(path, new)
    return key, entry


def remove_key(path: Path, key_id: str) -> KeyEntry:
    """Remove the key whose id (or the start of it) is `key_id`; a tenant left without keys
    goes too."""
    ring = read_keys(path)
    matches = [k for k in ring.keys if k.id.startswith(key_id)] if key_id else []
    if len(matches) != 1:
        raise ConfigError(f"{len(matches) or 'no'} keys of {path} have an id starting with "
                          f"{key_id!r}; `qvl-trt keys list` shows their ids")
    keys = tuple(k for k in ring.keys if k is not matches[0])
    tenants = {n: t for n, t in ring.tenants.items() if any(k.tenant == n for k in keys)}
    write_keys(path, KeyRing(tenants, keys))
    return matches[0]


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when the file is rewritten or its symlink swapped (stat follows links)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class KeyFile:
    """The keys file of a running gateway: loaded at start (a bad one is a ConfigError) and
    again by `poll` when it changed; `generation` counts the loads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = _stamp(path)
        if self._stamp is None:
            raise ConfigError(f"the keys file {path} does not exist; write it with "
                              "`qvl-trt keys add --keys-file PATH --tenant NAME`")
        self.ring = read_keys(path)
        self.generation = 1

    def poll(self) -> str | None:
        """Load the file again if it changed: None, or why the new one was not taken (the
        keys stay those of the last good file; the same broken file is not read twice)."""
        stamp = _stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            self.ring = read_keys(self.path)
        except ConfigError as exc:
            return str(exc)
        self.generation += 1
        return None
