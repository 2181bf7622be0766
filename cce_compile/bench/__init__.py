"""The benchmark behind `cce bench`: LM-like inputs, the peers, the harness and its report."""
