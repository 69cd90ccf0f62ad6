"""Kafka: the clients, their TLS and SASL, the partitioner (docs/operations.md, docs/deployment.md)."""
