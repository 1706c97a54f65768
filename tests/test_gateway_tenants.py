"""Tenants without a server: the keys file (hashed keys, its refusals, `qvl-trt keys`), its
reload on a rewrite and on a Kubernetes-style symlink swap, the quotas' buckets on a hand-set
clock, the fair sharing of the gateway's slots (deterministic: no timing), and the cache scope
as it reaches the vision cache's keys and the KV blocks the executor would reuse. The served
checks (429s, caches, rotation under a running gateway) are in test_gateway_app.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.gateway.fair_queue import FairSlots, Full
from qvl_trt.gateway.quotas import QuotaExceeded, TenantQuota
from qvl_trt.gateway.tenants import (
    MAX_TENANTS,
    KeyFile,
    KeyRing,
    Quotas,
    add_key,
    key_digest,
    read_keys,
    remove_key,
)
from qvl_trt.mm.prompt_table import prompt_table_extra_ids, scope_ids
from qvl_trt.triton.runtime.block_reuse import BlockReuse

# ---- the keys file ------------------------------------------------------------------------


def test_keys_are_stored_hashed_and_name_their_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key_a, entry = add_key(path, "team-a", Quotas(requests_per_minute=60, max_streams=2))
    key_b, _ = add_key(path, "team-b", cache_scope="")
    text = path.read_text()
    assert key_a not in text and key_b not in text and key_digest(key_a) in text
    ring = read_keys(path)
    assert ring.tenant_of(key_a).name == "team-a" and ring.tenant_of(key_b).name == "team-b"
    assert ring.tenant_of(key_a).quotas == Quotas(60, None, 2)
    assert ring.tenant_of(key_a).cache_scope == "team-a"  # its own, by default
    assert ring.tenant_of(key_b).cache_scope == ""  # the shared one, by configuration
    assert ring.tenant_of("qvl-nope") is None and ring.tenant_of("") is None
    # A second key of a tenant keeps its settings; removing the first leaves the second.
    key_a2, _ = add_key(path, "team-a")
    assert read_keys(path).tenant_of(key_a2).quotas == Quotas(60, None, 2)
    remove_key(path, entry.id[:6])
    ring = read_keys(path)
    assert ring.tenant_of(key_a) is None and ring.tenant_of(key_a2).name == "team-a"


@pytest.mark.parametrize("data, words", [
    ({"version": 2}, "not a version 1 keys file"),
    ({"version": 1, "tenant": {}}, "unknown field 'tenant'"),
    ({"version": 1, "tenants": {"a b": {}}}, "tenant's name is 1 to 64"),
    ({"version": 1, "tenants": {"a": {"requests_per_minute": 0}}},
     "requests_per_minute = 0 must be a whole number >= 1"),
    ({"version": 1, "tenants": {"a": {"rpm": 5}}}, "rpm is not a tenant setting"),
    ({"version": 1, "tenants": {}, "keys": [{"id": "x", "tenant": "a", "sha256": "0" * 64}]},
     "names tenant 'a', which tenants does not have"),
    ({"version": 1, "tenants": {"a": {}}, "keys": [{"id": "x", "tenant": "a",
                                                    "sha256": "secret"}]},
     "is not 64 lowercase hex digits"),
    ({"version": 1, "tenants": {f"t{i}": {} for i in range(MAX_TENANTS + 1)}},
     f"above the {MAX_TENANTS} a gateway serves"),
])
def test_a_bad_keys_file_is_refused_in_one_line_naming_the_field(data, words) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        KeyRing.from_json(data, "keys.json")
    assert "\n" not in str(caught.value)


def test_the_keys_command_prints_the_new_key_once_and_refuses_in_one_line(
        tmp_path: Path) -> None:
    """Two runs of the real entry point (each a child interpreter: the listing and removal
    are the library's, tested above)."""
    from cli_harness import run_cli

    path = tmp_path / "keys.json"
    added = run_cli("keys", "add", "--keys-file", str(path), "--tenant", "team-a",
                    "--tokens-per-minute", "1000")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip().splitlines()[-1]
    assert read_keys(path).tenant_of(key).quotas.tokens_per_minute == 1000
    wrong = run_cli("keys", "remove", "--keys-file", str(path), "--id", "zzz")
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1
    assert "no keys of" in wrong.stderr and "keys list" in wrong.stderr


def test_a_rewritten_or_symlink_swapped_keys_file_is_taken_and_a_broken_one_is_not(
        tmp_path: Path) -> None:
    """As a Kubernetes Secret volume updates: the file is a symlink through `..data`, which
    is swapped to a new folder; the gateway's path then names a new inode."""
    def secret_version(name: str, ring: KeyRing) -> None:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "keys.json").write_text(json.dumps(ring.to_json()))
        os.symlink(name, tmp_path / "..data_new")
        os.replace(tmp_path / "..data_new", tmp_path / "..data")  # the atomic swap

    first, second = KeyRing.single("key-one"), KeyRing.single("key-two")
    secret_version("v1", first)
    (tmp_path / "keys.json").symlink_to("..data/keys.json")
    watched = KeyFile(tmp_path / "keys.json")
    assert watched.ring.tenant_of("key-one") and watched.poll() is None
    assert watched.generation == 1
    secret_version("v2", second)
    assert watched.poll() is None and watched.generation == 2
    assert watched.ring.tenant_of("key-one") is None and watched.ring.tenant_of("key-two")
    (tmp_path / "v2" / "keys.json").write_text("{not json")  # rewritten in place, broken
    problem = watched.poll()
    assert "is not JSON" in problem and watched.generation == 2
    assert watched.ring.tenant_of("key-two"), "the last good keys stay"
    assert watched.poll() is None  # the same broken file is not read again


# ---- quotas -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_refuse_past_the_limit_and_refill() -> None:
    clock = Clock()
    quota = TenantQuota(Quotas(requests_per_minute=2), clock)
    quota.admit()
    quota.admit()
    with pytest.raises(QuotaExceeded) as caught:
        quota.admit()
    assert caught.value.limit == "requests_per_minute" and caught.value.value == 2
    assert caught.value.retry_after_s == pytest.approx(30)  # one request per 30 s
    clock.now = 30
    quota.admit()


def test_tokens_are_charged_when_known_and_a_debt_refuses_until_refilled() -> None:
    clock = Clock()
    quota = TenantQuota(Quotas(tokens_per_minute=600), clock)
    quota.admit()
    quota.release(900)  # one answer may overdraw: its tokens are known at its end
    with pytest.raises(QuotaExceeded) as caught:
        quota.admit()
    assert caught.value.limit == "tokens_per_minute"
    assert caught.value.retry_after_s == pytest.approx(30.1)  # 300 tokens at 10/s, and one
    clock.now = caught.value.retry_after_s
    quota.admit()


def test_max_streams_counts_requests_in_flight() -> None:
    quota = TenantQuota(Quotas(max_streams=1), Clock())
    quota.admit()
    with pytest.raises(QuotaExceeded, match="max_streams of 1"):
        quota.admit()
    quota.release(0)
    quota.admit()


# ---- fair slots ---------------------------------------------------------------------------


def test_a_flooding_tenant_holding_its_slots_lets_the_other_tenants_request_in_next() -> None:
    async def main() -> list[str]:
        slots, admitted = FairSlots(), []

        async def request(tenant: str) -> None:
            await slots.enter(tenant, 2, 10)
            admitted.append(tenant)

        for _ in range(2):  # the flood holds both slots...
            await request("flood")
        queued = [asyncio.create_task(request("flood")) for _ in range(4)]  # ...and waits
        await asyncio.sleep(0)
        other = asyncio.create_task(request("other"))
        await asyncio.sleep(0)
        assert admitted == ["flood", "flood"] and slots.waiting == 5
        slots.leave("flood", 2)  # a slot frees: the other tenant's, though it came last
        await asyncio.sleep(0)
        assert admitted[-1] == "other" and other.done()
        slots.leave("flood", 2)
        await asyncio.sleep(0)
        assert admitted[-1] == "flood"  # then the flood's, in their order
        with pytest.raises(Full):
            await asyncio.gather(*(slots.enter("flood", 2, 10) for _ in range(8)))
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        return admitted

    assert asyncio.run(main())[:4] == ["flood", "flood", "other", "flood"]


@pytest.mark.parametrize("tenants, opts, limits", [
    (2, {}, (6, 10)),  # tenants to be fair between: the batch slots, the queue waits here
    (2, {"max_queue": 3}, (6, 3)),
    (1, {}, (16, 0)),  # one tenant: what the builds admit goes on, none waits here
    (0, {}, (16, 0)),  # no keys file, no key
    (2, {"max_concurrency": 5}, (5, 0)),
    (2, {"max_concurrency": 5, "max_queue": 2}, (5, 2)),
])
def test_the_gateways_slots_default_to_fair_turns_where_there_are_tenants(
        tmp_path: Path, tenants: int, opts: dict, limits: tuple[int, int]) -> None:
    """Two builds of 4 + 2 batch slots and 6 + 4 queue places. With a keys file of several
    tenants the gateway keeps the queue itself (the builds' queues are FIFO: a flood ahead
    of another tenant's request there would go first); else it sends on what they admit."""
    from qvl_trt.gateway.app import Gateway
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.gateway.upstream import Build, ServedModel
    from qvl_trt.triton.contract import ModelNames

    keys = None
    for n in range(tenants):
        keys = tmp_path / "keys.json"
        add_key(keys, f"tenant{n}")
    gateway = Gateway(GatewayOptions("127.0.0.1:1", keys_file=keys, **opts))
    if "max_concurrency" not in opts:
        assert gateway.slot_limits is None  # builds not known yet: no limit
    gateway.served = {"m": ServedModel("m", tuple(
        Build(n, ModelNames.for_build(n), None, capacity, slots)
        for n, capacity, slots in (("a", 10, 4), ("b", 6, 2))))}
    assert gateway.slot_limits == limits


def test_a_waiter_that_goes_away_leaves_its_place() -> None:
    async def main() -> None:
        slots = FairSlots()
        await slots.enter("a", 1, 1)
        gone = asyncio.create_task(slots.enter("b", 1, 1))
        await asyncio.sleep(0)
        gone.cancel()
        slots.leave("a", 1)  # hands the slot on while the cancel is delivered
        await asyncio.gather(gone, return_exceptions=True)
        assert slots.waiting == 0 and slots.in_slots == 0
        await slots.enter("c", 1, 1)
        assert slots.in_slots == 1

    asyncio.run(main())


# ---- cache scopes -------------------------------------------------------------------------


def test_a_scope_changes_every_id_and_the_shared_scope_none() -> None:
    ids = np.array([0, 0, 7, 7, 0], np.uint64)
    assert scope_ids(ids, "").tolist() == ids.tolist()
    a, b = scope_ids(ids, "team-a"), scope_ids(ids, "team-b")
    assert a[0] == a[1] == a[4] and a[2] == a[3] and 0 not in a.tolist()
    assert not set(a.tolist()) & set(b.tolist()) and not set(a.tolist()) & {0, 7}
    assert scope_ids(ids, "team-a").tolist() == a.tolist()  # stable: a cache key
    extra = prompt_table_extra_ids(np.array([1, 9, 9, 2]), image_token_id=9, image_hashes=[7],
                                   image_token_counts=[2], scope="team-a")
    assert extra.tolist() == scope_ids(np.array([0, 7, 7, 0]), "team-a").tolist()


def test_kv_blocks_are_reused_within_a_scope_only_from_the_first_block() -> None:
    """The executor's matching (block_reuse.py): a prompt's whole blocks but its last token,
    each keyed by its (token, extra id) pairs under the block before it."""
    prompt = list(range(1, 42))  # 41 tokens: 2 whole blocks of 16 before the last token
    text = np.zeros(len(prompt), np.uint64)
    reuse = BlockReuse(16, capacity=100)
    assert reuse.add(prompt, None) == 0
    assert reuse.add(prompt, text) == 2  # no extra ids = extra ids 0
    assert reuse.add(prompt[:20], None) == 1
    assert reuse.add(prompt, scope_ids(text, "team-a")) == 0  # another scope: nothing
    assert reuse.add(prompt, scope_ids(text, "team-a")) == 2
    changed = text.copy()
    changed[20] = 5  # a differing extra id in block 1: block 0 still matches, block 1 not
    assert reuse.add(prompt, changed) == 1
    assert reuse.reused == 6
    small = BlockReuse(16, capacity=2)
    small.add(prompt, None)
    small.add([99] * 41, None)  # evicts the first prompt's blocks
    assert small.add(prompt, None) == 0
