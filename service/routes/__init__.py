"""Routes only: each one checks its scope and calls tuning_db.store."""
