"""The `cce` command line; each module registers its commands on `main.app`."""
