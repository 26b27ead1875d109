-- iceberg_idempotency PostgreSQL store, schema version 1.
--
-- TABLE NAME PLACEHOLDER: every occurrence of "iceberg_idempotency_records"
-- in this file (the default table name, also the prefix of the version table
-- and of the index) stands for the configured table name. The store
-- substitutes it itself when auto_migrate is on. To apply the file by hand
-- with another table name, replace it the same way, for example:
--
--   sed 's/iceberg_idempotency_records/my_records/g' 0001_records.sql \
--     | psql --single-transaction -v ON_ERROR_STOP=1 "$DATABASE_URL"
--
-- The file is idempotent (safe to run again). Every statement ends with ';'
-- at the end of a line: the store splits the file there.

-- One row per applied schema version; the store refuses to start (or
-- migrates, with auto_migrate) when the latest version is missing.
CREATE TABLE IF NOT EXISTS iceberg_idempotency_records_schema (
    version    integer     PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- One row per Idempotency-Key. All times are written and compared with the
-- database clock (now()), never a Caddy node's clock.
CREATE TABLE IF NOT EXISTS iceberg_idempotency_records (
    key         varchar(36) PRIMARY KEY, -- the Idempotency-Key (lowercase UUID)
    operation   text        NOT NULL,    -- Iceberg REST operationId the key is bound to
    path        text        NOT NULL,    -- escaped request path the key is bound to
    principal   text        NOT NULL,    -- hex SHA-256 of the caller
    fingerprint text        NOT NULL,    -- hex SHA-256 of method, path, query, body
    state       text        NOT NULL CHECK (state IN ('in_flight', 'final')),
    owner       text,                    -- token of the owning reservation; NULL once final
    lease_until timestamptz,             -- in flight: abandoned once lease_until <= now()
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,    -- the row behaves as absent once expires_at <= now()
    status      integer,                 -- final: HTTP status code
    headers     text,                    -- final: JSON object of the replayed (allow-listed) headers
    body        bytea                    -- final: response body, byte for byte
);

-- PurgeExpired scans expired rows oldest first.
CREATE INDEX IF NOT EXISTS iceberg_idempotency_records_expires_at_idx
    ON iceberg_idempotency_records (expires_at);

INSERT INTO iceberg_idempotency_records_schema (version) VALUES (1)
    ON CONFLICT (version) DO NOTHING;
