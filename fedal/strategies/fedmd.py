"""FedMD and its less-forgetting ablation FedMD-LF (fedal.txt section VI-A baselines).

Both are FedAL's code path with the adversarial term off (no discriminator runs and no
gradient is sent down, so K*B values go down per iteration instead of 2*K*B).
FedMD: no less-forgetting terms and tau = 1 (the paper's setting); FedMD-LF: both LF terms,
tau as FedAL.
"""

from fedal.strategies.base import StrategySpec
from fedal.strategies.fedal import PARAMS as PARAMS  # FedAL's round with other weights
from fedal.strategies.fedal import PHASES as PHASES
from fedal.strategies.fedal import FedALClient, FedALServer

FEDMD_PRESET = {"tau": 1, "lambda_kd": 1.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0}
FEDMD_LF_PRESET = {"tau": 5, "lambda_kd": 1.0, "lambda_adv": 0.0, "lambda_lf_loc": 1.0, "lambda_lf_glo": 1.0}

FedMDServer = FedALServer
FedMDClient = FedALClient


SPECS = (
    StrategySpec("fedmd", FedMDServer, FedMDClient, FEDMD_PRESET, PHASES, PARAMS, uses_public_set=True),
    StrategySpec("fedmd-lf", FedMDServer, FedMDClient, FEDMD_LF_PRESET, PHASES, PARAMS, uses_public_set=True),
)
