"""The run's engine secret: what stands between an engine's port and its control endpoints.

Engines serve generation to anyone who reaches them (as SGLang does), but every endpoint that changes
an engine's state or reads its weights — weight updates, memory release/resume, pause/continue, abort,
flush — requires `Authorization: Bearer <key>`, the same header SGLang's `--api-key` checks. The key is
one random secret per run, created by the controller before Ray starts and handed to every role
through the environment variable below (never on a command line of the embedded engine, where `ps`
would show it). Real SGLang servers receive it as `--api-key`, which SGLang requires on all endpoints
but its health checks.

A process that starts an engine itself (tests, `--rollout-external` setups) calls `ensure_engine_api_key`
first, so that the engine and the clients of that process share a key; a user running an engine by hand
exports `RELAX_ENGINE_API_KEY` in both environments.
"""

from __future__ import annotations

import hmac
import os
import secrets

ENGINE_API_KEY_ENV = "RELAX_ENGINE_API_KEY"

# Endpoints an engine answers without the key: generation and read-only status. Everything else needs
# it (an allow-list, so that an endpoint added later is protected by default).
OPEN_ENDPOINTS = frozenset({
    "/generate", "/health", "/health_generate", "/get_model_info", "/model_info", "/get_server_info",
    "/server_info", "/get_load", "/get_weight_version", "/v1/models",
})


def engine_api_key() -> str | None:
    """The run's engine key from the environment, or None when this process has none."""
    return os.environ.get(ENGINE_API_KEY_ENV) or None


def ensure_engine_api_key() -> str:
    """The run's engine key; creates one (and exports it to this process's children) when missing."""
    key = engine_api_key()
    if key is None:
        # hex, not url-safe base64: a key that starts with "-" (1 in 64 of those) reads as an option to the
        # argument parsers of sglang-router and SGLang, and the router then exits at start
        key = secrets.token_hex(32)
        os.environ[ENGINE_API_KEY_ENV] = key
    return key


def auth_headers(key: str | None = None) -> dict[str, str]:
    """The header that control calls carry (empty when there is no key)."""
    key = key if key is not None else engine_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorized(header_value: str | None, key: str | None) -> bool:
    """Whether an `Authorization` header carries `key` (constant-time comparison)."""
    if not key or not header_value:
        return False
    scheme, _, token = header_value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())
