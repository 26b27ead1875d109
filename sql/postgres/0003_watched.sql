-- iceberg_idempotency PostgreSQL store, schema version 3: NOTIFY only when
-- someone waits.
--
-- Adds watched, set by a waiter (a duplicate of an in-flight key, waiting
-- for its result with listen_notify on) on the in-flight row it waits for.
-- Finalize, Release, TakeOver, Abandon and Forget send their NOTIFY only
-- for a watched row, so a mutation nobody waits for no longer takes
-- PostgreSQL's global NOTIFY lock at commit. Existing rows start unwatched
-- (a waiter marks them like any other). Waiters on nodes still running a
-- build from before this version do not mark: during a rolling upgrade they
-- may wake by their fallback poll (listen_notify's 1 s) instead.
--
-- Apply after 0002_key_id.sql. The default is a constant, so adding the
-- column only changes the catalog (PostgreSQL 11+): no table rewrite, no
-- long lock.
--
-- TABLE NAME PLACEHOLDER: as in 0001_records.sql, every occurrence of
-- "iceberg_idempotency_records" stands for the configured table name. To
-- apply the file by hand with another table name:
--
--   sed 's/iceberg_idempotency_records/my_records/g' 0003_watched.sql \
--     | psql --single-transaction -v ON_ERROR_STOP=1 "$DATABASE_URL"
--
-- The file is idempotent (safe to run again). Every statement ends with ';'
-- at the end of a line: the store splits the file there.

-- watched: true once a waiter asked to be notified of the row's next change.
ALTER TABLE iceberg_idempotency_records
    ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false;

INSERT INTO iceberg_idempotency_records_schema (version) VALUES (3)
    ON CONFLICT (version) DO NOTHING;
