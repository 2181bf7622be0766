"""Framework integrations, each in its own submodule (e.g. `cce_compile.integrations.transformers`).

Nothing is imported here, so `import cce_compile` never pulls in an optional framework.
"""
