"""The tokens file and the per-token rate limits, as units
(tests/integration/control/test_security.py runs them through a real control plane)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from control.api.auth import RateLimiter, TokenStore, parse_tokens
from control.config import ConfigError
from control.errors import Overloaded, PermissionDenied

SECRET = "a-secret-of-some-length"


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"token": SECRET, "scopes": ["generate"]}, "tokens[0].name"),
        ({"name": "a", "scopes": ["generate"]}, "tokens[0]"),  # neither token nor sha256
        ({"name": "a", "token": "short", "scopes": ["generate"]}, "tokens[0].token"),
        ({"name": "a", "sha256": "xyz", "scopes": ["generate"]}, "tokens[0].sha256"),
        ({"name": "a", "token": SECRET, "scopes": ["everything"]}, "tokens[0].scopes"),
        ({"name": "a", "token": SECRET, "scopes": ["admin"], "models": "tiny"}, "tokens[0].models"),
        ({"name": "a", "token": SECRET, "scopes": ["admin"], "colour": 1}, "tokens[0].colour"),
        (
            {"name": "a", "token": SECRET, "scopes": ["admin"], "rate_limit": {"tokens_per_s": 0}},
            "tokens[0].rate_limit.tokens_per_s",
        ),
    ],
)
def test_a_bad_entry_is_named(entry: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_tokens({"tokens": [entry]}, "tokens.yaml")
    assert e.value.key == f"tokens.yaml: {key}"


def test_the_same_secret_twice_is_refused_and_digests_match_secrets() -> None:
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    with pytest.raises(ConfigError, match="the same secret as token 'a'"):
        parse_tokens(
            {
                "tokens": [
                    {"name": "a", "token": SECRET, "scopes": ["admin"]},
                    {"name": "b", "sha256": digest.upper(), "scopes": ["admin"]},
                ]
            },
            "f",
        )


def test_store_looks_up_by_secret_and_keeps_its_tokens_when_a_reload_fails(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens: [{{name: a, token: {SECRET}, scopes: [generate], models: [m]}}]\n")
    store = TokenStore(path)
    caller = store.lookup(SECRET)
    assert caller is not None and caller.name == "a" and caller.scopes == {"generate"}
    caller.check_model("m")
    with pytest.raises(PermissionDenied):
        caller.check_model("other")
    assert store.lookup("a-secret-of-some-lengtH") is None
    path.write_text("tokens: nonsense\n")
    assert not store.reload()
    assert store.lookup(SECRET) is not None


def test_rate_limiter_buckets() -> None:
    now = [0.0]
    limiter = RateLimiter(requests_per_s=2, tokens_per_s=100, clock=lambda: now[0])
    assert limiter.take_request() is None
    assert limiter.take_request() is None
    wait = limiter.take_request()
    assert wait == pytest.approx(0.5)
    now[0] += 0.5
    assert limiter.take_request() is None
    # Tokens: one request may take more than the bucket holds; the next waits off the debt.
    assert limiter.take_tokens(150) is None
    assert limiter.take_tokens(1) == pytest.approx(0.5)
    limiter.give_back_tokens(60)  # it generated less than its max_tokens
    assert limiter.take_tokens(1) is None


def test_caller_over_its_token_rate_is_overloaded_with_a_delay(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        f"tokens: [{{name: a, token: {SECRET}, scopes: [generate], "
        "rate_limit: {tokens_per_s: 10}}]\n"
    )
    caller = TokenStore(path).lookup(SECRET)
    assert caller is not None
    caller.take_tokens(30)
    with pytest.raises(Overloaded) as e:
        caller.take_tokens(1)
    assert e.value.retry_after_s > 0 and "10 tokens per second" in str(e.value)


def test_a_reload_keeps_a_tokens_buckets_unless_its_rates_change(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    entry = f"{{name: a, token: {SECRET}, scopes: [generate], rate_limit: {{requests_per_s: 1}}}}"
    path.write_text(f"tokens: [{entry}]\n")
    store = TokenStore(path)
    first = store.lookup(SECRET)
    assert first is not None and first.limiter is not None
    assert first.limiter.take_request() is None
    assert first.limiter.take_request() is not None  # empty for a second
    path.write_text(f"tokens: [{entry}, {{name: b, token: b-{SECRET}, scopes: [admin]}}]\n")
    assert store.reload()
    again = store.lookup(SECRET)
    assert again is not None and again.limiter is first.limiter  # still empty: no refill
    assert again.limiter.take_request() is not None
    path.write_text(f"tokens: [{entry.replace('requests_per_s: 1', 'requests_per_s: 5')}]\n")
    assert store.reload()
    changed = store.lookup(SECRET)
    assert changed is not None and changed.limiter is not first.limiter
    assert changed.limiter is not None and changed.limiter.take_request() is None
