"""Authentication: the pure parts and the JWKS cache on trio's MockClock."""

from __future__ import annotations

import hmac
import json
import os
import time
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from gateway.auth import challenge, jwks, tokens
from gateway.auth.authenticator import load_tokens_file
from gateway.auth.jwt import parse_jwks
from gateway.config import load
from gateway.core import bridge as bridge_mod
from gateway.errors import ConfigError, InvalidParams
from gateway.protocol import jsonrpc, mrtr


def _jwk(key: object, kid: str, **extra: str) -> dict[str, str]:
    algo = RSAAlgorithm if isinstance(key, rsa.RSAPublicKey) else ECAlgorithm
    return {**json.loads(algo.to_jwk(key)), "kid": kid, **extra}


async def test_tokens_jwks_challenge_and_state_principal(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        autojump_clock: trio.testing.MockClock) -> None:
    # -- constant-time comparison: hmac.compare_digest compares the fingerprint with EVERY entry
    entries = [tokens.BearerEntry(f"p{i}", tokens.sha256_hex(f"token-{i}")) for i in range(4)]
    table = tokens.BearerTable(entries)
    calls: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    found = table.match("token-1")
    assert found is not None and found.principal == "p1"
    assert [b for _, b in calls] == [e.token_sha256 for e in entries]  # no early exit
    # the token itself is never compared
    assert {a for a, _ in calls} == {tokens.sha256_hex("token-1")}
    calls.clear()
    assert table.match("nope") is None and len(calls) == 4
    assert table.match("x" * (tokens.MAX_TOKEN + 1)) is None
    monkeypatch.undo()

    # -- tokens file: syntax, and its mode/owner checked at load
    good = tokens.sha256_hex("carol-token")
    text = f"# team\ncarol:{good}:dev,ops\n\ndave:{tokens.sha256_hex('d')}\n"
    parsed = tokens.parse_tokens_file(text, "f")
    assert parsed[0] == tokens.BearerEntry("carol", good, frozenset({"dev", "ops"}))
    with pytest.raises(ValueError, match="f:1: the second field") as bad:
        tokens.parse_tokens_file("eve:the-token-itself\n", "f")
    assert "the-token-itself" not in str(bad.value)  # a token pasted by mistake is not echoed
    uid = os.geteuid()
    assert tokens.file_problem(0o100600, uid, uid) is None
    assert tokens.file_problem(0o100400, 0, uid) is None
    assert "mode 0640" in (tokens.file_problem(0o100640, uid, uid) or "")
    assert "mode 0602" in (tokens.file_problem(0o100602, uid, uid) or "")
    assert "owned by uid" in (tokens.file_problem(0o100600, uid + 1, uid + 2) or "")
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644"):
        load_tokens_file(str(path))
    path.chmod(0o600)
    assert [e.principal for e in load_tokens_file(str(path))] == ["carol", "dave"]
    if uid != 0:  # a root-owned file is always acceptable
        with pytest.raises(ConfigError, match="owned by uid"):
            load_tokens_file(str(path), gateway_uid=uid + 1)
    with pytest.raises(ConfigError, match="token_sha256: must be the hex SHA-256"):
        load('[[auth.bearer]]\nprincipal = "a"\ntoken_sha256 = "secret"\n')
    with pytest.raises(ConfigError, match="jwks_uri: must be an https"):
        load('[auth.oauth]\nissuer = "i"\naudience = "a"\njwks_uri = "http://id.example/jwks"\n')

    # -- JWKS parsing: RSA -> RS256, P-256 -> ES256; no symmetric, private or kid-less keys
    rsa_pub = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    ec_pub = ec.generate_private_key(ec.SECP256R1()).public_key()
    doc = {"keys": [_jwk(rsa_pub, "r"), _jwk(ec_pub, "e"),
                    {"kty": "oct", "k": "c2VjcmV0", "kid": "h"},
                    {**_jwk(rsa_pub, "x"), "alg": "HS256"},
                    {k: v for k, v in _jwk(rsa_pub, "").items() if k != "kid"},
                    {**_jwk(rsa_pub, "enc"), "use": "enc"}]}
    keys, skipped = parse_jwks(json.dumps(doc).encode())
    assert {k: v.algorithm for k, v in keys.items()} == {"r": "RS256", "e": "ES256"}
    assert len(skipped) == 4
    keys, skipped = parse_jwks(
        json.dumps({"keys": [_jwk(rsa_pub, f"k{i}") for i in range(40)]}).encode())
    assert len(keys) == 32 and "8 keys beyond" in skipped[-1]

    # -- JWKS cache: unknown kids refetch at most once per min interval; a failed fetch keeps
    #    the last good set
    served = {"keys": [_jwk(rsa_pub, "k1")]}
    fetched: list[float] = []
    fail = False

    async def fetch(uri: str) -> bytes:
        fetched.append(trio.current_time())
        await trio.sleep(0.1)
        if fail:
            raise jwks.fetcher.JwksFetchError("HTTP 503")
        return json.dumps(served).encode()

    cache = jwks.JwksCache("https://id.example/jwks", 30.0, fetch)
    await cache.prime()
    assert set(cache.keys) == {"k1"} and len(fetched) == 1
    async with trio.open_nursery() as nursery:  # a burst of unknown kids: no fetch (too soon)
        for i in range(20):
            nursery.start_soon(cache.key_for, f"random-{i}")
    assert len(fetched) == 1
    served["keys"].append(_jwk(ec_pub, "k2"))  # the issuer rotates
    await trio.sleep(30)
    async with trio.open_nursery() as nursery:  # 20 at once: one fetch, all see its result
        for i in range(20):
            nursery.start_soon(cache.key_for, "k2" if i % 2 else f"random-{i}")
    assert len(fetched) == 2 and set(cache.keys) == {"k1", "k2"}
    fail = True
    await trio.sleep(31)
    assert await cache.key_for("k3") is None and len(fetched) == 3
    assert set(cache.keys) == {"k1", "k2"} and "HTTP 503" in (cache.last_error or "")

    # -- the challenge and the metadata URL (RFC 9728 §3.1)
    assert challenge.metadata_url("https://gw.example/mcp") == \
        "https://gw.example/.well-known/oauth-protected-resource/mcp"
    header = challenge.www_authenticate("https://m", error="insufficient_scope",
                                        scope=["a", "b\"c"])
    assert header == ('Bearer resource_metadata="https://m", error="insufficient_scope", scope="a '
                      'bc"')

    # -- a requestState is bound to its principal: another principal's retry is invalid_state
    #    before anything about the flow is looked at
    codec = mrtr.StateCodec(b"k" * 32, "r1")
    br = bridge_mod.Bridge(codec, 60.0)
    params = {"name": jsonrpc.encode_dict("t")}  # type: ignore[arg-type]  # a JSON string, encoded
    state = codec.sign(mrtr.Claims(flow="f1", round=1, expires=int(time.time()) + 60, backend="b",
                                   keys=("k",),
                                   digest=mrtr.params_digest("tools/call", params),
                                   principal="bearer:alice"))
    params["requestState"] = jsonrpc.encode_dict(state)  # type: ignore[arg-type]  # a JSON string, encoded
    for who in ("bearer:bob", "oauth:alice", None):
        with pytest.raises(InvalidParams, match="another principal"):
            br.resume("tools/call", params, 2, {}, principal=who)
    with pytest.raises(InvalidParams, match="call is over"):  # the owner gets past that check
        br.resume("tools/call", params, 2, {}, principal="bearer:alice")


def test_check_config_reads_the_tokens_file_as_a_reload_would(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ExecReload`` runs check-config before the SIGHUP: a tokens file the reload would refuse
    must fail check-config (it passed, so ``systemctl reload`` said done while the daemon kept
    its old tokens and logged the failure); the problem is named, never the line's text."""
    from gateway import cli

    tokens = tmp_path / "tokens"
    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[auth]\ntokens_file = "tokens"\n')
    tokens.write_text("alice:" + "ab" * 32 + "\n")
    tokens.chmod(0o600)
    assert cli.main(["check-config", str(cfg)]) == 0
    cases = (("alice:pasted-secret-token\n", 0o600, "tokens:1: the second field"),
             ("alice:" + "ab" * 32 + "\n", 0o644, "mode 0644"),
             (None, 0o600, "No such file"))
    for text, mode, problem in cases:
        tokens.unlink(missing_ok=True)
        if text is not None:
            tokens.write_text(text)
            tokens.chmod(mode)
        capsys.readouterr()
        assert cli.main(["check-config", str(cfg)]) == 1, problem
        err = capsys.readouterr().err
        assert f"{cfg}: auth.tokens_file: " in err and problem in err and "pasted" not in err, err
