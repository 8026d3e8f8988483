"""Every strategy knob, named and documented (ALGORITHMS.md section 1).

Fields left unset (None) take the selected strategy's preset (e.g. FedMD: tau = 1, no
adversarial and no less-forgetting term); `resolve()` returns the complete, explicit set that
is saved with a run's results so the run can be repeated exactly.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from fedal.model_names import MODEL_NAMES
from fedal.privacy.settings import PrivacyParams
from fedal.protocol.validation import DEFAULT_MAX_ABS_VALUE
from fedal.protocol.wire_dtype import FLOAT16_MAX
from fedal.strict_fields import NoCoercion
from fedal.validation import one_of

# what every strategy uses; each strategy module names its own further knobs (`PARAMS`)
# bounds far past any useful value, so that a typo (1e20 epochs, lr 1e300) is refused when the config is read
# instead of running for ever or failing mid-run (an integer too large for the wire's MessagePack)
MAX_STEPS, MAX_EPOCHS, MAX_BATCH, MAX_LR = 1_000_000, 100_000, 1_000_000, 1e3
COMMON_PARAMS = ("tau", "optimizer", "lr", "momentum", "batch_size", "max_abs_value")
# fields with a default of their own that a strategy's preset may still set (FedHKD: the paper's batch 64)
PRESET_OVER_DEFAULT = ("batch_size",)
# the knowledge-transfer stage shared by FedAL, FedMD(-LF) and FedDF(-AL)
DISTILLATION_PARAMS = ("public_batch_size", "lambda_kd", "lambda_adv", "lambda_lf_loc", "lambda_lf_glo", "temperature_kd",
                       "temperature_lf", "temperature_disc", "kd_target", "disc_hidden", "disc_lr", "wire_dtype",
                       "wire_int8_scale", "rows_seed")


class StrategyParams(NoCoercion):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tau: int | None = Field(None, ge=1, le=MAX_STEPS, description="local steps and transfer iterations per round")
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0, le=MAX_LR, description="client learning rate (paper: Adam 1e-3)")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (SGD only)")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="local minibatch size")
    local_epochs: int | None = Field(
        None, ge=0, le=MAX_EPOCHS,
        description="local, fedavg, fedakd, fedhkd: passes over the private data per local training (0: tau steps)"
    )
    public_batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="public minibatch size B per transfer iteration")
    rows_seed: int | None = Field(
        None, ge=0, lt=2**63, description="key of the public rows each transfer iteration uses, computed by both ends "
        "(docs/protocol.md); unset: the run's seed"
    )

    lambda_kd: float | None = Field(None, ge=0, description="weight of the KD term KL(target || p_n)")
    lambda_adv: float | None = Field(None, ge=0, description="weight of the adversarial term U_n")
    lambda_lf_loc: float | None = Field(None, ge=0, description="less-forgetting weight, local training")
    lambda_lf_glo: float | None = Field(None, ge=0, description="less-forgetting weight, knowledge transfer")
    temperature_kd: float = Field(1.0, gt=0, description="E in the KD KL term")
    temperature_lf: float = Field(1.0, gt=0, description="E in both less-forgetting KL terms")
    temperature_disc: float = Field(2.0, gt=0, description="E_d: softmax temperature of the discriminator input")
    kd_target: Literal["leave_one_out", "all"] = Field(
        "leave_one_out", description="eq. 5 leave-one-out average, or Algorithm 1's average over all"
    )

    max_abs_value: float = Field(
        DEFAULT_MAX_ABS_VALUE, gt=0, description="largest magnitude a received float tensor may hold (logits, features, "
        "gradients, weights): results beyond it are rejected by the server half, tasks beyond it refused by the agent"
    )

    wire_dtype: Literal["float32", "float16", "int8"] = Field(
        "float32", description="how the per-row tensors travel (logits up; fbar and the discriminator's gradients "
        "down): float32, float16, or int8 with a float32 scale; the math runs in float32 on both ends"
    )
    wire_int8_scale: Literal["row", "tensor"] = Field(
        "row", description="wire_dtype int8: one scale per public row, or one per tensor"
    )

    disc_hidden: list[Annotated[int, Field(ge=1, le=65536)]] = Field(
        default_factory=lambda: [32, 256], max_length=16, description="discriminator hidden widths")
    disc_lr: float = Field(1e-4, gt=0, le=MAX_LR, description="discriminator Adam learning rate")

    # FedDF-AL and FedDF (ALGORITHMS.md section 1, variants)
    feddf_ref_glo: Literal["local_train", "average"] = Field(
        "local_train", description="FedDF(-AL): theta_ref_glo of the transfer stage's less-forgetting term: the "
        "client's model right after local training (ALGORITHMS.md), or the group average it then loads"
    )

    # FedHKD (ALGORITHMS.md section 4); FedHKD* is hkd_gamma = 0
    hkd_preset: Literal["paper", "official"] = Field(
        "paper", description="FedHKD: the paper's method, or what the authors' published code does"
    )
    hkd_lambda: float | None = Field(None, ge=0, description="FedHKD lambda: head term, softmax(G(H[j])/T) vs Q[j]")
    hkd_gamma: float | None = Field(None, ge=0, description="FedHKD gamma: feature term, R(x) vs H[y]")
    hkd_temperature: float = Field(0.5, gt=0, description="FedHKD T of the soft predictions")
    hkd_sigma: float = Field(7.0, ge=0, description="FedHKD (paper): noise multiplier, std = 2 zeta sigma / N_i^j")
    hkd_nu: float = Field(0.25, ge=0, le=1, description="FedHKD (paper): share class j only if N_i^j >= nu N_i")
    hkd_zeta: float = Field(3.0, gt=0, description="FedHKD (paper): features clipped to [-zeta, zeta] before averaging")
    hkd_official_noise_std: float = Field(2.0, ge=0, description="FedHKD (official): std of the one noise vector per upload")
    hkd_official_grad_clip: float = Field(1.1, gt=0, description="FedHKD (official): max gradient norm with knowledge")

    # FD, federated distillation (docs/algorithms.md, FD)
    fd_beta: float = Field(1.0, ge=0, description="FD gamma: weight of the distillation cross entropy to the label's teacher")
    fd_exclude_own: bool = Field(
        True, description="FD: a client's teacher averages the other clients' per-label outputs (the paper), or all"
    )
    fd_weighting: Literal["clients", "counts"] = Field(
        "clients", description="FD: each client's per-label mean weighs 1 (the paper), or its label count"
    )

    # FedProto (docs/algorithms.md, FedProto): fedproto (private prototypes), fedproto-public (public-row features)
    proto_lambda: float | None = Field(
        None, ge=0, description="FedProto lambda: weight of the distance between features and the global prototype "
        "(fedproto) or the average of the public-row features (fedproto-public)"
    )
    proto_weighting: Literal["count", "client"] = Field(
        "count", description="fedproto: global prototype of class j averaged over clients weighted by their "
        "count of class j (paper, eq. 6), or plainly over the clients that have it (authors' code)"
    )

    # CFD and MHAT (docs/algorithms.md, CFD and MHAT): soft labels on a fixed set of public rows
    cfd_bits: int | None = Field(
        None, ge=1, le=16, description="CFD/MHAT: bits b per soft-label entry on the wire, levels round(p (2^b - 1)) "
        "both ways (cfd: 1, the paper's; mhat: 16, uncompressed to 2^-17)"
    )
    cfd_delta: bool | None = Field(
        None, description="CFD/MHAT: upload only the entries that changed since the client's previous upload "
        "(a bitmap and their levels; cfd: on, mhat: off)"
    )
    cfd_public_rows: int | None = Field(
        None, ge=1, description="CFD/MHAT: how many public rows the soft labels cover, the same rows every round "
        "(unset: the whole public set)"
    )
    mhat_server_model: str = Field("mlp", description="MHAT: the zoo model the server distils the soft labels into")
    mhat_server_epochs: int = Field(1, ge=1, le=MAX_EPOCHS,
                                    description="MHAT: passes over the rows per round training the server model")
    mhat_server_lr: float = Field(1e-3, gt=0, le=MAX_LR, description="MHAT: the server model's Adam learning rate")

    # FCCL and FCCL+ (docs/algorithms.md, FCCL)
    fccl_pretrain_epochs: int | None = Field(
        None, ge=0, le=MAX_EPOCHS, description="fccl: passes of plain CE over the private data before round 0's "
        "collaboration; the result is the intra-domain teacher (authors' code: 40)"
    )
    fccl_col_weight: float = Field(1.0, ge=0, description="FCCL: weight of the cross-correlation loss on the public rows")
    fccl_offdiag_weight: float = Field(
        0.0051, ge=0, description="FCCL lambda: weight of the off-diagonal (decorrelation) terms of the cross-correlation loss"
    )
    fccl_inter_weight: float = Field(
        1.0, ge=0, description="FCCL: weight of the inter-domain KD to the previous round's model (FCCL+: non-target KD)"
    )
    fccl_intra_weight: float = Field(1.0, ge=0, description="fccl: weight of the intra-domain KD to the pretrained model")
    fccl_temperature: float | None = Field(
        None, gt=0, description="FCCL: temperature of the local KD terms (fccl 1, fccl-plus 3; both scaled by T^2)"
    )
    fccl_isl_weight: float = Field(3.0, ge=0, description="fccl-plus: weight of the instance-similarity loss")
    fccl_isl_temperature: float = Field(0.02, gt=0, description="fccl-plus: temperature of the instance similarities")

    # FedAKD (ALGORITHMS.md section 3)
    akd_alpha: float = Field(1.0, ge=0, description="FedAKD alpha: global -> local distillation weight")
    akd_beta: float = Field(1.0, ge=0, description="FedAKD beta: local -> global distillation weight")
    akd_temperature: float = Field(1.0, gt=0, description="FedAKD T of both distillation steps")
    akd_selection: Literal["correct", "all"] = Field(
        "correct", description="FedAKD: local -> global on the correctly classified samples, or on all"
    )
    akd_confidence: float = Field(
        0.0, ge=0, lt=1, description="FedAKD extension: also require this predicted-class probability (0: off)"
    )

    privacy: PrivacyParams | None = Field(
        None, description="differentially private training on the private data (fedal/privacy/, docs/privacy.md); "
        "unset: none"
    )

    @field_validator("mhat_server_model")
    @classmethod
    def _zoo_model(cls, v: str) -> str:
        return one_of(v, MODEL_NAMES, "model")

    @model_validator(mode="after")
    def _float16_holds_the_bound(self) -> StrategyParams:
        """Every value a receiver accepts must fit the wire form: float16 ends at 65504."""
        if self.wire_dtype == "float16" and self.max_abs_value > FLOAT16_MAX:
            raise ValueError(f"wire_dtype float16 holds magnitudes up to {FLOAT16_MAX:g}: "
                             f"max_abs_value {self.max_abs_value:g} must not exceed it")
        return self

    def manifest_dict(self) -> dict:
        """What the run manifest carries: every field, except `privacy` in a run without it, so an
        agent from before privacy existed joins a plain run as before, and refuses a private one
        (an unknown key) instead of training without the privacy it promises."""
        out = self.model_dump(mode="json")
        if out.get("privacy") is None:
            out.pop("privacy", None)
        return out

    def resolve(self, preset: dict) -> StrategyParams:
        """Fill unset fields from `preset`; fields the user set win (a field with a plain default,
        such as batch_size, is the preset's unless it was given)."""
        values = self.model_dump()
        for key, value in preset.items():
            if values.get(key) is None or (key in PRESET_OVER_DEFAULT and key not in self.model_fields_set):
                values[key] = value
        for key in ("tau", "local_epochs", "lambda_kd", "lambda_adv", "lambda_lf_loc", "lambda_lf_glo"):
            if values[key] is None:
                values[key] = {"tau": 5, "local_epochs": 0}.get(key, 0.0)
        return StrategyParams(**values)

    def foreign(self, own: tuple[str, ...], preset: dict) -> list[str]:
        """The knobs set here that the strategy with `own` parameters does not use: any field
        outside COMMON_PARAMS + own whose value is neither its default nor the preset's (a saved,
        fully resolved config therefore passes)."""
        allowed = set(COMMON_PARAMS) | set(own)
        resolved = StrategyParams().resolve(preset)
        out = []
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if name in allowed or value in (field.get_default(call_default_factory=True), getattr(resolved, name)):
                continue
            out.append(name)
        return out


# What a run may allocate for its server half. The discriminator (FedAL) lives on the server,
# sized num_classes -> disc_hidden -> one output per client: 2^24 parameters is 64 MiB of float32
# (four times that with Adam's moments and the gradients), over a thousand times the default's
# (about 10,000 for a few clients); beyond it a run (a simulation's config, or a spec over the
# coordinator's API) could take the machine's memory.
MAX_DISCRIMINATOR_PARAMS = 1 << 24


def discriminator_params(num_classes: int, hidden: list[int], num_clients: int) -> int:
    """Parameters of fedal.strategies.discriminator.Discriminator(num_classes, num_clients, hidden)."""
    widths = [num_classes, *hidden, num_clients]
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
