"""The load plan: from the inventory and the run's load settings (LoadSettings, load_settings.py), one LoadPlan
holding every decision of a load (the tag, loaded or fresh, strictness, the shape change in shape.py, the data
position, the DPO/KTO reference), checked against the settings (preflight.py) before any engine exists. Builds no
engine and writes nothing; imports ondisk/ and formats/ only."""
