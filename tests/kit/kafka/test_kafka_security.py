"""TLS and SASL settings reach every Kafka client; secrets are never printed.

Tested at the configuration boundary: the real librdkafka clients (which load
and check certificates, keys and their passwords when made), the real aiokafka
clients Faust builds from the worker's settings, and a real HTTP token
endpoint on loopback for OAUTHBEARER. The embedded broker (Tansu 0.6) takes
SCRAM only for users created through a broker that already requires it, on
memory storage a chicken-and-egg, so no handshake with a broker is tested.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka import KafkaException

from phasewise.kit.kafka.client import make_admin, make_consumer, make_producer
from phasewise.kit.kafka.security import OidcToken, check_security, librdkafka_conf, ssl_context
from phasewise.kit.settings import KafkaSettings, Settings, SettingsError

SECRET = "pa55-w0rd-never-printed"
KEY_PASSWORD = "key-pa55-never-printed"

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, and a client certificate signed by it whose key is encrypted with KEY_PASSWORD."""
    d = tmp_path_factory.mktemp("pki")

    def ossl(*args: str) -> None:
        r = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=phasewise-test-ca")
    ossl("req", "-newkey", "rsa:2048", "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=worker",
         "-passout", f"pass:{KEY_PASSWORD}")
    ossl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "client.pem", "-days", "2")
    (d / "password").write_text(SECRET + "\n")
    (d / "key-password").write_text(KEY_PASSWORD + "\n")
    return d


def kafka(**kw) -> Settings:
    return Settings(host="h", kafka=KafkaSettings(bootstrap="127.0.0.1:1", **kw))


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("kw, setting", [
    ({"security_protocol": "SASL_SSL"}, "kafka_sasl_username"),
    ({"security_protocol": "SASL_PLAINTEXT", "sasl_username": "u"}, "kafka_sasl_password"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}, "kafka_oauth_token_url"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER", "oauth_token_url": "ftp://x",
      "oauth_client_id": "c", "oauth_client_secret": "s"}, "kafka_oauth_token_url"),
])
def test_incomplete_security_settings_are_one_line_errors(kw, setting):
    with pytest.raises(SettingsError) as e:
        check_security(KafkaSettings(**kw))
    assert e.value.setting == setting
    assert "\n" not in str(e.value)


def test_a_secret_given_twice_is_refused_when_settings_are_read():
    with pytest.raises(SettingsError, match="^kafka_sasl_password: given twice"):
        KafkaSettings(sasl_password="a", sasl_password_file="/etc/hostname")


@pytest.mark.parametrize("kw, setting", [
    ({"security_protocol": "SSL", "sasl_password_file": "/nonexistent/pw"}, "kafka_sasl_password_file"),
    ({"security_protocol": "SSL", "ssl_cert_file": "/etc/hostname"}, "kafka_ssl_key_file"),
    ({"security_protocol": "PLAINTEXT", "ssl_ca_file": "/etc/hostname"}, "kafka_security_protocol"),
])
def test_unreadable_or_unused_files_are_one_line_errors_when_a_client_is_made(kw, setting, tmp_path):
    s = kafka(**kw)  # each setting can be given alone ...
    for make in (make_producer, make_admin, lambda s: ssl_context(s.kafka)):
        with pytest.raises(SettingsError) as e:  # ... and is checked before any client exists
            make(s)
        assert e.value.setting == setting and "\n" not in str(e.value)
    # through the CLI: one line and exit status 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    env.update({f"PHASEWISE_KAFKA_{k.upper()}": v for k, v in kw.items()}, PHASEWISE_DATA_DIR=str(tmp_path),
               PHASEWISE_BOOTSTRAP="127.0.0.1:9", PHASEWISE_BACKEND="dry-run")
    r = subprocess.run([sys.executable, "-m", "phasewise.cli", "actuate"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        f"phasewise actuate: error: {setting}: "), r.stderr[-2000:]


def test_security_settings_come_from_the_environment_with_their_flat_names(pki):
    s = Settings.from_env(env={"PHASEWISE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                               "PHASEWISE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
                               "PHASEWISE_KAFKA_SASL_USERNAME": "worker",
                               "PHASEWISE_KAFKA_SASL_PASSWORD_FILE": str(pki / "password"),
                               "PHASEWISE_KAFKA_SSL_CA_FILE": str(pki / "ca.pem")})
    conf = librdkafka_conf(s.kafka)
    assert conf["sasl.password"] == SECRET  # the file's content, its newline dropped
    assert conf["security.protocol"] == "sasl_ssl" and conf["sasl.mechanism"] == "SCRAM-SHA-256"
    assert conf["ssl.ca.location"] == str(pki / "ca.pem")
    with pytest.raises(SettingsError, match="PHASEWISE_KAFKA_SASL_MECHANISM: invalid choice"):
        Settings.from_env(env={"PHASEWISE_KAFKA_SASL_MECHANISM": "GSSAPI"})


def test_secrets_are_never_in_the_printed_settings_nor_in_repr():
    s = kafka(security_protocol="SASL_SSL", sasl_username="worker", sasl_password=SECRET)
    assert "kafka_sasl_password='***'" in s.describe()
    assert "kafka_sasl_username='worker'" in s.describe()
    assert SECRET not in s.describe() and SECRET not in repr(s) and SECRET not in str(s.kafka)
    assert "kafka_sasl_password=''" in Settings(host="h").describe()  # unset: shown as unset


def test_a_refused_secret_is_not_quoted_in_the_error():
    with pytest.raises(SettingsError) as e:
        KafkaSettings(sasl_password=12345)  # type: ignore[arg-type]
    assert "12345" not in str(e.value) and e.value.setting == "kafka_sasl_password"


# --------------------------------------------------------------------------- librdkafka


@needs_openssl
def test_mutual_tls_and_scram_reach_every_librdkafka_client(pki):
    s = kafka(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="worker",
              sasl_password_file=str(pki / "password"), ssl_ca_file=str(pki / "ca.pem"),
              ssl_cert_file=str(pki / "client.pem"), ssl_key_file=str(pki / "client.key"),
              ssl_key_password_file=str(pki / "key-password"))
    # librdkafka loads the CA, the certificate and the key (decrypting it) when a client is made
    for client in (make_producer(s), make_consumer(s, "g"), make_admin(s)):
        assert client is not None
    # ... so a wrong key password is refused there: proof the setting reaches the client
    (pki / "wrong").write_text("not-the-password\n")
    bad = kafka(security_protocol="SSL", ssl_ca_file=str(pki / "ca.pem"), ssl_cert_file=str(pki / "client.pem"),
                ssl_key_file=str(pki / "client.key"), ssl_key_password_file=str(pki / "wrong"))
    with pytest.raises(KafkaException, match="(?i)ssl|key"):
        make_producer(bad)
    # and a CA file that is no certificate
    junk = kafka(security_protocol="SSL", ssl_ca_file=str(pki / "password"))
    with pytest.raises(KafkaException, match="(?i)ssl|ca"):
        make_admin(junk)


@needs_openssl
def test_the_python_tls_context_loads_the_same_files(pki):
    k = KafkaSettings(security_protocol="SSL", ssl_ca_file=str(pki / "ca.pem"), ssl_cert_file=str(pki / "client.pem"),
                      ssl_key_file=str(pki / "client.key"), ssl_key_password=KEY_PASSWORD)
    ctx = ssl_context(k)
    assert ctx is not None and ctx.check_hostname
    assert any(c["subject"] == ((("commonName", "phasewise-test-ca"),),) for c in ctx.get_ca_certs())
    with pytest.raises(SettingsError, match="kafka_ssl_cert_file"):
        ssl_context(KafkaSettings(security_protocol="SSL", ssl_cert_file=str(pki / "client.pem"),
                                  ssl_key_file=str(pki / "client.key"), ssl_key_password="wrong"))
    assert ssl_context(KafkaSettings()) is None


# --------------------------------------------------------------------------- OAUTHBEARER


class TokenEndpoint:
    """An OIDC token endpoint on loopback: client credentials in, a token out; counts requests."""

    def __init__(self, client_id: str, secret: str, expires_in: int = 3600) -> None:
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                form = dict(urllib.parse.parse_qsl(body))
                auth = base64.b64decode(self.headers.get("Authorization", "Basic ")[6:]).decode()
                outer.requests.append({"form": form, "auth": auth})
                ok = auth == f"{client_id}:{secret}" and form.get("grant_type") == "client_credentials"
                out = json.dumps({"access_token": f"token-{len(outer.requests)}", "token_type": "bearer",
                                  "expires_in": expires_in} if ok else {"error": "invalid_client"}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def token_endpoint():
    ep = TokenEndpoint("phasewise", SECRET)
    yield ep
    ep.close()


def test_oauthbearer_tokens_come_from_the_token_endpoint_and_are_kept_until_near_expiry(token_endpoint, tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    k = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER", oauth_token_url=token_endpoint.url,
                      oauth_client_id="phasewise", oauth_client_secret_file=str(tmp_path / "secret"),
                      oauth_scope="kafka")
    now = [0.0]
    tok = OidcToken(k, clock=lambda: now[0])
    assert tok.token() == "token-1" and tok.token() == "token-1"
    assert token_endpoint.requests[0]["form"] == {"grant_type": "client_credentials", "scope": "kafka"}
    now[0] = 0.81 * 3600  # past 80% of the lifetime: renewed
    assert tok.token() == "token-2"
    (tmp_path / "secret").write_text("rotated-and-wrong")
    now[0] = 2 * 3600
    with pytest.raises(PermissionError, match="refused the client credentials"):
        tok.token()
    # librdkafka does the same grant itself: its properties are accepted by a real client
    conf = librdkafka_conf(KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
                                         oauth_token_url=token_endpoint.url, oauth_client_id="phasewise",
                                         oauth_client_secret=SECRET))
    assert conf["sasl.oauthbearer.method"] == "oidc" and conf["sasl.oauthbearer.client.secret"] == SECRET
    assert make_producer(Settings(host="h", kafka=KafkaSettings(
        bootstrap="127.0.0.1:1", security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
        oauth_token_url=token_endpoint.url, oauth_client_id="phasewise", oauth_client_secret=SECRET))) is not None


# --------------------------------------------------------------------------- Faust / aiokafka


@needs_openssl
def test_the_worker_faust_clients_get_the_same_tls_and_sasl(pki):
    pytest.importorskip("faust")
    import asyncio

    from phasewise.streams.app import create_app

    s = kafka(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256", sasl_username="worker",
              sasl_password_file=str(pki / "password"), ssl_ca_file=str(pki / "ca.pem"))
    app = create_app(s, register_agents=False)
    assert SECRET not in repr(app.conf.broker_credentials)

    async def clients():
        consumer = app.consumer._thread._create_worker_consumer(app.transport)
        producer = app.producer._new_producer()
        return consumer, producer

    consumer, producer = asyncio.run(clients())
    for client in (consumer._client, producer.client):
        assert client._security_protocol == "SASL_SSL"
        assert client._sasl_mechanism == "SCRAM-SHA-256"
        assert client._sasl_plain_username == "worker" and client._sasl_plain_password == SECRET
        ca = client._ssl_context.get_ca_certs()
        assert any(c["subject"] == ((("commonName", "phasewise-test-ca"),),) for c in ca)
    assert consumer._fetch_max_wait_ms == s.kafka.fetch_wait_max_ms  # the fenced Faust change is in force


def test_the_worker_oauthbearer_provider_fetches_from_the_endpoint(token_endpoint):
    pytest.importorskip("faust")
    import asyncio

    from phasewise.streams.app import broker_credentials

    creds = broker_credentials(kafka(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER",
                                     oauth_token_url=token_endpoint.url, oauth_client_id="phasewise",
                                     oauth_client_secret=SECRET))
    assert creds.mechanism.value == "OAUTHBEARER" and creds.ssl_context is not None
    assert asyncio.run(creds.oauth_cb.token()) == "token-1"


# --------------------------------------------------------------------------- logs


def test_no_secret_in_a_role_output_while_it_waits_for_a_broker(tmp_path):
    """``phasewise actuate`` with SASL against a closed port: settings printed, retries logged, no secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    env.update({"PHASEWISE_BOOTSTRAP": "127.0.0.1:9", "PHASEWISE_HOST": "h", "PHASEWISE_BACKEND": "dry-run",
                "PHASEWISE_DATA_DIR": str(tmp_path), "PHASEWISE_LOG_LEVEL": "debug",
                "PHASEWISE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "PHASEWISE_KAFKA_SASL_USERNAME": "worker",
                "PHASEWISE_KAFKA_SASL_PASSWORD": SECRET})
    p = subprocess.Popen([sys.executable, "-m", "phasewise.cli", "actuate"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=4)
    except subprocess.TimeoutExpired:
        p.terminate()
        out, _ = p.communicate(timeout=20)
    assert "kafka_sasl_password='***'" in out, out[-2000:]
    assert "no Kafka broker answers" in out, out[-2000:]
    assert SECRET not in out
