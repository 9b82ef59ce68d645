"""Built-in tools (plain functions run in the worker pool); the call format and ToolBox are in workflows/tools.py."""
