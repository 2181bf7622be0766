"""Alembic environment: runs the migrations on the connection `tuning_db.migrate` opened,
inside its transaction (online only; the schema is never emitted as offline SQL)."""

from alembic import context

from tuning_db.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
