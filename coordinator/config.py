"""Coordinator configuration: a TOML file with FEDAL_COORD_* environment overrides."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fedal.engine.health import HealthLimits
from fedal.engine.settings import PhaseSettings
from fedal.hosts import check_host_pattern
from fedal.model_names import MAX_NUM_CLASSES
from fedal.protocol import MAX_MESSAGE_BYTES, BrokerSettings, topics
from fedal.settings import load_settings
from fedal.sim.config import MAX_CLIENTS, RunConfig
from fedal.strategies.params import MAX_DISCRIMINATOR_PARAMS, discriminator_params
from fedal.strict_fields import NoCoercion


class CoordinatorBrokerSettings(BrokerSettings):
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, ge=4096, description="refuse chunked results larger than this")
    reassembly_bytes_per_client: int | None = Field(
        None, ge=4096, description="declared sizes of one client's unfinished chunked results, together; "
        "none: max_message_bytes (its newer message drops its older unfinished ones)")
    reassembly_bytes_total: int | None = Field(
        None, ge=4096, description="the same over all clients; none: 4 x max_message_bytes (beyond: refused)")


class ApiSettings(NoCoercion):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535, description="at least 1: the manifest tells agents this port")
    public_base_url: str | None = Field(None, description="URL agents use to reach this API; default http://host:port")
    token: str | None = Field(None, description="bearer token for write endpoints (pause, resume, stop); none: writes refused")
    read_requires_token: bool = Field(False, description="require the token for reads too (the public set stays open to agents)")
    max_body_bytes: int = Field(1024 * 1024, ge=1024, description="larger request bodies are refused (413) before they are read")
    max_event_streams: int = Field(100, ge=1, le=100_000, description="live event streams (/api/v1/events) open at "
                                   "once; more are refused (503: the dashboard then polls)")
    client_metrics: bool = Field(True, description="per-client series in /metrics (about 20 per client: a run of "
                                 "thousands of clients makes a scrape of megabytes); false: the run-wide ones only")
    allowed_hosts: list[str] | None = Field(
        None, description="more names the Host header may carry, `*.example.org` for its subdomains, `*` for any; "
        "besides the API's own (loopback names, its host, public_base_url's, the machine's names) and IP addresses: "
        "other names are refused (400), a guard against DNS rebinding")

    @model_validator(mode="after")
    def _reads_can_pass(self) -> ApiSettings:
        if self.read_requires_token and self.token is None:  # no read could pass: the dashboard, /metrics refused
            raise ValueError("read_requires_token needs a token (api.token): without one every read would be refused")
        return self

    @field_validator("host")
    @classmethod
    def _listenable(cls, v: str) -> str:
        if v.startswith("[") and v.endswith("]"):  # an IPv6 address as a URL writes it: bound without them
            v = v[1:-1]
        if v:  # empty: every interface, as 0.0.0.0 and ::
            try:
                if "*" in check_host_pattern(v):
                    raise ValueError(v)
            except ValueError:
                raise ValueError(f"{v!r} is not a host name or address to listen on (the port is `port`; "
                                 "0.0.0.0 or :: listens on every interface)") from None
        return v

    @field_validator("public_base_url")
    @classmethod
    def _reachable_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 - a port that is not a number raises here
            check_host_pattern(parts.hostname or "")
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or "*" in (parts.hostname or "*"):
            raise ValueError(f"{v!r} is not an http:// or https:// URL with a host name or address "
                             "(as agents fetch the public set from it)")
        if parts.query or parts.fragment or "@" in parts.netloc:
            raise ValueError(f"{v!r}: give the API's base URL without a query, a fragment or credentials "
                             "(the public set's path is appended to it, and the URL is announced to every agent)")
        if not parts.netloc.isascii():
            raise ValueError(f"{v!r}: give the host in its ASCII (punycode, xn--...) form, as agents send it")
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [check_host_pattern(p) for p in v]

    @field_validator("token")
    @classmethod
    def _usable_token(cls, v: str | None) -> str | None:
        if v is not None and (not v or v != v.strip()):
            raise ValueError("an empty token, or one with spaces at its ends, can never be presented: set a token "
                             "without them, or leave `token` out (writes are then refused)")
        if v is not None and not (v.isascii() and v.isprintable()):
            # a browser sends a header's characters as latin-1 or not at all: such a token was always "wrong"
            raise ValueError("the token must be printable ASCII (letters, digits, punctuation): a browser cannot send "
                             "other characters in a header, so the dashboard could never present it")
        return v


class HealthSettings(NoCoercion):
    """When a device's reported health is flagged (API `health_flags`, /metrics, the dashboard);
    throttling and under-voltage reported by the Pi's firmware are flagged whatever these say."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_cpu_temp_c: float = Field(80.0, description="flag `hot` at or above this CPU temperature "
                                  "(a Pi 4/5 starts to throttle at 80-85 C)")
    min_memory_available_mb: float = Field(100.0, ge=0, description="flag `low_memory` below this much available memory (MiB)")
    min_disk_free_mb: float = Field(500.0, ge=0, description="flag `low_disk` below this much free space (MiB) "
                                    "on the filesystem of the agent's workspace")

    def limits(self) -> HealthLimits:
        return HealthLimits(max_cpu_temp_c=self.max_cpu_temp_c,
                            min_memory_available_bytes=int(self.min_memory_available_mb * 2**20),
                            min_disk_free_bytes=int(self.min_disk_free_mb * 2**20))


def _check_run_id(v: str) -> str:
    return topics.check_id(v, "run id")


def _check_no_simulated_faults(v: RunConfig) -> RunConfig:
    if v.dropout or v.stragglers:
        raise ValueError("dropout and stragglers are faults of the simulation; a deployment has real ones")
    if v.vectorize:
        raise ValueError("vectorize stacks simulated clients in one process; in a deployment each client is a device")
    if v.backend != "inprocess":
        raise ValueError(f"backend {v.backend!r} is where a simulation runs its clients; in a deployment each client "
                         "is a device")
    return v




def _check_server_sizes(run: RunConfig, num_classes: int, client_ids: list[str] | None) -> None:
    """Refuse a run whose server half would be too large to allocate, before anything is built."""
    hidden = list(run.strategy_params.disc_hidden)  # each width 1..65536 (StrategyParams)
    clients = max(2, len(client_ids or []))
    params = discriminator_params(num_classes, hidden, clients)
    if params > MAX_DISCRIMINATOR_PARAMS:
        raise ValueError(f"run.strategy_params.disc_hidden {hidden}: the discriminator ({num_classes} classes, "
                         f"{clients} clients) would hold {params:,} parameters, more than the "
                         f"{MAX_DISCRIMINATOR_PARAMS:,} a coordinator allocates; use smaller widths (default [32, 256])")


def _check_client_ids(v: list[str] | None) -> list[str] | None:
    if v is None:
        return v
    if len(v) < 2 or len(set(v)) != len(v):
        raise ValueError("client_ids needs at least two unique ids")
    if len(v) > MAX_CLIENTS:  # each one's state is listed by every open read of the run
        raise ValueError(f"client_ids holds {len(v)} ids, more than the {MAX_CLIENTS} a run may enrol")
    return [topics.check_id(c, "client id") for c in v]


class RunSpec(NoCoercion):
    """One run as `POST /api/v1/runs` takes it (and as the store keeps it to restart it)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    run_id: str
    run: RunConfig = Field(default_factory=RunConfig, description="strategy, rounds, seed and the rest of the run")
    client_ids: list[str] = Field(description="enrolled clients, in enrolment order (the discriminator's classes)")
    num_classes: int = Field(10, ge=2, le=MAX_NUM_CLASSES)
    public_file: Path | None = Field(None, description="public set .npz on the coordinator; default: derived from run.dataset")
    phases: PhaseSettings | None = Field(None, description="deadlines and quorum; default: the coordinator's")

    _run_id = field_validator("run_id")(_check_run_id)
    _clients = field_validator("client_ids")(_check_client_ids)
    _run = field_validator("run")(_check_no_simulated_faults)

    @model_validator(mode="after")
    def _sizes(self) -> RunSpec:
        _check_server_sizes(self.run, self.num_classes, self.client_ids)
        return self


class CoordinatorConfig(BaseSettings, NoCoercion):
    model_config = SettingsConfigDict(env_prefix="FEDAL_COORD_", env_nested_delimiter="__", extra="forbid",
                                      allow_inf_nan=False)

    run_id: str = "run"
    run: RunConfig = Field(default_factory=RunConfig, description="strategy, rounds, seed and the rest of the run")
    client_ids: list[str] | None = Field(None, description="enrolled clients, in enrolment order (the discriminator's "
                                         "classes); none: start no run, wait for POST /api/v1/runs")
    num_classes: int = Field(10, ge=2, le=MAX_NUM_CLASSES)
    public_file: Path | None = Field(None, description=".npz with x: the public set served to agents")
    state_dir: Path = Path("coordinator-state")
    store_url: str | None = Field(None, description="SQLAlchemy URL of the run store; default sqlite:///<state_dir>/coordinator.db")
    results_file: Path | None = Field(None, description="results JSON; default state_dir/results.json")
    broker: CoordinatorBrokerSettings = Field(default_factory=CoordinatorBrokerSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    phases: PhaseSettings = Field(default_factory=PhaseSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    device: str = Field("auto", description="auto: CUDA when available, else CPU; or a torch device: cpu, cuda, "
                        "cuda:N (a GPU torch sees), mps, ...")
    threads: int | None = Field(None, ge=1, le=1024,
                                description="torch intra-op threads for server-side compute on the CPU; none: torch's default")
    exit_on_finish: bool = False

    _run_id = field_validator("run_id")(_check_run_id)
    _clients = field_validator("client_ids")(_check_client_ids)
    _run = field_validator("run")(_check_no_simulated_faults)

    @field_validator("device")
    @classmethod
    def _torch_device(cls, v: str) -> str:
        if v != "auto":
            import torch

            try:
                torch.device(v)
            except RuntimeError:
                raise ValueError(f"{v!r} is not a torch device: auto, cpu, cuda, cuda:N, mps, ...") from None
        return v

    @model_validator(mode="after")
    def _sizes(self) -> CoordinatorConfig:
        _check_server_sizes(self.run, self.num_classes, self.client_ids)
        return self

    def initial_run(self) -> RunSpec | None:
        """The run this config starts by itself, if it names clients."""
        if self.client_ids is None:
            return None
        return RunSpec(run_id=self.run_id, run=self.run, client_ids=self.client_ids, num_classes=self.num_classes,
                       public_file=self.public_file, phases=self.phases)

    def for_run(self, spec: RunSpec, results_file: Path | None = None) -> CoordinatorConfig:
        """This coordinator's settings with `spec` as its run: what one Run runs with."""
        return self.model_copy(update={
            "run_id": spec.run_id, "run": spec.run, "client_ids": spec.client_ids, "num_classes": spec.num_classes,
            "public_file": spec.public_file, "phases": spec.phases or self.phases,
            "results_file": results_file or self.results_file,
        })


def load_coordinator_config(path: str | Path | None = None, **overrides) -> CoordinatorConfig:
    return load_settings(CoordinatorConfig, path, **overrides)
