"""The optimizer's side of the state: how parameters are grouped and what its saved states depend on.

| module           | answers                                                                  |
|------------------|--------------------------------------------------------------------------|
| optimizers       | parameter groups (weight decay or not), DeepSpeed's CPU Adam step replay   |
| optimizer_layout | precision and ZeRO stage, from settings or a saved DeepSpeed config alike |
"""
