"""Launch configs as validated data, and the keys they are stored under.

Standard library only: `tuning_db` and `service` import this layer, and `import tuning_db`
must load neither torch nor triton. Choosing a config for a call is `cce_compile.resolve`.
"""
