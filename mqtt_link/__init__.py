"""The MQTT client setup, once, for every program that speaks MQTT (the edge agent, the
coordinator, the HIL tools). It sits above the core: `fedal` itself never imports paho."""

from mqtt_link.client import Client, connect_failure, new_client

__all__ = ["Client", "connect_failure", "new_client"]
