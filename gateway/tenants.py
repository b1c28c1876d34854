"""Tenants: API keys (kept only as SHA-256 digests), model aliases, durability and quotas.

The tenants file is TOML:

    [tenants.acme]
    keys = ["sk-acme-1"]                 # plaintext keys are hashed at load and then forgotten
    key_sha256 = ["9f86d081..."]         # or their digests (`slotkeeper` never needs the key itself)
    durability = "after-turn"            # or "on-evict"
    default_max_tokens = 4096            # output cap of a request without max_tokens (0: none;
                                         # default: the gateway's --default-max-tokens, 8192)
    handoff_threshold = 2048             # uncached prompt tokens from which a turn is prefilled on
                                         # a prefill engine and decoded on a decode engine (0:
                                         # always; "off": never; default: --handoff-threshold)
    hosted_tools = "omit"                # Responses tools OpenAI runs itself (web_search,
                                         # file_search, mcp, ...), which no engine here runs:
                                         # "omit" leaves them out of the prompt and says so (the
                                         # answer's slotkeeper.omitted_tools and its
                                         # X-Slotkeeper-Omitted-Tools header, a log line, the
                                         # metric ..._hosted_tools_omitted_total); "refuse"
                                         # answers a 400 naming the tool
    models = { "gpt-4o" = "qwen35", "claude-*" = "qwen35" }
                                         # alias → served model id (ids are also accepted as is);
                                         # an alias with * or ? matches names like a shell pattern

    [tenants.acme.quotas]
    sessions = 1000
    stored_bytes = 50_000_000_000
    live_slots = 8
    requests_per_minute = 600
    inflight = 16                        # requests running at once (default: --max-inflight)

    [tenants.acme.storage]
    share_chunks = true                  # sessions share what they have in common: stored chunks
                                         # (forks, a system prompt) and prefix states (a new session
                                         # starts from another's system prompt and tools); false
                                         # keeps each session's state its own
    idle_ttl_s = 2592000                 # a session unused this long is deleted (default: never)
    on_store_outage = "wait"             # a session only the store holds, while the store is down:
                                         # "wait" answers 503 + Retry-After (its state comes back
                                         # with the store); "reprefill" serves the turn at once
                                         # from the whole prompt (the same answer, at full cost)

    [[tenants.acme.volatile]]            # a volatile block (engine_pool/protocol/volatile.py):
    name = "request-stamp"               # lines matching `pattern` are dropped or moved to the end
    pattern = "^Request: [0-9a-f]{8}$"   # of the prompt before rendering; the built-in rules
    action = "drop"                      # (Claude Code's billing header) come first, unless
    scope = "system"                     # `volatile_builtins = false`; "all": every message

Without a file there is one tenant, `default`, with no key and no quotas (local use); when one model
is served, any model name reaches it (agents send their own names: `claude-…`, `gpt-…`), as with
llama-server.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from engine_pool.protocol.volatile import BUILTIN_RULES, RuleError, VolatileRule, make_rule
from storage.ids import validate_id

MAX_VOLATILE_RULES = 32


class Durability(StrEnum):
    AFTER_TURN = "after-turn"
    ON_EVICT = "on-evict"


class HostedTools(StrEnum):
    """What becomes of a Responses request's hosted tools (openai_responses.tools.HOSTED)."""

    OMIT = "omit"  # left out of the prompt, and said so
    REFUSE = "refuse"  # a 400 naming the tool


class StoreOutage(StrEnum):
    """What a turn does whose session's state only the store holds while the store is down."""

    WAIT = "wait"  # 503 + Retry-After
    REPREFILL = "reprefill"  # served from the whole prompt


@dataclass(frozen=True)
class Quotas:
    sessions: int | None = None
    stored_bytes: int | None = None
    live_slots: int | None = None
    requests_per_minute: int | None = None
    inflight: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digests: frozenset[str] = frozenset()
    durability: Durability = Durability.AFTER_TURN
    models: dict[str, str] = field(default_factory=dict)
    quotas: Quotas = Quotas()
    share_chunks: bool = True  # stored chunks shared between the tenant's sessions (never tenants)
    idle_ttl_s: float | None = None  # sessions unused this long are deleted
    any_name: bool = False  # any model name means the one served model (no tenants file)
    volatile: tuple[VolatileRule, ...] = BUILTIN_RULES  # applied to every request, in order
    default_max_tokens: int | None = None  # output cap without max_tokens (None: --default-max-tokens)
    store_outage: StoreOutage = StoreOutage.WAIT
    hosted_tools: HostedTools = HostedTools.OMIT
    # Uncached prompt tokens from which its turns are prefilled on a prefill engine (0: always;
    # None: the gateway's --handoff-threshold; `off` in the file: never, kept as -1).
    handoff_threshold: int | None = None

    def model_id(self, requested: str, served: set[str]) -> str | None:
        """The served model a requested name means for this tenant, else None: an exact alias, the
        first wildcard alias that matches (in the file's order), the id itself, or — for the open
        tenant with exactly one model served — that model."""
        target = self.models.get(requested)
        if target is None:
            patterns = ((alias, m) for alias, m in self.models.items() if is_pattern(alias))
            target = next((m for alias, m in patterns if fnmatchcase(requested, alias)), requested)
        if target in served:
            return target
        if self.any_name and len(served) == 1:
            return next(iter(served))
        return None


def is_pattern(alias: str) -> bool:
    return any(c in alias for c in "*?[")


class TenantConfigError(ValueError):
    """The tenants file is malformed; the message names the tenant and field."""


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Tenants:
    by_name: dict[str, Tenant]
    open_access: bool  # no tenants file: every request is the default tenant, no key needed

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant owning `key` (constant-time compare of digests), or None."""
        if self.open_access:
            return self.by_name["default"]
        if not key:
            return None
        digest = key_digest(key)
        found = None
        for tenant in self.by_name.values():
            for known in tenant.key_digests:
                if hmac.compare_digest(known, digest):
                    found = tenant
        return found


def open_tenants() -> Tenants:
    return Tenants({"default": Tenant("default", any_name=True)}, open_access=True)


def _int_or_none(raw: dict[str, Any], name: str, where: str) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TenantConfigError(f"{where}.quotas.{name} must be a non-negative integer")
    return value


def _storage(raw: Any, where: str) -> tuple[bool, float | None, StoreOutage]:
    if not isinstance(raw, dict):
        raise TenantConfigError(f"{where}.storage must be a table")
    unknown = set(raw) - {"share_chunks", "idle_ttl_s", "on_store_outage"}
    if unknown:
        raise TenantConfigError(f"{where}.storage has unknown keys: {', '.join(sorted(unknown))}")
    share = raw.get("share_chunks", True)
    if not isinstance(share, bool):
        raise TenantConfigError(f"{where}.storage.share_chunks must be true or false")
    ttl = raw.get("idle_ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0):
        raise TenantConfigError(f"{where}.storage.idle_ttl_s must be a positive number of seconds")
    try:
        outage = StoreOutage(raw.get("on_store_outage", StoreOutage.WAIT.value))
    except ValueError:
        raise TenantConfigError(f"{where}.storage.on_store_outage must be 'wait' or 'reprefill'") from None
    return share, None if ttl is None else float(ttl), outage


def _volatile(raw: dict[str, Any], where: str) -> tuple[VolatileRule, ...]:
    builtins = raw.get("volatile_builtins", True)
    if not isinstance(builtins, bool):
        raise TenantConfigError(f"{where}.volatile_builtins must be true or false")
    rules = raw.get("volatile", [])
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise TenantConfigError(f"{where}.volatile must be an array of tables ([[{where}.volatile]])")
    if len(rules) > MAX_VOLATILE_RULES:
        raise TenantConfigError(f"{where}.volatile has {len(rules)} rules; the limit is {MAX_VOLATILE_RULES}")
    out = list(BUILTIN_RULES) if builtins else []
    for i, r in enumerate(rules):
        unknown = set(r) - {"name", "pattern", "action", "scope"}
        if unknown:
            raise TenantConfigError(f"{where}.volatile[{i}] has unknown keys: {', '.join(sorted(unknown))}")
        try:
            rule = make_rule(
                r.get("name"), r.get("pattern"), r.get("action", "drop"), r.get("scope", "system")
            )
        except RuleError as exc:
            raise TenantConfigError(f"{where}.volatile[{i}]: {exc}") from None
        if any(o.name == rule.name for o in out):
            raise TenantConfigError(f"{where}.volatile[{i}]: a rule named {rule.name!r} exists already")
        out.append(rule)
    return tuple(out)


def _handoff_threshold(value: Any, where: str) -> int | None:
    """`handoff_threshold`: a number of tokens (0: always), "off" (-1: never), absent (None)."""
    if value is None:
        return None
    if value == "off":
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise TenantConfigError(f"{where}.handoff_threshold must be a number of tokens (0: always) or 'off'")
    return value


def parse_tenants(doc: dict[str, Any]) -> Tenants:
    raw_tenants = doc.get("tenants")
    if not isinstance(raw_tenants, dict) or not raw_tenants:
        raise TenantConfigError("the tenants file needs at least one [tenants.NAME] table")
    out: dict[str, Tenant] = {}
    seen: dict[str, str] = {}
    for name, raw in raw_tenants.items():
        where = f"tenants.{name}"
        validate_id(name, "tenant name")
        if not isinstance(raw, dict):
            raise TenantConfigError(f"{where} must be a table")
        keys = raw.get("keys", [])
        digests = raw.get("key_sha256", [])
        if not isinstance(keys, list) or not isinstance(digests, list):
            raise TenantConfigError(f"{where}.keys and key_sha256 must be lists of strings")
        all_digests = {key_digest(str(k)) for k in keys} | {str(d).lower() for d in digests}
        if not all_digests:
            raise TenantConfigError(f"{where} has no keys")
        for d in all_digests:
            if d in seen:
                raise TenantConfigError(f"{where} shares a key with tenants.{seen[d]}")
            seen[d] = name
        try:
            durability = Durability(raw.get("durability", Durability.AFTER_TURN.value))
        except ValueError:
            raise TenantConfigError(f"{where}.durability must be 'after-turn' or 'on-evict'") from None
        models = raw.get("models", {})
        if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
            raise TenantConfigError(f"{where}.models must map alias names to model ids")
        q = raw.get("quotas", {})
        if not isinstance(q, dict):
            raise TenantConfigError(f"{where}.quotas must be a table")
        quotas = Quotas(**{f: _int_or_none(q, f, where) for f in Quotas.__dataclass_fields__})
        share, ttl, outage = _storage(raw.get("storage", {}), where)
        cap = raw.get("default_max_tokens")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or not 0 <= cap < 2**31):
            raise TenantConfigError(
                f"{where}.default_max_tokens must be an integer within 0..2^31-1 (0: none)"
            )
        try:
            hosted = HostedTools(raw.get("hosted_tools", HostedTools.OMIT.value))
        except ValueError:
            raise TenantConfigError(f"{where}.hosted_tools must be 'omit' or 'refuse'") from None
        out[name] = Tenant(
            name,
            frozenset(all_digests),
            durability,
            dict(models),
            quotas,
            share,
            ttl,
            volatile=_volatile(raw, where),
            default_max_tokens=cap,
            store_outage=outage,
            hosted_tools=hosted,
            handoff_threshold=_handoff_threshold(raw.get("handoff_threshold"), where),
        )
    return Tenants(out, open_access=False)


def load_tenants(path: str | Path | None) -> Tenants:
    if path is None:
        return open_tenants()
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TenantConfigError(f"cannot read tenants file {path}: {exc}") from exc
    return parse_tenants(doc)
