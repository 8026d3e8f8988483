"""A run's complete description, validated: what `fedal simulate` reads from TOML and flags,
and what it writes back into the results so the run can be repeated exactly."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedal.protocol.manifest import MAX_ROUNDS
from fedal.strategies import STRATEGIES, STRATEGY_NAMES, StrategyParams, get_strategy
from fedal.strategies.params import COMMON_PARAMS, MAX_DISCRIMINATOR_PARAMS, discriminator_params
from fedal.strict_fields import NoCoercion
from fedal.validation import describe, one_of

MAX_DATASET_CLASSES = 10  # the most classes of the datasets below (celeba has 2)
DATASET_NAMES = ("mnist1d", "digits", "mnist", "fashion-mnist", "cifar10", "svhn", "cinic10", "celeba")
PARTITION_NAMES = ("dirichlet-client", "dirichlet-class", "iid", "pow", "covariate-shift", "covariate-shift-pow",
                   "covariate-shift-pca", "covariate-shift-pca-pow", "identity")
TRAIN_SPLIT_NAMES = ("train", "train+valid")
DEFAULT_MODELS = {
    "mnist1d": ["mlp", "cnn1d", "cnn1d_wide"],
    "digits": ["mlp", "lenet5", "smallcnn"],
    "mnist": ["lenet5", "smallcnn", "mlp"],
    "fashion-mnist": ["lenet5", "smallcnn", "mlp"],
    "cifar10": ["resnet18", "wrn16_1", "smallcnn"],
    "svhn": ["wrn10_1", "wrn16_1", "smallcnn"],
    "cinic10": ["resnet18", "wrn16_1", "smallcnn"],  # the paper's ResNets for CIFAR-10 and CINIC-10
    "celeba": ["smallcnn", "lenet5", "wrn10_1"],  # the paper (as LEAF) trains a small CNN on CelebA
}
# Strategies that average parameters need one architecture for every client: without a models
# choice they get the first of the dataset's defaults.
DEFAULT_SINGLE_MODEL = {dataset: models[0] for dataset, models in DEFAULT_MODELS.items()}
# Strategies that need one feature width (FedProto) without a models choice: the defaults of the
# first default's width (mnist1d: mlp and cnn1d_wide, 100 features), else that model alone.
SAME_WIDTH_MODELS = {"mnist1d": ["mlp", "cnn1d_wide"]}
# the --dp-* flags and the [privacy] keys they set
PRIVACY_FLAGS = {"dp_noise_multiplier": "noise_multiplier", "dp_max_grad_norm": "max_grad_norm", "dp_delta": "delta",
                 "dp_epsilon_budget": "epsilon_budget", "dp_target_epsilon": "target_epsilon"}


class ConfigError(ValueError):
    """A config that cannot describe a run; the message says what to change."""


RAY_RESOURCES = ("num_cpus", "num_gpus", "memory")


def parse_resources(text: str | dict | None) -> dict[str, float]:
    """'num_cpus=1,num_gpus=0.25' (or a dict) -> {'num_cpus': 1.0, 'num_gpus': 0.25}, per actor;
    num_cpus is 1 unless given, as Ray gives an actor that asks for other resources one CPU too
    (what the cluster check must count)."""
    if text is None or text == "":
        return {"num_cpus": 1.0}
    pairs = text.items() if isinstance(text, dict) else (p.split("=", 1) for p in text.split(",") if p.strip())
    out: dict[str, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ConfigError(f"client_resources: expected name=value pairs such as 'num_cpus=1,num_gpus=0.25', got {text!r}")
        name, value = str(pair[0]).strip(), pair[1]
        if not name:
            raise ConfigError(f"client_resources: a resource without a name in {text!r}")
        if name in out:
            raise ConfigError(f"client_resources: {name} is given twice in {text!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"client_resources: {name} must be a number, got {value!r}") from None
        if not math.isfinite(number) or number < 0:
            raise ConfigError(f"client_resources: {name} must be a finite number, not negative, got {value!r}")
        if name in ("CPU", "GPU"):  # Ray's names of them in a cluster, not what an actor asks with
            raise ConfigError(f"client_resources: ask for {name} as num_{name.lower()}s (Ray's keyword for it)")
        if name == "object_store_memory":
            raise ConfigError("client_resources: object_store_memory is the cluster's, not an actor's to ask for; "
                              f"valid: {', '.join(RAY_RESOURCES)} or a custom resource")
        if abs(number * 10_000 - round(number * 10_000)) > 1e-6:
            raise ConfigError(f"client_resources: {name}={value} is finer than Ray takes (0.0001 at most)")
        out[name] = number
    return out if "num_cpus" in out else {"num_cpus": 1.0, **out}


def resource_name_notes(text: str | dict | None) -> list[str]:
    """A custom resource named like one of Ray's own (`num_cpu`): most likely a typo, said at start
    (a custom resource is legitimate, so not refused; the cluster check names what it lacks)."""
    notes = []
    for name in parse_resources(text):
        near = next((real for real in RAY_RESOURCES if _one_slip(name, real)), None)
        if near is not None:
            notes.append(f"client_resources: {name!r} is taken as a custom Ray resource; did you mean {near!r}?")
    return notes


def _one_slip(typed: str, meant: str) -> bool:
    """A character left out or added, or two neighbours swapped (not a substitution: `num_tpus`
    is a resource of its own, not `num_gpus` mistyped)."""
    short, long = sorted((typed, meant), key=len)
    if len(long) - len(short) == 1:
        return any(long[:i] + long[i + 1:] == short for i in range(len(long)))
    return len(typed) == len(meant) and typed != meant and any(
        typed[:i] + typed[i + 1] + typed[i] + typed[i + 2:] == meant for i in range(len(typed) - 1))


def lift_privacy(data: Any) -> Any:
    """A run config's `[privacy]` table is its strategy parameters' `privacy` (it travels with
    them to every device): the same spelling in a simulate TOML, a coordinator's `[run]` table and
    an API run spec."""
    if not isinstance(data, dict) or "privacy" not in data:
        return data
    data = dict(data)
    privacy = data.pop("privacy")
    if privacy is None:
        return data
    params = data.get("strategy_params")
    if params is None:
        params = {}
    elif hasattr(params, "model_dump"):  # a StrategyParams built in code: its own values, not defaults
        params = params.model_dump(exclude_unset=True)
    elif isinstance(params, dict):
        params = dict(params)
    else:
        raise ValueError("strategy_params must be a table of strategy parameters")
    if params.get("privacy") is not None:
        raise ValueError("privacy is given twice ([privacy] and strategy_params.privacy): give it once")
    params["privacy"] = privacy
    data["strategy_params"] = params
    return data


MAX_CLIENTS = 10_000  # a run's clients (a coordinator's enrolled ids too)


class RunConfig(NoCoercion):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _privacy_table(cls, data: Any) -> Any:
        return lift_privacy(data)

    strategy: str = "fedal"
    dataset: str = "mnist1d"
    data_dir: str | None = Field(None, description="folder with dataset files (file-backed datasets only)")
    clients: int = Field(10, ge=2, le=MAX_CLIENTS)
    partition: str = "dirichlet-client"
    alpha: float = Field(1.0, gt=0, le=1e9, allow_inf_nan=False,  # (past 1e9 a Dirichlet draw is uniform to 9 digits;
                         description="Dirichlet concentration (per client or per class)")  # near 1e308 it overflows)
    shift_c: float = Field(5.0, gt=0, allow_inf_nan=False,
                           description="covariate-shift partitions: C = delta^T Sigma^-1 delta (paper: 2, 5, 10)")
    train_splits: str = Field("train", description="cinic10, celeba: train, or train+valid to add the validation split")
    celeba_attribute: str | None = Field(None, description="celeba: the binary attribute to predict (default Smiling)")
    mnist1d_samples: int | None = Field(None, ge=10, le=10_000_000,
                                              description="mnist1d: samples generated, train and test together "
                                              "(default 12000)")
    samples_per_client: int | None = Field(None, ge=1, description="None: an equal share of what is left")
    public_size: int = Field(1000, ge=1)
    local_test_fraction: float = Field(0.0, ge=0.0, lt=1.0,
                                       description="share of each client's data held out as its local test split")
    models: list[str] | None = Field(None, min_length=1, description="assigned round-robin; default per dataset "
                                       "(its first model alone for strategies that average parameters)")
    rounds: int = Field(20, ge=1, le=MAX_ROUNDS)
    seed: int = Field(0, ge=0, lt=2**63, description="0 <= seed < 2^63 (torch's seeds are 64-bit)")
    eval_every: int = Field(1, ge=1, description="evaluate every k rounds (and always after the last)")
    threads: int = Field(1, ge=1, le=1024, description="torch intra-op threads (1 is fastest for tiny models)")
    # faults of the in-process transport (simulation only; a deployment has real ones)
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="simulation: each client misses each phase with this probability")
    stragglers: float = Field(0.0, ge=0.0, le=1.0, description="simulation: this fraction of clients answers after the deadline")
    straggle_every: int = Field(2, ge=1, description="simulation: stragglers are late every k-th phase")
    vectorize: bool | None = Field(None, description="simulation: clients of one architecture run as one stacked "
                                   "model where the strategy allows (fedal/strategies/stacked.py); unset: on in a "
                                   "simulation (false: the per-client reference path); a deployment refuses true")
    backend: Literal["inprocess", "ray"] = Field("inprocess", description="simulation: where client halves run: this "
                                                 "process, or Ray actors (docs/simulation.md)")
    ray_address: str | None = Field(None, description="ray backend: a cluster to join (auto, head:port, ray://host:port); "
                                    "none starts a local instance")
    ray_actors: int | None = Field(None, ge=1, description="ray backend: actors hosting the clients (default: as many "
                                   "as the cluster's resources hold, each asking client_resources)")
    client_resources: str | None = Field(None, description="ray backend: resources of each actor, e.g. "
                                         "'num_cpus=1,num_gpus=0.25' (default num_cpus=1)")
    strategy_params: StrategyParams = Field(default_factory=StrategyParams)
    # a results file's config: the public set that run had (data.public_hash), read with the config
    _ran_on_public_hash: str | None = PrivateAttr(None)

    @property
    def ran_on_public_hash(self) -> str | None:
        """The public_hash of the run whose results file this config was read from, if any."""
        return self._ran_on_public_hash

    @field_validator("client_resources")
    @classmethod
    def _client_resources(cls, v: str | None) -> str | None:
        try:
            parse_resources(v)
        except ConfigError as exc:  # pydantic names the field itself
            raise ValueError(str(exc).removeprefix("client_resources: ")) from None
        return v

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        get_strategy(v)
        return v

    @field_validator("dataset", "partition", "train_splits")
    @classmethod
    def _one_of_names(cls, v: str, info: ValidationInfo) -> str:
        names = {"dataset": DATASET_NAMES, "partition": PARTITION_NAMES, "train_splits": TRAIN_SPLIT_NAMES}
        return one_of(v, names[info.field_name or ""], info.field_name or "value")

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        from fedal.data.federated import check_dataset_options
        from fedal.models import MODEL_NAMES

        models = self.resolved_models()
        unknown = [m for m in models if m not in MODEL_NAMES]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; valid choices: {', '.join(MODEL_NAMES)}")
        spec = get_strategy(self.strategy)
        ray_only = [f"{name} ({flag})" for name, flag in (("ray_address", "--ray-address"), ("ray_actors", "--ray-actors"),
                                                        ("client_resources", "--client-resources"))
                    if getattr(self, name) is not None]
        if ray_only and self.backend != "ray":  # else a cluster address or placement asked for is silently not used
            raise ValueError(f"{', '.join(ray_only)} apply to the ray backend only: add --backend ray (backend = \"ray\")")
        hidden = list(self.strategy_params.disc_hidden)
        if discriminator_params(MAX_DATASET_CLASSES, hidden, self.clients) > MAX_DISCRIMINATOR_PARAMS:
            raise ValueError(f"strategy_params.disc_hidden {hidden}: the discriminator ({self.clients} clients) would "
                             f"hold {discriminator_params(MAX_DATASET_CLASSES, hidden, self.clients):,} parameters, more "
                             f"than {MAX_DISCRIMINATOR_PARAMS:,}; use smaller widths (default [32, 256])")
        if self.strategy_params.privacy is not None and self.strategy_params.privacy.noise_multiplier == 0:
            raise ValueError("privacy.noise_multiplier 0 adds no noise: epsilon would be unbounded; give a noise "
                             "multiplier > 0 or a target_epsilon (clipping alone is no differential privacy)")
        privacy = self.strategy_params.privacy
        if privacy is not None and privacy.target_epsilon is not None and privacy.planned_rounds is not None \
                and privacy.planned_rounds < self.rounds \
                and (privacy.epsilon_budget is None or privacy.epsilon_budget > privacy.target_epsilon):
            raise ValueError(f"privacy.planned_rounds {privacy.planned_rounds} is fewer than the run's {self.rounds} "
                             f"rounds: the clients would end above target_epsilon {privacy.target_epsilon:g}. Leave "
                             "planned_rounds out (the run sets it), or add an epsilon_budget of at most the target "
                             "(the clients then stop training on their private data there)")
        if self.strategy_params.privacy is not None and "privacy" not in spec.params:
            private = ", ".join(n for n, s in STRATEGIES.items() if "privacy" in s.params)
            raise ValueError(f"strategy {self.strategy!r} has no differentially private training yet; privacy "
                             f"settings apply to: {private}")
        foreign = self.strategy_params.foreign(spec.params, spec.preset)
        if foreign:
            raise ValueError(f"strategy_params {', '.join(foreign)} do not apply to strategy {self.strategy!r}; its "
                             f"parameters: {', '.join(sorted(set(COMMON_PARAMS) | set(spec.params)))}")
        rows = min(self.strategy_params.public_batch_size, self.public_size)
        if spec.uses_public_set and rows < spec.min_public_rows:
            raise ValueError(f"strategy {self.strategy!r} needs at least {spec.min_public_rows} public rows per transfer "
                             f"iteration (the smaller of public_size and public_batch_size), got {rows}")
        if spec.homogeneous_models and len(set(models)) > 1:
            raise ValueError(f"strategy {self.strategy!r} averages parameters and needs one model for all clients, got {models}")
        if self.dataset not in ("mnist1d", "digits") and not self.data_dir:
            raise ValueError(f"dataset {self.dataset!r} is read from files: set data_dir")
        if self.partition == "identity" and self.dataset != "celeba":
            raise ValueError(f"partition 'identity' deals celebrity identities to clients and needs dataset 'celeba', "
                             f"not {self.dataset!r}")
        check_dataset_options(self.dataset, self.train_splits, self.celeba_attribute, self.mnist1d_samples)
        return self

    def dataset_options(self) -> dict[str, Any]:
        """The loader's options of this run's dataset, for load_dataset, build_federated and public_set."""
        return {"train_splits": self.train_splits, "celeba_attribute": self.celeba_attribute,
                "mnist1d_samples": self.mnist1d_samples}

    def resolved_models(self) -> list[str]:
        if self.models:
            return list(self.models)
        if get_strategy(self.strategy).same_feature_dim:  # FedProto: the defaults of one feature width
            return list(SAME_WIDTH_MODELS.get(self.dataset, [DEFAULT_SINGLE_MODEL[self.dataset]]))
        if get_strategy(self.strategy).homogeneous_models:
            return [DEFAULT_SINGLE_MODEL[self.dataset]]
        return list(DEFAULT_MODELS[self.dataset])

    def default_model_note(self) -> str | None:
        """A line telling the user which models a strategy got in place of the dataset's defaults
        (parameter averaging: one model; prototypes: one feature width); None when the models were
        given or the defaults apply."""
        if self.models:
            return None
        spec = get_strategy(self.strategy)
        if spec.same_feature_dim and self.resolved_models() != list(DEFAULT_MODELS[self.dataset]):
            return (f"{self.strategy} needs one feature width for all clients: using {', '.join(self.resolved_models())} "
                    f"(--models or `models` chooses others)")
        if not spec.homogeneous_models:
            return None
        return (f"{self.strategy} needs one model for all clients: using {DEFAULT_SINGLE_MODEL[self.dataset]} "
                f"(the {self.dataset} default; --models or `models` chooses another)")

    def notes(self) -> list[str]:
        """Lines telling the user what the run chose or leaves unused where the config is silent or
        says more than applies (shown at start; never a refusal: older configs keep working)."""
        notes = [note] if (note := self.default_model_note()) else []
        if self.dataset == "digits" and self.data_dir:  # else a user's files are believed read, and are not
            notes.append(f"data_dir {self.data_dir} is not read: dataset 'digits' comes with scikit-learn")
        if self.dataset == "mnist1d" and self.data_dir:  # it makes the folder and writes there: say so
            notes.append(f"data_dir {self.data_dir} keeps the generated MNIST-1D cache: dataset 'mnist1d' is "
                         "generated, not read from files")
        if self.backend == "ray":
            notes += resource_name_notes(self.client_resources)
        return notes

    @property
    def vectorized(self) -> bool:
        """Whether a simulation of this config stacks its clients (vectorize unset: yes)."""
        return self.vectorize is not False

    def resolved(self) -> RunConfig:
        """The same run with every default made explicit."""
        spec = get_strategy(self.strategy)
        params = self.strategy_params.resolve(spec.preset)
        if params.rows_seed is None and "rows_seed" in spec.params:  # the public rows follow the run's seed
            params = params.model_copy(update={"rows_seed": self.seed})
        privacy = params.privacy
        if privacy is not None and privacy.target_epsilon is not None and privacy.planned_rounds is None:
            params = params.model_copy(update={"privacy": privacy.model_copy(update={"planned_rounds": self.rounds})})
        update: dict[str, Any] = {"strategy_params": params, "models": self.resolved_models()}
        if self.dataset == "celeba" and self.celeba_attribute is None:
            from fedal.data.federated import DEFAULT_CELEBA_ATTRIBUTE

            update["celeba_attribute"] = DEFAULT_CELEBA_ATTRIBUTE
        if self.dataset == "mnist1d" and self.mnist1d_samples is None:  # the size, written with the results
            from fedal.data.embedded import MNIST1D_SAMPLES

            update["mnist1d_samples"] = MNIST1D_SAMPLES
        return self.model_copy(update=update)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """A TOML file (top-level keys plus a [strategy_params] table) or a results JSON (its
    saved `config`, to repeat a run), then overrides on top."""
    data: dict[str, Any] = {}
    ran_on: str | None = None
    if path is not None:
        data, from_json, ran_on = _read_config_file(Path(path))
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        changed = {k for k in DERIVED_FROM if k in given and given[k] != data.get(k)}
        # a results file's resolved config spells out every derived value; a TOML's values were
        # written by hand, so only a new strategy takes its own preset over them (examples/demo.toml
        # writes FedAL's out: `--strategy fedmd` ran FedAL's settings labelled fedmd)
        if changed if from_json else "strategy" in changed:
            data = _without_derived(data)
        if "dataset" in changed:  # the file's dataset's own options do not carry over to another
            from fedal.data.federated import VALID_SPLIT_DATASETS

            only = {"mnist1d_samples": ("mnist1d",), "celeba_attribute": ("celeba",),
                    "train_splits": VALID_SPLIT_DATASETS}
            for key, datasets in only.items():
                if key not in given and given["dataset"] not in datasets:
                    data.pop(key, None)
    if (overrides or {}).get("backend") not in (None, "ray"):  # where a saved Ray run computed: not asked now
        for key in RAY_KEYS:
            if (overrides or {}).get(key) is None:
                data.pop(key, None)
    try:  # (before the flags below add to it)
        data = lift_privacy(data)
    except ValueError as exc:
        raise ConfigError(f"invalid config: {exc}") from None
    params_given = data.get("strategy_params")
    if params_given is not None and not isinstance(params_given, dict):  # the flags below would write into it
        raise ConfigError(f"invalid config: strategy_params must be a table of strategy parameters, got "
                          f"{type(params_given).__name__}")
    privacy_given = (params_given or {}).get("privacy")
    if privacy_given is not None and not isinstance(privacy_given, dict):  # else a --dp-* flag replaced it unread
        raise ConfigError(f"invalid config: strategy_params.privacy ([privacy]) must be a table, got "
                          f"{type(privacy_given).__name__}")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key in PRIVACY_FLAGS:
            params = data.setdefault("strategy_params", {})
            if not isinstance(params.get("privacy"), dict):
                params["privacy"] = {}
            name = PRIVACY_FLAGS[key]
            rival = {"noise_multiplier": "target_epsilon", "target_epsilon": "noise_multiplier"}.get(name)
            flagged = {PRIVACY_FLAGS[k] for k, v in (overrides or {}).items() if k in PRIVACY_FLAGS and v is not None}
            if rival is not None and rival not in flagged:  # a flag choosing how the noise is set replaces the
                params["privacy"].pop(rival, None)  # config's choice (both as flags: refused, "not both")
                params["privacy"].pop("planned_rounds", None)  # the run sets it again for a target
            params["privacy"][name] = value
        elif key in StrategyParams.model_fields:
            data.setdefault("strategy_params", {})[key] = value
        else:
            data[key] = value
    try:
        config = RunConfig(**data)
    except ValidationError as exc:
        message = format_validation_error(exc)
        if "strategy_params.privacy" in message and any(
                k in PRIVACY_FLAGS and v is not None for k, v in (overrides or {}).items()):
            # the privacy settings' own names, said in the flags that were given
            message += " (as flags: " + ", ".join(
                f"--{flag.replace('_', '-')} sets {key}" for flag, key in PRIVACY_FLAGS.items()) + ")"
        raise ConfigError(message) from None
    config._ran_on_public_hash = ran_on
    return config


DERIVED_FIELDS = ("models", "mnist1d_samples", "celeba_attribute")
RAY_KEYS = ("ray_address", "ray_actors", "client_resources")  # the ray backend's alone
DERIVED_FROM = ("strategy", "dataset", "seed", "rounds")  # what `resolved()` derives them from


def _without_derived(data: dict[str, Any]) -> dict[str, Any]:
    """A saved (resolved) config less what `resolved()` derives from its strategy, dataset, seed
    and rounds (a strategy's preset parameters, the public rows' seed, the dataset's default
    models and sizes): a flag that changes one of those derives them anew, as for a fresh run,
    instead of running the new strategy with the old one's settings. Values that differ from
    what was derived were chosen, and stay. Only where a flag changes one of those (unchanged,
    the saved run is repeated exactly as saved)."""
    base = {k: v for k, v in data.items() if k not in DERIVED_FIELDS and k != "strategy_params"}
    try:
        derived = RunConfig(**base).resolved()
    except (ValidationError, ValueError, TypeError, KeyError):
        return data  # the full config's own validation says what is wrong
    out = {k: v for k, v in data.items() if not (k in DERIVED_FIELDS and v == getattr(derived, k))}
    params = data.get("strategy_params")
    if isinstance(params, dict):
        defaults = derived.strategy_params.model_dump(mode="json")
        kept = {k: v for k, v in params.items() if k == "privacy" or k not in defaults or v != defaults[k]}
        privacy = kept.get("privacy")
        if isinstance(privacy, dict) and privacy.get("planned_rounds") == data.get("rounds"):
            kept["privacy"] = {k: v for k, v in privacy.items() if k != "planned_rounds"}
        out["strategy_params"] = kept
    return out


def _read_config_file(path: Path) -> tuple[dict[str, Any], bool, str | None]:
    """(its settings, whether it is JSON, the public_hash a results file ran on), from one read:
    a pipe (`--config <(...)`) reads once."""
    ran_on: Any = None
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    from_json = _is_json(path, raw)
    if from_json:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
        except RecursionError:  # nested past what the parser takes: no config is
            raise ConfigError(f"config file {path} is not valid JSON: nested too deep") from None
        ran = data.get("data") if isinstance(data, dict) else None
        ran_on = ran.get("public_hash") if isinstance(ran, dict) else None
        data = data.get("config", data) if isinstance(data, dict) else data
    else:
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} is not valid TOML: nested too deep") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of settings")
    return data, from_json, ran_on if from_json and isinstance(ran_on, str) else None


def _is_json(path: Path, raw: bytes) -> bool:
    """A results JSON (or a config in JSON) by its name or, whatever its name (`--out run1`), by
    its first character: a TOML file never starts with `{`."""
    return path.suffix == ".json" or raw.lstrip()[:1] == b"{"


def format_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """model: the one validated (default RunConfig), where a mistyped key finds its suggestion."""
    return "invalid config: " + describe(exc, model or RunConfig)  # a whole-config check names its fields itself


__all__ = ["ConfigError", "RunConfig", "load_config", "DATASET_NAMES", "DEFAULT_MODELS", "DEFAULT_SINGLE_MODEL",
           "PARTITION_NAMES", "STRATEGY_NAMES", "TRAIN_SPLIT_NAMES"]
