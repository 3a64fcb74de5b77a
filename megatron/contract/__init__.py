"""What the model is, as plain values, before any tensor exists: the contract every part builds to.

| module          | answers                                                                    |
|-----------------|----------------------------------------------------------------------------|
| architecture    | the model's shape and family (``Architecture``), resolved once from settings |
| lora_settings   | which layers get LoRA adapters and with which rank/alpha (PEFT's meanings)  |

No torch here: deepy.py, the settings checks and the converters read the contract without starting a rank.
"""
