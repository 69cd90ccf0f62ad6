"""The kit: what every role shares (records, settings, Kafka, cgroups, topics, signing); docs/architecture.md."""
