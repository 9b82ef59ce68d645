"""Test-only shadow of the `sglang` package: `python -m sglang.launch_server` runs the stand-in server.

Only on PYTHONPATH in tests that ask for it (see tests/standins/sglang_standin/__init__.py); never installed.
"""
