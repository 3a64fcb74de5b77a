"""Formats from elsewhere: GPT-NeoX's older parameter names, and the interface through which a model folder
of another program (a Hugging Face folder, implemented in megatron.hf) is read as one more checkpoint
format. Imports nothing of the other stages."""
