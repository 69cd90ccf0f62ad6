"""The Faust application of the stream workers: :func:`create_app` builds one ``faust.App`` from
settings (broker, credentials, in-memory tables restored from their changelogs, one record per
producer batch, a crashing agent supervisor) and, for ``phasewise worker``, registers the samples
agent (:func:`phasewise.streams.agents.samples.register`). Narrative: docs/worker.md, "The Faust app".
"""

from __future__ import annotations

from typing import Any

import faust
from mode import CrashingSupervisor

from phasewise.kit.settings import Settings
from phasewise.streams.faust_compat import bound_fetch_wait, seek_before_stream_flow

__all__ = ["APP_VERSION", "broker_credentials", "create_app"]

#: format of the worker's tables (see phasewise.models.vpa.state.ContainerEntry)
APP_VERSION = 1


def broker_urls(bootstrap: str) -> list[str]:
    return [f"kafka://{h.strip()}" for h in bootstrap.split(",") if h.strip()]


def create_app(settings: Settings, *, samples_partitions: int | None = None,
               metrics: Any = None, register_agents: bool = True, views: dict[str, Any] | None = None) -> faust.App:
    """A configured app with the samples agent and its table registered.

    *samples_partitions*: the samples topic's real partition count (the
    state table must be co-partitioned with it); default: the documented one.
    *metrics*: a :class:`~phasewise.streams.metrics.WorkerMetrics` (default:
    one on a private registry). *views*: filled with the worker's JSON views
    for its metrics server (:func:`phasewise.kit.observe.serve`).
    """
    app = faust.App(
        settings.worker.id,
        broker=broker_urls(settings.kafka.bootstrap),
        store="memory://",
        version=APP_VERSION,
        autodiscover=False,
        datadir=settings.data_dir,
        broker_session_timeout=settings.kafka.session_timeout_ms / 1000.0,
        broker_heartbeat_interval=settings.kafka.heartbeat_interval_ms / 1000.0,
        producer_max_batch_size=1,
        producer_linger=0.0,
        consumer_auto_offset_reset="earliest",
        topic_allow_declare=True,
        topic_partitions=samples_partitions or settings.kafka.topic_partitions or None,
        web_enabled=bool(settings.worker.web_port),
        web_port=settings.worker.web_port or 6066,
        web_bind=settings.bind_address,
        broker_credentials=broker_credentials(settings),
        stream_recovery_delay=0.0,
        agent_supervisor=CrashingSupervisor,
    )
    bound_fetch_wait(settings.kafka.fetch_wait_max_ms)
    seek_before_stream_flow()
    if register_agents:
        from phasewise.streams.agents.samples import register

        register(app, settings, samples_partitions=samples_partitions, metrics=metrics, views=views)
    return app




def broker_credentials(settings: Settings) -> Any:
    """Faust's ``broker_credentials`` for the ``kafka_*`` TLS and SASL settings (None: PLAINTEXT).

    Secrets are read from their settings or files here; the objects Faust
    prints (``repr``) name no secret.
    """
    from aiokafka.conn import AbstractTokenProvider
    from faust.auth import OAuthCredentials, SASLCredentials, SSLCredentials

    from phasewise.kit.kafka.security import OidcToken, sasl_password, ssl_context, uses_sasl

    k = settings.kafka
    ctx = ssl_context(k)
    if not uses_sasl(k):
        return None if ctx is None else SSLCredentials(ctx)
    if k.sasl_mechanism == "OAUTHBEARER":
        oidc = OidcToken(k)

        class OidcTokenProvider(AbstractTokenProvider):
            """aiokafka's OAUTHBEARER tokens: the OIDC endpoint asked off the event loop."""

            async def token(self) -> str:
                import asyncio

                return await asyncio.get_running_loop().run_in_executor(None, oidc.token)

        return OAuthCredentials(oauth_cb=OidcTokenProvider(), ssl_context=ctx)
    return SASLCredentials(username=k.sasl_username, password=sasl_password(k), ssl_context=ctx,
                           mechanism=k.sasl_mechanism)
