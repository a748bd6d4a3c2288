"""The decision store: SQLAlchemy models, Alembic migrations, the repository, the read-only lookup path.

Import the submodule you need (`mla_tune.store.repository.Store`,
`mla_tune.store.readonly.find_decisions`, `mla_tune.store.engine.StoreError`);
this package imports nothing so that the lookup path stays cheap.
"""
