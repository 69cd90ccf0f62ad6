"""TLS and SASL for every Kafka client, librdkafka's and the worker's aiokafka, from the ``kafka_*`` settings.

Secrets come from their setting or a file and are never logged; OAUTHBEARER is the OpenID Connect
client-credentials grant (:class:`OidcToken` for aiokafka). docs/deployment.md, "Kafka security".
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from phasewise.kit.settings import KafkaSettings, SettingsError

__all__ = ["OidcToken", "check_security", "client_secret", "key_password", "librdkafka_conf", "read_secret",
           "sasl_password", "ssl_context", "uses_sasl", "uses_tls"]


def read_secret(value: str, path: str, name: str) -> str:
    """A secret given as *value* or in the file at *path* (one trailing newline dropped).

    A file that cannot be read, or holds nothing, is a :class:`SettingsError`
    naming ``<name>_file``; the file's content is never quoted.
    """
    if not path:
        return value
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SettingsError(f"{name}_file", f"cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"{name}_file", f"{path!r} is not UTF-8 text") from None
    text = text[:-1] if text.endswith("\n") else text
    text = text[:-1] if text.endswith("\r") else text
    if not text:
        raise SettingsError(f"{name}_file", f"{path!r} is empty")
    return text


def sasl_password(k: KafkaSettings) -> str:
    return read_secret(k.sasl_password, k.sasl_password_file, "kafka_sasl_password")


def client_secret(k: KafkaSettings) -> str:
    return read_secret(k.oauth_client_secret, k.oauth_client_secret_file, "kafka_oauth_client_secret")


def key_password(k: KafkaSettings) -> str:
    return read_secret(k.ssl_key_password, k.ssl_key_password_file, "kafka_ssl_key_password")


def uses_tls(k: KafkaSettings) -> bool:
    return k.security_protocol in ("SSL", "SASL_SSL")


def uses_sasl(k: KafkaSettings) -> bool:
    return k.security_protocol.startswith("SASL_")


_FILES = ("sasl_password_file", "oauth_client_secret_file", "ssl_key_password_file", "ssl_ca_file",
          "ssl_cert_file", "ssl_key_file")


def check_security(k: KafkaSettings) -> None:
    """:class:`SettingsError` unless *k*'s SASL and TLS settings are complete and their files readable.

    Checked at start-up (:func:`phasewise.cli.main`) and when a client is made,
    not when settings are read, so that each setting can be given on its own.
    """
    for name in _FILES:
        path = getattr(k, name)
        if path and not os.access(path, os.R_OK):
            raise SettingsError(f"kafka_{name}", f"cannot read {path!r}")
    if bool(k.ssl_cert_file) != bool(k.ssl_key_file):
        raise SettingsError("kafka_ssl_key_file" if k.ssl_cert_file else "kafka_ssl_cert_file",
                            "a client certificate needs its key and a key its certificate")
    if not uses_tls(k) and (k.ssl_ca_file or k.ssl_cert_file):
        raise SettingsError("kafka_security_protocol", f"{k.security_protocol} does not use TLS, but "
                            "kafka_ssl_* files are set (use SSL or SASL_SSL)")
    if not uses_sasl(k):
        return
    if k.sasl_mechanism == "OAUTHBEARER":
        for name in ("oauth_token_url", "oauth_client_id"):
            if not getattr(k, name):
                raise SettingsError(f"kafka_{name}", "required by kafka_sasl_mechanism OAUTHBEARER")
        if not (k.oauth_client_secret or k.oauth_client_secret_file):
            raise SettingsError("kafka_oauth_client_secret", "required by kafka_sasl_mechanism OAUTHBEARER "
                                "(or kafka_oauth_client_secret_file)")
        if not k.oauth_token_url.startswith(("https://", "http://")):
            raise SettingsError("kafka_oauth_token_url", f"must be an http(s) URL, got {k.oauth_token_url!r}")
    else:
        if not k.sasl_username:
            raise SettingsError("kafka_sasl_username", f"required by kafka_sasl_mechanism {k.sasl_mechanism}")
        if not (k.sasl_password or k.sasl_password_file):
            raise SettingsError("kafka_sasl_password", f"required by kafka_sasl_mechanism "
                                f"{k.sasl_mechanism} (or kafka_sasl_password_file)")


def librdkafka_conf(k: KafkaSettings) -> dict[str, Any]:
    """The librdkafka properties of *k*'s TLS and SASL settings (none for PLAINTEXT).

    >>> librdkafka_conf(KafkaSettings())
    {'security.protocol': 'plaintext'}
    >>> c = librdkafka_conf(KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
    ...                                   sasl_username="pw", sasl_password="s3cret"))
    >>> c["sasl.mechanism"], c["sasl.username"], c["ssl.endpoint.identification.algorithm"]
    ('SCRAM-SHA-512', 'pw', 'https')
    """
    check_security(k)
    conf: dict[str, Any] = {"security.protocol": k.security_protocol.lower()}
    if uses_tls(k):
        conf["ssl.endpoint.identification.algorithm"] = "https" if k.ssl_check_hostname else "none"
        if k.ssl_ca_file:
            conf["ssl.ca.location"] = k.ssl_ca_file
        if k.ssl_cert_file:
            conf["ssl.certificate.location"] = k.ssl_cert_file
            conf["ssl.key.location"] = k.ssl_key_file
            password = key_password(k)
            if password:
                conf["ssl.key.password"] = password
    if uses_sasl(k):
        conf["sasl.mechanism"] = k.sasl_mechanism
        if k.sasl_mechanism == "OAUTHBEARER":
            conf.update({"sasl.oauthbearer.method": "oidc",
                         "sasl.oauthbearer.token.endpoint.url": k.oauth_token_url,
                         "sasl.oauthbearer.client.id": k.oauth_client_id,
                         "sasl.oauthbearer.client.secret": client_secret(k)})
            if k.oauth_scope:
                conf["sasl.oauthbearer.scope"] = k.oauth_scope
        else:
            conf["sasl.username"] = k.sasl_username
            conf["sasl.password"] = sasl_password(k)
    return conf


def ssl_context(k: KafkaSettings) -> ssl.SSLContext | None:
    """The TLS context of *k* for Python clients (aiokafka): None unless SSL or SASL_SSL.

    Checks the brokers' certificates against ``kafka_ssl_ca_file`` (else the
    system's CAs) and, unless ``kafka_ssl_check_hostname`` is off, their names;
    presents the client certificate when one is set. A file that cannot be
    loaded is a :class:`SettingsError` naming its setting.
    """
    check_security(k)
    if not uses_tls(k):
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=k.ssl_ca_file or None)
    except (OSError, ssl.SSLError) as e:
        raise SettingsError("kafka_ssl_ca_file", f"cannot load {k.ssl_ca_file!r}: {e}") from None
    ctx.check_hostname = k.ssl_check_hostname
    if k.ssl_cert_file:
        try:
            ctx.load_cert_chain(k.ssl_cert_file, k.ssl_key_file, password=key_password(k) or None)
        except (OSError, ssl.SSLError) as e:
            raise SettingsError("kafka_ssl_cert_file", f"cannot load the client certificate "
                                f"{k.ssl_cert_file!r} with its key: {getattr(e, 'reason', None) or e}") from None
    return ctx


class OidcToken:
    """An OAUTHBEARER access token from an OpenID Connect token endpoint (client-credentials grant).

    :meth:`token` returns the current token, asking the endpoint again once
    80% of its lifetime has passed. The client secret is read (from its
    setting or file) at each request, so a rotated secret file is picked up.
    """

    #: a token's lifetime when the endpoint names none, s
    DEFAULT_LIFETIME_S = 300.0

    def __init__(self, k: KafkaSettings, *, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = k.oauth_token_url
        self.client_id = k.oauth_client_id
        self.scope = k.oauth_scope
        self._settings = k
        self.timeout_s = timeout_s
        self.clock = clock
        self._token: str | None = None
        self._renew_at = 0.0
        self._lock = threading.Lock()

    def token(self) -> str:
        with self._lock:
            if self._token is None or self.clock() >= self._renew_at:
                token, lifetime = self._fetch()
                self._token, self._renew_at = token, self.clock() + 0.8 * lifetime
            return self._token

    def _fetch(self) -> tuple[str, float]:
        form = {"grant_type": "client_credentials"}
        if self.scope:
            form["scope"] = self.scope
        basic = base64.b64encode(f"{urllib.parse.quote(self.client_id)}:"
                                 f"{urllib.parse.quote(client_secret(self._settings))}".encode()).decode()
        req = urllib.request.Request(self.url, data=urllib.parse.urlencode(form).encode(), method="POST",
                                     headers={"Authorization": f"Basic {basic}", "Accept": "application/json",
                                              "Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - URL is a setting
                body = resp.read(1 << 20)
        except urllib.error.HTTPError as e:
            raise PermissionError(f"token endpoint {self.url} refused the client credentials "
                                  f"(HTTP {e.code})") from None
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(f"token endpoint {self.url} did not answer: "
                                  f"{getattr(e, 'reason', None) or e}") from None
        try:
            doc = json.loads(body)
            token = doc["access_token"]
            lifetime = float(doc.get("expires_in", self.DEFAULT_LIFETIME_S))
        except (ValueError, KeyError, TypeError):
            raise PermissionError(f"token endpoint {self.url} answered without an access_token") from None
        if not isinstance(token, str) or not token:
            raise PermissionError(f"token endpoint {self.url} answered without an access_token")
        return token, max(1.0, lifetime)
