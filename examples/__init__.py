"""The examples: each runs as a script (``python examples/<name>.py``) and imports its
siblings by name; ``examples._common`` also serves the GPU scripts (``scripts/``)."""
