"""The one-command GPU check (`python3 tools/device_check.py`): its steps, one module each,
the runner that gives each step a time limit, and the import shim for a plain checkout."""
