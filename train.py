"""Entry point of every rank, started by deepy.py through the DeepSpeed launcher."""

import warnings

# megatron-core announces at import that NVIDIA's optional fused kernels are absent; we do not use them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.neox_arguments import load_args_on_rank  # noqa: E402
from megatron.training import pretrain  # noqa: E402

if __name__ == "__main__":
    pretrain(load_args_on_rank())
