"""Fleet provisioning: per-device credentials, the broker's password and ACL files, a TLS CA.

It sits beside `firmware_scripts/` at the top of the layers: it writes configs for both
runtimes (validated with the agent's own config model and the shared `[broker]` table) and
files for Mosquitto, and needs neither torch nor the network. `fedal fleet` is its command.
"""
