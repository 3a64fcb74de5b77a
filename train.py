"""Entry point of every rank, started by deepy.py through the DeepSpeed launcher."""

from megatron.neox_arguments import load_args_on_rank
from megatron.training import pretrain

if __name__ == "__main__":
    pretrain(load_args_on_rank())
