"""The Kafka settings every client reads: brokers, consumer-group timing, dead letters, TLS and SASL.

docs/configuration.md lists them; docs/deployment.md ("Kafka security") says how to set up TLS and SASL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasewise.kit.settings.spec import Group, SettingsError, above, at_least, in_range, non_empty, parse_size, setting

__all__ = ["KAFKA_SASL_MECHANISMS", "KAFKA_SECURITY_PROTOCOLS", "KafkaSettings"]

#: Kafka's security.protocol values and the SASL mechanisms phasewise configures on every client
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")


def bootstrap_servers(v: str) -> None:
    """Comma-separated ``host[:port]`` addresses (``[v6]:port``, a ``PROTOCOL://`` prefix allowed); a port
    that is no number is refused here, at once (a client would try it for its whole timeout).

    >>> bootstrap_servers("localhost:9O92")
    Traceback (most recent call last):
    ...
    ValueError: 'localhost:9O92': the port '9O92' is not a number in 1..65535
    """
    non_empty(v)
    for addr in v.split(","):
        hostport = addr.strip().rpartition("://")[2]
        if not hostport:
            raise ValueError(f"{v!r}: an empty address")
        if hostport.startswith("["):  # [v6]:port
            host, _, rest = hostport[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else None
        elif hostport.count(":") == 1:
            host, _, port = hostport.partition(":")
        else:  # a bare name (the client's default port) or an unbracketed v6 address
            host, port = hostport, None
        if not host:
            raise ValueError(f"{addr.strip()!r}: no host before the port")
        if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{addr.strip()!r}: the port {port!r} is not a number in 1..65535")


@dataclass(frozen=True, slots=True)
class KafkaSettings(Group):
    """Every Kafka client: the brokers, the consumer group's timing, topics, dead letters."""

    bootstrap: str = setting("127.0.0.1:9092", check=bootstrap_servers, flag="--bootstrap",
                             help="Kafka bootstrap address(es), comma-separated")
    #: consumer session timeout; the embedded broker completes a group join
    #: after about half of it, so local runs keep it short
    session_timeout_ms: int = setting(6000, check=above(0),
                                      help="consumer group session timeout, ms")
    heartbeat_interval_ms: int = setting(1500, check=above(0), help="consumer group heartbeat, ms")
    #: longest a fetch waits for data; the embedded broker does not answer a
    #: waiting fetch when data arrives, so this bounds end-to-end latency there
    #: (on Kafka it only bounds idle round trips)
    fetch_wait_max_ms: int = setting(20, check=at_least(0),
                                     help="longest a fetch waits for data, ms")
    create_topics: bool = setting(True, help="create missing topics at start-up")
    topic_partitions: int = setting(0, check=at_least(0), flag="--partitions",
                                    help="every topic's partition count "
                                         "(0 = each topic's documented default)")
    #: a dead letter (key and value) takes at most this many bytes: a payload that would not fit is
    #: cut and the dead letter says so (``truncated``). It must fit the broker's message size limit
    #: (Kafka's default: 1 MB; the producers' librdkafka default: 1,000,000 bytes)
    dead_letter_max_bytes: int = setting(900_000, parse=parse_size,
                                         check=in_range(16_384, 1_000_000),
                                         help="largest dead letter, bytes "
                                              "(fits the broker's message size)")

    #: TLS and SASL reach every client: the confluent-kafka producers, consumers and admin
    #: clients of every role, and the worker's Faust/aiokafka clients (phasewise.kit.kafka.security)
    security_protocol: str = setting("PLAINTEXT", choices=KAFKA_SECURITY_PROTOCOLS,
                                     name="kafka_security_protocol",
                                     help="how clients talk to the brokers")
    sasl_mechanism: str = setting("PLAIN", choices=KAFKA_SASL_MECHANISMS, name="kafka_sasl_mechanism",
                                  help="SASL mechanism (SASL_* protocols)")
    sasl_username: str = setting("", name="kafka_sasl_username",
                                 help="SASL user (PLAIN, SCRAM-*)")
    sasl_password: str = setting("", name="kafka_sasl_password", secret=True,
                                 help="SASL password (PLAIN, SCRAM-*); or kafka_sasl_password_file")
    sasl_password_file: str = setting("", name="kafka_sasl_password_file",
                                      help="file holding the SASL password (a mounted secret)")
    #: OAUTHBEARER: the client-credentials grant against an OpenID Connect token endpoint
    oauth_token_url: str = setting("", name="kafka_oauth_token_url",
                                   help="OAUTHBEARER: the OIDC token endpoint (https://...)")
    oauth_client_id: str = setting("", name="kafka_oauth_client_id", help="OAUTHBEARER: client id")
    oauth_client_secret: str = setting("", name="kafka_oauth_client_secret", secret=True,
                                       help="OAUTHBEARER: client secret; or kafka_oauth_client_secret_file")
    oauth_client_secret_file: str = setting("", name="kafka_oauth_client_secret_file",
                                            help="file holding the OAUTHBEARER client secret")
    oauth_scope: str = setting("", name="kafka_oauth_scope", help="OAUTHBEARER: scope(s) asked for")
    ssl_ca_file: str = setting("", name="kafka_ssl_ca_file",
                               help="PEM CA bundle the brokers' certificates are checked against "
                                    "(empty: the system's)")
    ssl_cert_file: str = setting("", name="kafka_ssl_cert_file",
                                 help="PEM client certificate (mutual TLS)")
    ssl_key_file: str = setting("", name="kafka_ssl_key_file", help="PEM client key (mutual TLS)")
    ssl_key_password: str = setting("", name="kafka_ssl_key_password", secret=True,
                                    help="the client key's password; or kafka_ssl_key_password_file")
    ssl_key_password_file: str = setting("", name="kafka_ssl_key_password_file",
                                         help="file holding the client key's password")
    ssl_check_hostname: bool = setting(True, name="kafka_ssl_check_hostname",
                                       help="check that a broker's certificate names it")

    def _rules(self) -> None:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise SettingsError("heartbeat_interval_ms", f"must be below session_timeout_ms "
                                f"({self.session_timeout_ms}), got {self.heartbeat_interval_ms}")
        for value, file, name in ((self.sasl_password, self.sasl_password_file, "kafka_sasl_password"),
                                  (self.oauth_client_secret, self.oauth_client_secret_file,
                                   "kafka_oauth_client_secret"),
                                  (self.ssl_key_password, self.ssl_key_password_file, "kafka_ssl_key_password")):
            if value and file:
                raise SettingsError(name, f"given twice: set {name} or {name}_file, not both")
        # what SASL and TLS need (credentials, readable files, a certificate with its key) is checked
        # at start-up and when a client is made (phasewise.kit.kafka.security.check_security), so each
        # of these settings can be given alone

    def common(self) -> dict[str, Any]:
        """The brokers every Kafka client of phasewise starts from.

        :func:`phasewise.kit.kafka.security.librdkafka_conf` adds TLS and SASL.
        """
        return {"bootstrap.servers": self.bootstrap}
