"""Carrying a LoadPlan into a DeepSpeed engine: DeepSpeed's own resume, the module-only path (module weights,
then the optimizer's fp32 masters refreshed and verified), and the reshard of a full resume at another
shape. Reads no settings: the plan is the whole contract. Never imports saving/."""
