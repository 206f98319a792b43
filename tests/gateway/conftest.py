"""Gateway test fixtures: an injected clock, a real SQLite store in a tmp dir, JWT keys, and a
real redis-server on a free loopback port (tests needing it skip when the binary is missing)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from ferrylm.gateway import Gateway, GatewayConfig
from ferrylm.gateway.store import Store
from tests.gateway.helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock):
    s = Store(f"sqlite:///{tmp_path / 'state.db'}", clock)
    yield s
    s.close()


@pytest.fixture
def make_gateway(store: Store, clock: FakeClock):
    """Gateways over the shared tmp store and clock; require_auth on unless overridden."""
    made: list[Gateway] = []

    def make(**overrides) -> Gateway:
        overrides.setdefault("require_auth", True)
        gw = Gateway(GatewayConfig(state_db=store.url, **overrides), store=store, clock=clock)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.close()  # the store is the fixture's


@pytest.fixture(scope="session")
def rsa_keys() -> tuple[bytes, str]:
    """(private PEM, public PEM) for RS256."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public.decode()


@pytest.fixture(scope="session")
def ec_keys() -> tuple[bytes, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public.decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A throwaway redis-server (no persistence) for the whole session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    import redis

    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.02)
        else:
            pytest.fail("redis-server did not start")
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
