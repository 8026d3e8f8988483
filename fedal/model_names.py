"""The model zoo's names, without torch: what a config on a workstation (`fedal fleet`, a
flashed agent config) is checked against before a device builds the model (fedal.models)."""

MODEL_NAMES: tuple[str, ...] = ("mlp", "cnn1d", "cnn1d_wide", "lenet5", "smallcnn", "wrn10_1", "wrn16_1", "resnet18")
MAX_NUM_CLASSES = 10_000  # the output width of every model (and of the discriminator's input)
