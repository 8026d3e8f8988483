"""The server runtime: drives any strategy's server half over MQTT, hosts the discriminator
and the aggregation, keeps run state on disk, and serves a REST API (FastAPI)."""
