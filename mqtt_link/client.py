"""The MQTT client the agent and the coordinator both connect with (paho-mqtt 2.x).

One place sets up credentials and TLS, and knows why a connection attempt failed: paho's
on_connect_fail callback gets no exception, so on its own a broker certificate that does not
verify (foreign CA, host name not in the certificate, wrong clock) would read only "cannot
connect". `Client` keeps the exception of its last attempt; `connect_failure` words it for the log.
Needs paho-mqtt (the `agent` and `coordinator` extras).
"""

from __future__ import annotations

import socket
import ssl

import paho.mqtt.client as mqtt

from fedal.protocol import BrokerAddress, BrokerSettings


class Client(mqtt.Client):
    """paho's client, remembering the exception that ended its last connection attempt."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_connect_error: BaseException | None = None

    def reconnect(self) -> mqtt.MQTTErrorCode:
        # paho's network thread calls this for the first connection and every retry
        try:
            result = super().reconnect()
        except OSError as exc:
            self.last_connect_error = exc
            raise
        except Exception as exc:  # e.g. a host name no resolver takes (UnicodeError): paho retries only
            self.last_connect_error = exc  # an OSError; anything else ended its thread without a word
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        self.last_connect_error = None
        no_delay(self.socket())
        return result


def no_delay(sock) -> None:
    """Turn Nagle's algorithm off: paho leaves it on, and a task or result written while the
    peer's delayed ACK is pending then waits up to 40 ms; over a broker that is twice per hop,
    about 90 ms per round trip of a 2.7 kB FedAL task on loopback, against 0.4 ms without."""
    # only TCP has Nagle's algorithm: a Unix socket (or none yet) is left as it is
    if sock is not None and getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def new_client(settings: BrokerSettings, address: BrokerAddress, client_id: str, *, clean_session: bool) -> Client:
    """A MQTT 3.1.1 client with the settings' credentials (URL ones as fallback) and verified TLS for mqtts://."""
    client = Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session,
                    protocol=mqtt.MQTTv311)
    username = settings.username or address.username
    if username:
        client.username_pw_set(username, settings.password or address.password)
    if address.tls:
        client.tls_set(ca_certs=str(settings.ca_file) if settings.ca_file else None, cert_reqs=ssl.CERT_REQUIRED)
    client.max_queued_messages_set(0)
    return client


def connect_failure(exc: BaseException | None) -> str:
    """Why a connection attempt failed, in words an operator can act on."""
    if exc is None:
        return "reason unknown"
    if isinstance(exc, ssl.SSLCertVerificationError):
        what = exc.verify_message or exc.reason or str(exc)
        hint = ("the broker's name is not in its certificate (fedal fleet init --server-name)"
                if "hostname" in what.lower() or "ip address mismatch" in what.lower()
                else "the broker's certificate is not signed by broker.ca_file's CA, or the clock is wrong")
        return f"TLS certificate verify failed: {what} ({hint})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc} (is the port a TLS listener?)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the broker's host name: {exc.strerror or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"
