"""Hardware-in-the-loop harness: an emulated broker that injects Wi-Fi-like faults between real
agents (Pis or processes) and a real MQTT broker, and emulated agents to drive a real coordinator
at scale. Same layer as the runtimes: it may import the fedal core, the core never imports it."""
